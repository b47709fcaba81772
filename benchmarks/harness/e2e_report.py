"""The end-to-end record from its rows: speed-ups against no speculation, the tables of ``report.md`` and the plots.

:mod:`.e2e_suite` measures and calls :func:`write_record`; ``--report-only`` (:func:`rewrite_report`) and
``benchmarks/plot_record.py`` read only the record's ``results.json``.
"""

from __future__ import annotations

import json
from pathlib import Path


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
    made.append(_save(fig, out, "speedup.png"))

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
    made.append(_save(fig, out, "acceptance_per_position.png"))

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
        made.append(_save(fig, out, "reliability.png"))

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
        made.append(_save(fig, out, "step_breakdown.png"))
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
    """``--report-only``: the report and plots again from ``results.json`` (no engine)."""
    data = json.loads((out / "results.json").read_text())
    write_report(data["meta"], report_rows(data["rows"]), out)
    return 0


def write_record(meta: dict, rows: list[dict], out: Path) -> None:
    """``results.json`` (the rows without their outputs: token ids are kept only to compare them), then the report."""
    annotate(rows)
    slim = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": slim}, indent=1))
    tmp.replace(out / "results.json")
    write_report(meta, slim, out)


def _save(fig, out: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name
