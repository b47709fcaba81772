"""The step-cost record's plots, drawn from its ``results.json`` alone (``benchmarks/plot_record.py``: plots are
not committed)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness.step_cost_report import COMBINED


def plots(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    dts = list(result["dtypes"])
    batches = list(next(iter(result["dtypes"].values()))["analysis"]["by_batch"])

    def err(s):
        return ([1e3 * (s["median"] - s["min"])], [1e3 * (s["max"] - s["median"])])

    fig, axes = plt.subplots(len(dts), len(batches), figsize=(4.6 * len(batches), 3.8 * len(dts)), squeeze=False)
    for i, dt in enumerate(dts):
        an = result["dtypes"][dt]["analysis"]["by_batch"]
        for j, b in enumerate(batches):
            ax = axes[i][j]
            row = an[b]
            fq = sorted(row["floor_s"])
            ax.errorbar(fq, [1e3 * row["floor_s"][q]["median"] for q in fq],
                        yerr=[[1e3 * (row["floor_s"][q]["median"] - row["floor_s"][q]["min"]) for q in fq],
                              [1e3 * (row["floor_s"][q]["max"] - row["floor_s"][q]["median"]) for q in fq]],
                        marker="o", color="k", label="floor (PyTorch)", capsize=2)
            ks = sorted(k for k in row["spec"] if k >= 1)
            for field, label, color in (("step_s", "spec step (verify k)", "tab:red"),
                                        ("target_s", "spec target step", "tab:orange"),
                                        ("model_s", "vLLM model (fwd+logits)", "tab:purple")):
                ys = [row["spec"][k][field] for k in ks]
                ax.errorbar([1 + k for k in ks], [1e3 * s["median"] for s in ys],
                            yerr=[[1e3 * (s["median"] - s["min"]) for s in ys], [1e3 * (s["max"] - s["median"])
                                                                                for s in ys]],
                            marker=".", color=color, label=label, capsize=2)
            ax.errorbar([1], [1e3 * row["plain_s"]["median"]], yerr=err(row["plain_s"]), marker="s",
                        color="tab:blue", label="plain decode step", capsize=2, linestyle="none")
            if 0 in row["spec"]:
                s0 = row["spec"][0]["step_s"]
                ax.errorbar([1.1], [1e3 * s0["median"]], yerr=err(s0), marker="^", color="tab:green",
                            label="spec step, no drafts", capsize=2, linestyle="none")
            ax.set_title(f"{dt}, batch {b}")
            ax.set_xlabel("tokens per request")
            ax.set_ylabel("ms per step")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=110)
    plt.close(fig)
    made.append("step_time.png")

    fig, axes = plt.subplots(1, len(dts), figsize=(5.5 * len(dts), 4), squeeze=False)
    for i, dt in enumerate(dts):
        ax = axes[0][i]
        an = result["dtypes"][dt]["analysis"]["by_batch"]
        for b, color in zip(batches, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
            row = an[b]
            ks = sorted(row["spec"])
            xs = [1 + k for k in ks]
            ax.plot(xs, [row["spec"][k]["target_vs_floor"]["median"] for k in ks], "o-", color=color,
                    label=f"B={b} target step / floor")
            ax.plot(xs, [row["spec"][k]["step_vs_floor"]["median"] for k in ks], "x:", color=color,
                    label=f"B={b} step (with drafter) / floor")
            ax.plot([1], [row["plain_vs_floor"]["median"]], "s", color=color)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.1, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{dt}: ratio to the floor at the same tokens/request (square: plain decode)")
        ax.set_xlabel("tokens per request (1 = no drafts)")
        ax.set_ylabel("x floor")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ratio_to_floor.png", dpi=110)
    plt.close(fig)
    made.append("ratio_to_floor.png")

    fig, axes = plt.subplots(len(dts), len(batches), figsize=(4.6 * len(batches), 3.8 * len(dts)), squeeze=False)
    cmap = plt.get_cmap("tab20")
    colors = [cmap(i) for i in range(cmap.N)]
    for i, dt in enumerate(dts):
        an = result["dtypes"][dt]["analysis"]["by_batch"]
        for j, b in enumerate(batches):
            ax = axes[i][j]
            row = an[b]
            variants = [("plain", row["plain_phases_s"])] + [(f"k={k}", s["phases_s"])
                                                              for k, s in sorted(row["spec"].items())]
            bottom = [0.0] * len(variants)
            for c, p in enumerate(COMBINED):
                vals = [1e3 * ph.get(p, 0.0) for _, ph in variants]
                ax.bar(range(len(variants)), vals, bottom=bottom, color=colors[c % 20], label=p)
                bottom = [x + y for x, y in zip(bottom, vals)]
            fq = [1 if n == "plain" else 1 + int(n[2:]) for n, _ in variants]
            ax.plot(range(len(variants)), [1e3 * row["floor_s"].get(q, {}).get("median", float("nan")) for q in fq],
                    "k_", markersize=14, mew=2, label="floor (same tokens/req)")
            ax.set_xticks(range(len(variants)), [n for n, _ in variants], fontsize=7)
            ax.set_title(f"{dt}, batch {b}: phases")
            ax.set_ylabel("ms per step")
            if i == 0 and j == len(batches) - 1:
                ax.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "phases.png", dpi=110)
    plt.close(fig)
    made.append("phases.png")
    return made
