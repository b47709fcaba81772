#!/usr/bin/env python
"""What vLLM's recommended CPU set-up (tcmalloc + Intel OpenMP preloaded) buys here (a benchmark).

    .venv/bin/python benchmarks/bench_cpu_setup.py --out docs/benchmarks/cpu-setup

Every engine is alive at once and measured interleaved (``run_interleaved``):
no speculation, n-gram and DSpark, each with and without the preloads, bf16,
batch 1, HumanEval and chat prompts, until the end of the turn. The preloads
reach an engine through ``LD_PRELOAD`` in its environment at start-up (vLLM
spawns its engine processes), so one run holds both sides. The record gives the
CPU, its flags and each engine's ``LD_PRELOAD``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _ratio(a: list[float], b: list[float]) -> str:
    r = sorted(x / y for x, y in zip(a, b, strict=True))
    return f"{r[len(r) // 2]:.2f}x [{r[0]:.2f}-{r[-1]:.2f}]"


def tables(rows: list[dict], datasets) -> list[str]:
    """With / without the preloads per config, and each config against no speculation in the same set-up
    (median [min-max] of the per-repeat ratios: repeat i of both ran in the same round)."""
    by = {(r["config"], r["dataset"]): r for r in rows}
    lines = ["| dataset | config | tok/s without | tok/s with preloads | with / without |", "|---|---|---|---|---|"]
    same = ["", "Against no speculation in the same set-up:", "",
            "| dataset | config | without the preloads | with them |", "|---|---|---|---|"]
    for ds in datasets:
        for name in ("no-spec", "ngram", "dspark"):
            a, b = by[(name, ds)], by[(f"{name}+preload", ds)]
            lines.append(f"| {ds} | {name} | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | "
                         f"{b['tokens_per_s'] / a['tokens_per_s']:.2f}x |")
            if name != "no-spec":
                base, base_p = by[("no-spec", ds)]["repeats"], by[("no-spec+preload", ds)]["repeats"]
                same.append(f"| {ds} | {name} | {_ratio(a['repeats'], base)} | {_ratio(b['repeats'], base_p)} |")
    return lines + same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--datasets", default="humaneval,chat")
    ap.add_argument("--out", default=str(ROOT / "reports" / "cpu-setup"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from benchmarks.harness.e2e import EngineConfig, default_pair, dspark_spec, run_interleaved
    from vllm_dspark.tools import cpu_setup

    preload, missing = cpu_setup.preload_value()
    if missing:
        print(f"bench_cpu_setup: missing {', '.join(missing)}", file=sys.stderr)
        return 2
    plain = ":".join(p for p in os.environ.get("LD_PRELOAD", "").split(":") if p and "iomp" not in p
                     and "tcmalloc" not in p)
    pair = default_pair(args.prompts)
    pair.dtype = "bfloat16"
    datasets = {k: v for k, v in pair.datasets.items() if k in args.datasets.split(",")}
    ngram = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    configs = []
    for name, spec in (("no-spec", None), ("ngram", ngram), ("dspark", dspark_spec(pair.draft))):
        configs.append(EngineConfig(name, spec, env={"LD_PRELOAD": plain}))
        configs.append(EngineConfig(f"{name}+preload", spec, env={"LD_PRELOAD": preload}))
    t0 = time.monotonic()
    rows = run_interleaved(pair, configs, datasets, max_tokens=args.max_tokens, repeats=args.repeats,
                           log=lambda m: print(m, flush=True), kv_cache_gib=1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = tables(rows, datasets)
    meta = {"machine": cpu_setup.describe(), "preload": preload, "without": plain, "repeats": args.repeats,
            "max_tokens": args.max_tokens, "prompts": args.prompts, "dtype": "bfloat16",
            "seconds": round(time.monotonic() - t0), "command": " ".join(sys.argv)}
    slim = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": slim}, indent=1))
    head = f"# CPU set-up: tcmalloc + Intel OpenMP preloaded\n\n```\n{json.dumps(meta, indent=1)}\n```\n\n"
    (out / "report.md").write_text(head + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
