#!/usr/bin/env python
"""Side-by-side end-to-end benchmark of DSpark in vLLM (a benchmark, not a test).

    .venv/bin/python benchmarks/bench_e2e.py --suite default --out docs/benchmarks/e2e-smollm2
    .venv/bin/python benchmarks/bench_e2e.py --suite verification --pair smollm2 --out reports/verify

Suites (every configuration is its own engine, all in this one run; speed-ups
are ratios to the no-speculation engine of the same run and cell):

- ``default``: the default pair (SmolLM2-135M-Instruct) on the chat set and
  HumanEval, greedy and T = 1.0, concurrency 1, 8 and 32: no speculation,
  n-gram, the DFlash-style ablation (same backbone and data, no Markov head) and
  DSpark with its default settings;
- ``never-lose``: the chat set and HumanEval, greedy, concurrency 1 and 32: no
  speculation, n-gram, a drafter that is never accepted and whose confidence
  head says 0.9 everywhere (the shipped drafter's shapes, seeded noise for
  weights), and DSpark, all under the default settings;
- ``verification``: concurrency 1, 4, 16 and 64, greedy and T = 1.0: no
  speculation, fixed draft lengths 1, 3 and 7, the earlier product rule, the
  DSpark reference threshold rule and budgeted verification (``--pair smollm2``
  or ``toy``).

Speed is measured in ``--dtype`` (bf16 by default, the dtype users run). With
``--repeats`` > 1 (the default, 3) every engine stays alive and each cell is
run that many times, interleaved (A B C, B C A, ...); the speed-up is the
median of the per-repeat ratios, with their spread.

With ``--lockstep`` the engines run in this process and are stepped in turn,
one engine step at a time, and a second no-speculation engine (``no-spec-b``)
brackets the others as a control: each speed-up is against both controls, and
the control's own row is the run's A/A (:mod:`benchmarks.harness.lockstep`
says why: on this machine it narrows an A/A from [0.93-1.04] to [1.008-1.020]).
``--builds N`` builds the engines N times in rotated orders (engines built later
in one process ran faster), and ``--share-weights`` points every engine at the
first-built engine's target weights (where an engine's weights landed in memory
was most of that difference: see :mod:`benchmarks.harness.shared_weights`).

Writes ``results.json``, ``report.md`` and PNG plots (throughput, speed-up,
per-position acceptance, the confidence head's reliability, where a step's
time goes) into ``--out``. The plots are not committed with a record:
``benchmarks/plot_record.py`` draws them again from ``results.json``.
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


def _fmt_ratio(x):
    return f"{x:.2f}x" if x is not None else "-"


def annotate(rows: list[dict]) -> None:
    """Speed-up vs no-spec and greedy identity vs no-spec, per (dataset, concurrency, temperature)."""
    base = {(r["dataset"], r["concurrency"], r["temperature"]): r for r in rows if r["config"] == "no-spec"}
    for r in rows:
        b = base.get((r["dataset"], r["concurrency"], r["temperature"]))
        # Interleaved runs: the median of the per-repeat ratios (each repeat's pair ran back to back).
        r["speedup"] = r.get("speedup_median", r["tokens_per_s"] / b["tokens_per_s"] if b else None)
        if b is not None and r["temperature"] == 0.0 and r["config"] != "no-spec":
            same = [x == y for x, y in zip(r["outputs"], b["outputs"])]
            r["greedy_identical"] = f"{sum(same)}/{len(same)}"


def breakdown(r: dict) -> dict | None:
    """Seconds per step: the target's step (everything outside the proposer) and the drafter's parts."""
    d = r.get("dspark")
    if not d:
        return None
    steps = max(1, d["stats"]["steps"])
    t = d["timings_s"]
    # With every engine alive (interleaved), the time outside propose includes the other engines' turns.
    return {"steps": steps,
            "target_step_ms": None if "repeats" in r else 1e3 * t["outside_propose"] / steps,
            "drafter_forward_ms": 1e3 * (t["layout"] + t["block_forward"] + t["context_kv_only"]
                                         + t.get("held", 0.0) + t.get("context_flush", 0.0)) / steps,
            "markov_stage_ms": 1e3 * t["markov_stage"] / steps,
            # Parts of the stage (records before the proposer timed them have none).
            "lm_head_ms": 1e3 * t.get("stage.lm_head", 0.0) / steps,
            "markov_op_ms": 1e3 * t.get("stage.markov_op", 0.0) / steps,
            "python_overhead_ms": 1e3 * (t["feedback"] + t["verify"]) / steps}


def table(rows: list[dict]) -> str:
    lines = ["| pair | dataset | config | C | T | tok/s | vs no-spec | acc. len | admitted / drafted | "
             "steps w/o drafts | greedy = no-spec |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['mean_acceptance_length']:.2f}" if r.get("num_drafts") else "-"
        st = (r.get("dspark") or {}).get("stats")
        adm = f"{st['tokens_admitted']}/{st['tokens_drafted']}" if st else "-"
        skip = f"{st['steps_skipped']}/{st['steps']}" if st else "-"
        lines.append(f"| {r['pair']} | {r['dataset']} | {r['config']} | {r['concurrency']} | {r['temperature']:g} | "
                     f"{r['tokens_per_s']:.1f} | {_fmt_ratio(r['speedup'])} | {acc} | {adm} | {skip} | "
                     f"{r.get('greedy_identical', '-')} |")
    return "\n".join(lines)


def _ms(x) -> str:
    return "- (interleaved)" if x is None else f"{x:.1f}"


def breakdown_table(rows: list[dict]) -> str:
    lines = ["| dataset | config | C | T | steps | target step ms | drafter fwd ms | Markov stage ms | "
             "of which LM head / op ms | proposer overhead ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = breakdown(r)
        if b:
            lines.append(f"| {r['dataset']} | {r['config']} | {r['concurrency']} | {r['temperature']:g} | "
                         f"{b['steps']} | {_ms(b['target_step_ms'])} | {b['drafter_forward_ms']:.1f} | "
                         f"{b['markov_stage_ms']:.1f} | {b['lm_head_ms']:.2f} / {b['markov_op_ms']:.2f} | "
                         f"{b['python_overhead_ms']:.2f} |")
    return "\n".join(lines)


def calibration_table(rows: list[dict]) -> str:
    lines = ["| dataset | config | C | T | ECE | predicted / measured per position |", "|---|---|---|---|---|---|"]
    for r in rows:
        cal = (r.get("dspark") or {}).get("calibration")
        if not cal or not sum(cal["positions"]["count"]):
            continue
        pos = " ".join(f"{p:.2f}/{m:.2f}" for p, m, n in zip(cal["positions"]["predicted"],
                                                             cal["positions"]["measured"],
                                                             cal["positions"]["count"]) if n)
        lines.append(f"| {r['dataset']} | {r['config']} | {r['concurrency']} | {r['temperature']:g} | "
                     f"{cal['ece']:.3f} | {pos} |")
    return "\n".join(lines)


def plots(rows: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    configs = list(dict.fromkeys(r["config"] for r in rows))
    groups = list(dict.fromkeys((r["dataset"], r["temperature"]) for r in rows))
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.8), squeeze=False)
    for ax, (ds, t) in zip(axes[0], groups):
        for i, name in enumerate(configs):
            pts = sorted((r["concurrency"], r["speedup"]) for r in rows
                         if r["config"] == name and r["dataset"] == ds and r["temperature"] == t
                         and r["speedup"] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^Dv<>p"[i % 8],
                        linestyle=["-", "--", ":", "-."][i % 4], label=name)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("speed-up vs no speculation")
        ax.set_title(f"{ds}, T={t:g}")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)
    made.append("speedup.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    c0 = min(r["concurrency"] for r in rows)
    for i, r in enumerate(r for r in rows if r["concurrency"] == c0 and r.get("per_position_acceptance")):
        pp = r["per_position_acceptance"]
        ax.plot(range(1, len(pp) + 1), pp, marker="os^Dv<>p"[i % 8], linestyle=["-", "--", ":", "-."][i % 4],
                label=f"{r['config']} {r['dataset']} T={r['temperature']:g}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / draft steps")
    ax.set_title(f"Per-position acceptance, concurrency {c0}")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "acceptance_per_position.png", dpi=110)
    plt.close(fig)
    made.append("acceptance_per_position.png")

    cal_rows = [r for r in rows if (r.get("dspark") or {}).get("calibration")
                and sum(r["dspark"]["calibration"]["bins"]["count"])]
    if cal_rows:
        fig, ax = plt.subplots(figsize=(5, 5))
        ax.plot([0, 1], [0, 1], color="gray", linewidth=0.8)
        for i, r in enumerate(cal_rows[:8]):
            b = r["dspark"]["calibration"]["bins"]
            pts = [(p, m) for p, m, n in zip(b["predicted"], b["measured"], b["count"]) if n >= 5]
            ax.plot([p for p, _ in pts], [m for _, m in pts], marker="os^Dv<>p"[i % 8],
                    label=f"{r['config']} {r['dataset']} C={r['concurrency']} T={r['temperature']:g} "
                          f"(ECE {r['dspark']['calibration']['ece']:.3f})")
        ax.set_xlabel("predicted acceptance (confidence head)")
        ax.set_ylabel("measured acceptance")
        ax.set_title("Reliability of the confidence head")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "reliability.png", dpi=110)
        plt.close(fig)
        made.append("reliability.png")

    br = [(r, breakdown(r)) for r in rows if breakdown(r)]
    if br:
        fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(br)), 4))
        labels = [f"{r['config']}\n{r['dataset'][:5]} C{r['concurrency']} T{r['temperature']:g}" for r, _ in br]
        bottom = [0.0] * len(br)
        for key, name in (("target_step_ms", "target step"), ("drafter_forward_ms", "drafter forward"),
                          ("markov_stage_ms", "Markov stage"), ("python_overhead_ms", "proposer overhead")):
            vals = [b[key] or 0.0 for _, b in br]
            ax.bar(range(len(br)), vals, bottom=bottom, label=name)
            bottom = [x + y for x, y in zip(bottom, vals)]
        ax.set_xticks(range(len(br)))
        ax.set_xticklabels(labels, fontsize=5, rotation=90)
        ax.set_ylabel("ms per step")
        ax.set_title("Where a speculative step's time goes")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "step_breakdown.png", dpi=110)
        plt.close(fig)
        made.append("step_breakdown.png")
    return made


def write_report(meta: dict, slim: list[dict], out: Path) -> None:
    made = plots(slim, out)
    report = (f"# DSpark end-to-end benchmark ({meta['suite']}, {meta['pair']})\n\n```\n{json.dumps(meta, indent=1)}"
              f"\n```\n\n## Throughput and acceptance\n\n{table(slim)}\n\n## Where a step's time goes\n\n"
              f"{breakdown_table(slim)}\n\n## Calibration of the confidence head\n\n{calibration_table(slim)}\n\n"
               f"Plots (not kept in git): `python benchmarks/plot_record.py {out}` draws {', '.join(made)}.\n")
    (out / "report.md").write_text(report)
    print(table(slim))
    print(f"wrote {out}/results.json, report.md, {', '.join(made)}")


def report_rows(rows: list[dict]) -> list[dict]:
    """A record's rows as the report and plots read them: a repeated cell's speed-up is its median."""
    return [dict(r, speedup=r["speedup_median"]) if "speedup_median" in r else r for r in rows]


def rewrite_report(out: Path) -> int:
    """--report-only: the report and plots again from ``results.json`` (no engine)."""
    data = json.loads((out / "results.json").read_text())
    write_report(data["meta"], report_rows(data["rows"]), out)
    return 0


def main() -> int:
    from vllm_dspark.tools import cpu_setup

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=("default", "never-lose", "verification", "draft-vocab"), default="default")
    ap.add_argument("--pair", choices=("smollm2", "toy"), default="smollm2")
    ap.add_argument("--datasets", default=None, help="comma-separated subset of the pair's prompt sets")
    ap.add_argument("--configs", default=None, help="comma-separated subset of the configuration names")
    ap.add_argument("--concurrency", default=None, help="default: 1,8,32 (default) or 1,4,16,64 (verification)")
    ap.add_argument("--temperatures", default="0,1.0")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=None,
                    help="prompts per cell at concurrency 1 (cells at C use max(this, waves x C))")
    ap.add_argument("--waves", type=int, default=2, help="prompts per cell at concurrency C: waves x C")
    ap.add_argument("--out", default=str(ROOT / "reports" / "e2e"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved repeats per cell, every engine alive (1: one engine at a time, in turn)")
    ap.add_argument("--lockstep", action="store_true",
                    help="engines in this process, stepped in turn one step at a time, with a second no-spec "
                         "engine as the control (resolves a few percent where cells back to back cannot)")
    ap.add_argument("--builds", type=int, default=1,
                    help="--lockstep: build the engines this many times, in rotated orders, --repeats each "
                         "(later-built engines ran faster: see benchmarks/harness/lockstep.py)")
    ap.add_argument("--share-weights", action="store_true",
                    help="--lockstep: every engine reads the first-built engine's target weights (one copy in "
                         "memory: see benchmarks/harness/shared_weights.py)")
    ap.add_argument("--queued", action="store_true",
                    help="--lockstep: a cell at concurrency C queues all its requests (--waves x C) with at most C "
                         "running, as max_num_seqs C on a server keeps its batch full; without it, waves of C")
    ap.add_argument("--kv-cache-gib", type=int, default=2,
                    help="--lockstep: KV cache per engine (every engine of the run lives in this process)")
    cpu_setup.add_flag(ap)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="generate past the end of the turn to --max-tokens (how records before issue 17 were "
                         "measured: the invented turns after it are repetitive and easy to draft)")
    ap.add_argument("--report-only", action="store_true", help="rewrite report.md and the plots from --out's "
                    "results.json")
    args = ap.parse_args()
    if args.queued and not args.lockstep:
        ap.error("--queued needs --lockstep (it sets the in-process schedulers' admission limit per cell)")
    if args.report_only:
        return rewrite_report(Path(args.out))
    cpu_setup.reexec_with(not args.no_cpu_setup)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

    from dataclasses import replace

    from benchmarks.harness.e2e import (
        default_pair,
        draft_vocab_configs,
        never_lose_configs,
        run_engine,
        run_interleaved,
        standard_configs,
        toy_pair,
        verification_configs,
    )

    pair = replace(default_pair() if args.pair == "smollm2" else toy_pair(), dtype=args.dtype)
    datasets = pair.datasets
    if args.datasets:
        datasets = {k: v for k, v in datasets.items() if k in args.datasets.split(",")}
    elif args.suite == "verification":
        datasets = dict(list(datasets.items())[:1])
    default_conc = {"default": "1,8,32", "never-lose": "1,32", "verification": "1,4,16,64",
                    "draft-vocab": "1,8,32"}[args.suite]
    conc = tuple(int(x) for x in (args.concurrency or default_conc).split(","))
    temps = tuple(float(x) for x in args.temperatures.split(","))
    if args.suite == "never-lose":
        from benchmarks.harness.never_accepted import never_accepted_drafter
        from vllm_dspark.cache import cache_dir

        configs = never_lose_configs(pair, str(never_accepted_drafter(pair.draft, cache_dir() / "bench" /
                                                                      "never-accepted")))
    elif args.suite == "draft-vocab":
        configs = draft_vocab_configs(pair)
    else:
        configs = standard_configs(pair) if args.suite == "default" else verification_configs(pair)
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

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    t0 = time.monotonic()
    if args.lockstep:
        from benchmarks.harness.lockstep import run_lockstep

        rows = run_lockstep(pair, configs, datasets, concurrencies=conc, temperatures=temps,
                            max_tokens=args.max_tokens, repeats=args.repeats, builds=args.builds,
                            prompts_per_cell=per_cell,
                            log=lambda m: print(m, flush=True), ignore_eos=args.ignore_eos,
                            share=args.share_weights, kv_cache_gib=args.kv_cache_gib, queued=args.queued)
    elif args.repeats > 1:
        rows = run_interleaved(pair, configs, datasets, concurrencies=conc, temperatures=temps,
                               max_tokens=args.max_tokens, repeats=args.repeats, prompts_per_cell=per_cell,
                               log=lambda m: print(m, flush=True), ignore_eos=args.ignore_eos)
    for i, cfg in enumerate(configs if args.repeats <= 1 and not args.lockstep else []):
        print(f"== [{i + 1}/{len(configs)}] {cfg.name} ==", flush=True)
        rows += run_engine(pair, cfg, datasets, concurrencies=conc, temperatures=temps, max_tokens=args.max_tokens,
                           prompts_per_cell=per_cell, log=lambda m: print(m, flush=True),
                           ignore_eos=args.ignore_eos)
    annotate(rows)
    meta = {"suite": args.suite, "pair": pair.name, "target": pair.target, "draft": pair.draft,
            "ablation": pair.ablation, "dtype": pair.dtype, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "lockstep": args.lockstep, "builds": args.builds if args.lockstep else None, "queued": args.queued,
            "shared_weights": args.share_weights if args.lockstep else None, "ignore_eos": args.ignore_eos,
            "machine": cpu_setup.describe(),
            "prompts_per_cell": {c: per_cell(c) for c in conc}, "seconds": round(time.monotonic() - t0),
            "cpu_count": os.cpu_count(), "command": " ".join(sys.argv)}
    slim = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": slim}, indent=1))
    tmp.replace(out / "results.json")
    write_report(meta, slim, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
