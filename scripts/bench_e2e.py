#!/usr/bin/env python
"""Side-by-side end-to-end benchmark of DSpark in vLLM (not a test).

    .venv/bin/python scripts/bench_e2e.py --out reports/e2e

One engine per configuration, all in this run, on held-out prompts:
no speculation, vLLM's n-gram speculator, the drafter with its Markov head
disabled (the DFlash-style ablation), DSpark, DSpark with the confidence-gated
early stop, and DSpark with probabilistic drafts; batch 1, 8 and 32; greedy and
temperature 1.0.
Writes ``results.json``, ``report.md`` and PNG plots (acceptance per position,
tokens/s per configuration) into ``--out``. Speed is reported as a ratio to the
no-speculation engine of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "vllm_dspark" / "assets" / "default"


def _table(rows: list[dict]) -> str:
    base = {(r["batch_size"], r["temperature"]): r["tokens_per_s"] for r in rows if r["config"] == "no-spec"}
    lines = ["| config | batch | T | tok/s | speed-up vs no-spec | acceptance length | drafts cut | verified draft tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = base.get((r["batch_size"], r["temperature"]))
        ratio = f"{r['tokens_per_s'] / ref:.2f}x" if ref else "-"
        acc = f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else "-"
        cut = f"{r['cut_fraction']:.0%}" if "cut_fraction" in r else "-"
        ver = str(r.get("num_draft_tokens", "-"))
        lines.append(f"| {r['config']} | {r['batch_size']} | {r['temperature']:g} | {r['tokens_per_s']:.1f} | "
                     f"{ratio} | {acc} | {cut} | {ver} |")
    return "\n".join(lines)


def _plots(rows: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = ["-", "--", ":", "-."]
    first_bs = min(r["batch_size"] for r in rows)
    shown = [r for r in rows if r["batch_size"] == first_bs and r["temperature"] == 0.0
             and r.get("per_position_acceptance")]
    for i, r in enumerate(shown):  # overlapping curves stay visible through line style
        pp = r["per_position_acceptance"]
        ax.plot(range(1, len(pp) + 1), pp, marker="os^D"[i % 4], linestyle=styles[i % 4], label=r["config"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (accepted / draft steps)")
    ax.set_title(f"Per-position acceptance, batch {first_bs}, greedy")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "acceptance_per_position.png", dpi=120)
    made.append("acceptance_per_position.png")
    plt.close(fig)

    configs = list(dict.fromkeys(r["config"] for r in rows))
    workloads = list(dict.fromkeys((r["batch_size"], r["temperature"]) for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(configs)
    for ci, name in enumerate(configs):
        vals = [next((r["tokens_per_s"] for r in rows if r["config"] == name
                      and (r["batch_size"], r["temperature"]) == w), 0) for w in workloads]
        ax.bar([i + ci * width for i in range(len(workloads))], vals, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))])
    ax.set_xticklabels([f"bs{b} T{t:g}" for b, t in workloads])
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput per configuration (one run, same machine)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s.png", dpi=120)
    made.append("tokens_per_s.png")
    plt.close(fig)
    return made


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEFAULT / "target"))
    ap.add_argument("--draft", default=str(DEFAULT / "drafter"))
    ap.add_argument("--prompts", default=str(DEFAULT / "prompts_heldout.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--temperatures", default="0,1.0")
    ap.add_argument("--threshold", type=float, default=0.3)
    ap.add_argument("--configs", default="all", help="comma-separated subset of the configuration names")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=str(ROOT / "reports" / "e2e"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from vllm_dspark.bench.e2e import load_prompts, run_engine, standard_configs
    from vllm_dspark.config import DSparkConfig

    block = DSparkConfig.from_json(args.draft).num_draft_tokens
    prompts = load_prompts(args.prompts, args.num_prompts)
    bss = tuple(int(x) for x in args.batch_sizes.split(","))
    temps = tuple(float(x) for x in args.temperatures.split(","))
    configs = standard_configs(args.draft, block, args.threshold)
    if args.configs != "all":
        wanted = set(args.configs.split(","))
        configs = [c for c in configs if c.name in wanted or c.name.split("-early")[0] + "-early-stop" in wanted]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    t0 = time.monotonic()
    for i, cfg in enumerate(configs):
        print(f"== [{i + 1}/{len(configs)}] {cfg.name} ==", flush=True)
        rows += run_engine(args.target, cfg, prompts, batch_sizes=bss, temperatures=temps,
                           max_tokens=args.max_tokens, dtype=args.dtype, block=block,
                           log=lambda m: print(m, flush=True))
    greedy = {r["config"]: r["outputs"] for r in rows if r["temperature"] == 0.0 and r["batch_size"] == bss[0]}
    lossless = {k: v == greedy.get("no-spec") for k, v in greedy.items() if k != "no-spec"}
    meta = {"target": args.target, "draft": args.draft, "prompts": len(prompts), "max_tokens": args.max_tokens,
            "block": block, "threshold": args.threshold, "dtype": args.dtype, "seconds": time.monotonic() - t0,
            "greedy_identical_to_no_spec": lossless, "cpu_count": os.cpu_count()}
    slim = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": slim}, indent=2))
    tmp.replace(out / "results.json")
    table = _table(slim)
    plots = _plots(slim, out)
    (out / "report.md").write_text(
        f"# DSpark end-to-end benchmark\n\n{json.dumps(meta, indent=2)}\n\n{table}\n\n"
        + "\n".join(f"![{p}]({p})" for p in plots) + "\n")
    print(table)
    print(f"greedy outputs identical to no speculation: {lossless}")
    print(f"wrote {out}/results.json, report.md, {', '.join(plots)}")
    return 0 if all(lossless.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
