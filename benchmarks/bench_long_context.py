#!/usr/bin/env python
"""Acceptance against context length past the drafter's trained context, window on and off (a benchmark).

    .venv/bin/python benchmarks/bench_long_context.py --out docs/benchmarks/long-context

The default pair's drafter was trained on 1,024-token sequences; SmolLM2
serves 8,192. Real long documents (held-out files of the Python standard
library: never in the drafter's training data) are cut to about 512, 1K, 2K,
4K and 8K tokens and followed by a question; the target answers greedily
(float32) with:

* no speculation (the reference tokens),
* DSpark with the default window (the trained context, 1,024 tokens),
* DSpark with the window off (the drafter attends to every context token).

Verification is fixed (every draft verified) so acceptance measures the
drafter alone. Also recorded: the drafter's KV-cache blocks held by one
request at 8K, with and without the window (in-process engines, read from
vLLM's KV-cache manager). Writes results.json, report.md and a plot.
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

LENGTHS = (512, 1024, 2048, 4096, 8000)


def build_prompts(tok, lengths, per_length, seed=0):
    import random

    from training.pipeline.chat_prompts import heldout_documents

    docs = heldout_documents(min_chars=40000)
    rng = random.Random(seed)
    rng.shuffle(docs)
    head = "Explain what the following Python code does.\n\n```python\n"
    out = {}
    for n in lengths:
        rows = []
        for d in docs:
            ids = tok(d.text, add_special_tokens=False)["input_ids"]
            budget = n - 40  # the chat template and the question
            if len(ids) < budget:
                continue
            body = tok.decode(ids[:budget])
            text = tok.apply_chat_template([{"role": "user", "content": head + body + "\n```"}],
                                           add_generation_prompt=True, tokenize=False)
            rows.append({"source": d.rel_path, "prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]})
            if len(rows) == per_length(n):
                break
        out[n] = rows
    return out


def run(target, spec, prompts, max_tokens, *, probe_len=None):
    from vllm import SamplingParams

    from benchmarks.harness.engine import acceptance_summary, draft_kv_blocks, llm_engine, spec_metrics

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    res = {"by_length": {}}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with llm_engine(target, speculative_config=spec, env=env, dtype="float32", max_model_len=8192,
                    max_num_seqs=4, max_num_batched_tokens=2048) as llm:
        for n, rows in prompts.items():
            before = spec_metrics(llm) if spec else {}
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in rows], params, use_tqdm=False)
            entry = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "seconds": time.perf_counter() - t0,
                     "prompt_tokens": [len(r["prompt_token_ids"]) for r in rows]}
            if spec:
                after = spec_metrics(llm)
                delta = {k: ([a - b for a, b in zip(v, before.get(k, [0] * len(v)))] if isinstance(v, list)
                             else v - before.get(k, 0)) for k, v in after.items()}
                entry.update(acceptance_summary(delta))
            res["by_length"][n] = entry
            print(f"  context ~{n}: {entry.get('mean_acceptance_length', float('nan')):.2f} acceptance, "
                  f"{entry['seconds']:.0f} s", flush=True)
        if spec and probe_len:
            eng = llm.llm_engine
            eng.add_request("kv-probe", {"prompt_token_ids": prompts[probe_len][0]["prompt_token_ids"]}, params)
            held, target_held, info = [], [], {}
            while eng.has_unfinished_requests():
                eng.step()
                info = draft_kv_blocks(llm)
                rid = next((r for r in info["draft"] if r.startswith("kv-probe")), None)
                if rid is not None and info["decoding"].get(rid):
                    held.append(info["draft"][rid])
                    target_held.append(info["target"][rid])
            res["kv_probe"] = {"context": len(prompts[probe_len][0]["prompt_token_ids"]),
                               "draft_blocks_per_step": held, "target_blocks_per_step": target_held,
                               "block_size": info.get("block_size"), "draft_group_spec": info.get("draft_group_spec")}
    return res


PLOT = "acceptance_vs_context.png"


def plot(rows: list[dict], out: Path) -> str:
    """Acceptance against context for every DSpark configuration in ``rows``; returns the file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, n in enumerate(names):
        ax.plot([r["prompt_tokens_mean"] for r in rows], [r[n]["mean_acceptance_length"] for r in rows],
                marker="os"[i % 2], linestyle=["-", "--"][i % 2], label=n)
    ax.axvline(1024, color="gray", linewidth=0.8, linestyle=":")
    ax.text(1050, ax.get_ylim()[0] + 0.1, "trained context", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("mean acceptance length")
    ax.set_title("Acceptance past the drafter's trained context (greedy)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / PLOT, dpi=110)
    plt.close(fig)
    return PLOT


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "reports" / "long-context"))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

    from transformers import AutoTokenizer

    from benchmarks.harness.e2e import dspark_spec
    from vllm_dspark.tools import default_pair as dp

    paths = dp.default_paths()
    tok = AutoTokenizer.from_pretrained(paths["target"])
    lengths = tuple(int(x) for x in args.lengths.split(","))
    prompts = build_prompts(tok, lengths, lambda n: 4 if n <= 2048 else (3 if n <= 4096 else 2))
    configs = {"no-spec": None,
               "dspark window (default)": dspark_spec(paths["draft"], verification="fixed"),
               "dspark window off": dspark_spec(paths["draft"], verification="fixed", window="off")}
    t0 = time.monotonic()
    results = {}
    for name, spec in configs.items():
        print(f"== {name} ==", flush=True)
        results[name] = run(paths["target"], spec, prompts, args.max_tokens,
                            probe_len=max(lengths) if spec else None)
    base = results["no-spec"]["by_length"]
    rows = []
    for n in lengths:
        row = {"context": n, "prompts": len(prompts[n]),
               "prompt_tokens_mean": sum(base[n]["prompt_tokens"]) / max(1, len(base[n]["prompt_tokens"]))}
        for name in list(configs)[1:]:
            e = results[name]["by_length"][n]
            row[name] = {"mean_acceptance_length": e["mean_acceptance_length"],
                         "per_position_acceptance": e["per_position_acceptance"],
                         "greedy_identical": sum(a == b for a, b in zip(e["outputs"], base[n]["outputs"])),
                         "seconds": e["seconds"]}
        rows.append(row)
    kv = {name: results[name].get("kv_probe") for name in list(configs)[1:]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"target": paths["target"], "draft": paths["draft"], "dtype": "float32", "max_tokens": args.max_tokens,
            "trained_context": 1024, "served_context": 8192, "seconds": round(time.monotonic() - t0),
            "documents": {n: [r["source"] for r in prompts[n]] for n in lengths}, "command": " ".join(sys.argv)}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "kv_probe": kv}, indent=1))
    names = list(configs)[1:]
    lines = ["| context (tokens) | prompts | " + " | ".join(f"{n}: acceptance length | {n}: greedy = no-spec"
                                                      for n in names) + " |",
             "|---|---|" + "---|---|" * len(names)]
    for r in rows:
        lines.append(f"| {r['prompt_tokens_mean']:.0f} | {r['prompts']} | " + " | ".join(
            f"{r[n]['mean_acceptance_length']:.2f} | {r[n]['greedy_identical']}/{r['prompts']}" for n in names) + " |")
    kv_lines = ["| config | context | draft blocks held (decode, max) | target blocks held | block size | "
                "draft cache group |", "|---|---|---|---|---|---|"]
    for n, k in kv.items():
        if k:
            d = k["draft_blocks_per_step"]
            kv_lines.append(f"| {n} | {k['context']} | {max(d)} | {max(k['target_blocks_per_step'])} | "
                            f"{k['block_size']} | {k['draft_group_spec']} |")
    plot(rows, out)
    (out / "report.md").write_text(
        "# Long context: acceptance and draft KV past the trained context\n\n"
        f"```\n{json.dumps(meta, indent=1)}\n```\n\n"
        + "\n".join(lines) + "\n\n## Draft KV cache of one request\n\n" + "\n".join(kv_lines)
        + f"\n\nPlot (not kept in git): `python benchmarks/plot_record.py {out}` draws {PLOT}.\n")
    print("\n".join(lines))
    print("\n".join(kv_lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
