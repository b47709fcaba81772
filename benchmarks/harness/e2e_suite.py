"""A suite of ``benchmarks/bench_e2e.py`` from its command line: the pair, prompt sets, configurations and
concurrencies, the runner that measures them (:mod:`.lockstep`, or :mod:`.e2e`'s), and the record it writes
(:mod:`.e2e_report`)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

SUITES = ("default", "never-lose", "verification", "draft-vocab")
DEFAULT_CONCURRENCY = {"default": "1,8,32", "never-lose": "1,32", "verification": "1,4,16,64", "draft-vocab": "1,8,32"}


def suite_configs(suite: str, pair) -> list:
    from benchmarks.harness import e2e

    if suite == "never-lose":
        from benchmarks.harness.never_accepted import never_accepted_drafter
        from vllm_dspark.cache import cache_dir

        drafter = never_accepted_drafter(pair.draft, cache_dir() / "bench" / "never-accepted")
        return e2e.never_lose_configs(pair, str(drafter))
    if suite == "draft-vocab":
        return e2e.draft_vocab_configs(pair)
    return e2e.standard_configs(pair) if suite == "default" else e2e.verification_configs(pair)


def run(args) -> int:
    """Measure the suite ``args`` names and write its record into ``args.out``; 2 for an unknown configuration."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from dataclasses import replace

    from benchmarks.harness.e2e import default_pair, run_engine, run_interleaved, toy_pair
    from benchmarks.harness.e2e_report import write_record
    from vllm_dspark.tools import cpu_setup

    pair = replace(default_pair() if args.pair == "smollm2" else toy_pair(), dtype=args.dtype)
    datasets = pair.datasets
    if args.datasets:
        datasets = {k: v for k, v in datasets.items() if k in args.datasets.split(",")}
    elif args.suite == "verification":
        datasets = dict(list(datasets.items())[:1])
    conc = tuple(int(x) for x in (args.concurrency or DEFAULT_CONCURRENCY[args.suite]).split(","))
    temps = tuple(float(x) for x in args.temperatures.split(","))
    configs = suite_configs(args.suite, pair)
    if args.configs:
        names = [c.name for c in configs]
        unknown = [n for n in args.configs.split(",") if n not in names]
        if unknown:
            print(f"bench_e2e: --configs {','.join(unknown)}: not in the {args.suite} suite of the {pair.name} pair "
                  f"({', '.join(names)})", file=sys.stderr)
            return 2
        configs = [c for c in configs if c.name in args.configs.split(",")]
    per1 = args.prompts or 8

    def per_cell(c: int) -> int:
        return max(per1, args.waves * c)

    def log(m: str) -> None:
        print(m, flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = dict(concurrencies=conc, temperatures=temps, max_tokens=args.max_tokens, prompts_per_cell=per_cell,
                 log=log, ignore_eos=args.ignore_eos)
    t0 = time.monotonic()
    if args.lockstep:
        from benchmarks.harness.lockstep import run_lockstep

        rows = run_lockstep(pair, configs, datasets, repeats=args.repeats, builds=args.builds,
                            share=args.share_weights, kv_cache_gib=args.kv_cache_gib, queued=args.queued, **cells)
    elif args.repeats > 1:
        rows = run_interleaved(pair, configs, datasets, repeats=args.repeats, **cells)
    else:  # one engine at a time, in turn
        rows = []
        for i, cfg in enumerate(configs):
            print(f"== [{i + 1}/{len(configs)}] {cfg.name} ==", flush=True)
            rows += run_engine(pair, cfg, datasets, **cells)
    meta = {"suite": args.suite, "pair": pair.name, "target": pair.target, "draft": pair.draft,
            "ablation": pair.ablation, "dtype": pair.dtype, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "lockstep": args.lockstep, "builds": args.builds if args.lockstep else None, "queued": args.queued,
            "shared_weights": args.share_weights if args.lockstep else None, "ignore_eos": args.ignore_eos,
            "machine": cpu_setup.describe(),
            "prompts_per_cell": {c: per_cell(c) for c in conc}, "seconds": round(time.monotonic() - t0),
            "cpu_count": os.cpu_count(), "command": " ".join(sys.argv)}
    write_record(meta, rows, out)
    return 0
