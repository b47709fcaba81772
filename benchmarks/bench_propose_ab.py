#!/usr/bin/env python
"""The DSpark proposer's own time per drafting step, for two source trees of this project, interleaved.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/bench_propose_ab.py --tree before=/tmp/before --tree after=. \\
        --batches 1,8,32 --out docs/benchmarks/propose-ab-layout-cuts

Answers "did this change make the draft step slower?" for a change inside the proposer (a
refactor, a new source). Each round runs every tree once, in turn, each in its own process
(``PYTHONPATH`` = the tree, so vLLM's engine processes load that tree's plugin): one engine on
the default pair with ``verification: fixed`` (every step drafts 7 tokens), greedy requests of
48 tokens at each of ``--batches``, measured on a second pass of the same requests. A step's
proposer time is the sum of the proposer's phase timers (``DSparkProposer.report()["timings_s"]``:
feedback, layout, block forward, Markov stage, verify) over the drafting steps, divided by their
number; ``outside_propose`` (the target's step, sampling and scheduling) is reported beside it,
not summed, and so are the parts inside the phases. Ratios are taken within a round (both trees
measured minutes apart), then summarised over rounds.

Pause other work on the machine first; the record names the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# After the tree under test (PYTHONPATH): its vllm_dspark wins, and this checkout's harness serves a
# tree from before benchmarks/ left the package.
sys.path.append(str(ROOT))
PHASES = ("feedback", "layout", "block_forward", "markov_stage", "verify")
# Parts inside those phases (each also counted in its phase); a tree that predates one reports none.
PARTS = ("block.metadata", "block.context_kv", "stage.lm_head", "stage.confidence", "stage.markov_op")


def child(dtype: str, batches: list[int]) -> dict:
    """One engine of the tree on ``sys.path``: ms per drafting step by phase, per batch run.

    Each batch runs twice, measured the second time: the first warms the prefix cache (so the
    measured run's prefill is a cache hit, not 257 x batch context rows averaged into the drafting
    steps) and any one-time setup of the drafter's kernels."""
    from vllm import SamplingParams

    from benchmarks.harness.engine import llm_engine
    from vllm_dspark.tools.default_pair import default_paths

    p = default_paths()
    spec = {"method": "dspark", "model": p["draft"], "num_speculative_tokens": 7,
            "dspark": {"verification": "fixed"}}
    out: dict[str, list] = {}
    with llm_engine(p["target"], speculative_config=spec, dtype=dtype, max_model_len=2048,
                    env={"VLLM_CPU_KVCACHE_SPACE": "2"}) as llm:
        def report():
            return llm.collective_rpc("dspark_report")[0]

        prompt = list(range(1000, 1257))
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        for batch in batches:
            reqs = [{"prompt_token_ids": [t + i for t in prompt]} for i in range(batch)]
            llm.generate(reqs, params, use_tqdm=False)
            r0 = report()
            llm.generate(reqs, params, use_tqdm=False)
            r1 = report()
            steps = r1["stats"]["steps_drafted"] - r0["stats"]["steps_drafted"]
            ms = {k: (r1["timings_s"][k] - r0["timings_s"][k]) * 1e3 / max(steps, 1) for k in r1["timings_s"]}
            out.setdefault(str(batch), []).append(
                {"steps": steps, "propose_ms": sum(ms[k] for k in PHASES),
                 **{k: round(ms[k], 3) for k in (*PHASES, *PARTS, "outside_propose") if k in ms}})
    return out


def cpu() -> str:
    from vllm_dspark.tools.cpu_setup import describe

    m = describe()
    return f"{m['cores']} cores, {m['cpu']}, flags: {' '.join(m['flags']) or 'none of avx2/avx512/amx'}"


def run_tree(path: Path, dtype: str, batches: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(path)}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", dtype, "--batches", batches],
                          env=env, cwd="/tmp",
                          capture_output=True, text=True, timeout=1200)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{path}: no result (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def summarise(rounds: list[dict], names: list[str]) -> list[str]:
    base = names[0]
    lines = [f"| batch | {' | '.join(f'{n} propose ms' for n in names)} | "
             f"{' | '.join(f'{n} / {base}' for n in names[1:])} |",
             "|---|" + "---|" * (2 * len(names) - 1)]
    for b in sorted({b for r in rounds for b in r[base]}, key=int):
        med = {n: statistics.median(x["propose_ms"] for r in rounds for x in r[n][b]) for n in names}
        ratios = {n: [statistics.median(x["propose_ms"] for x in r[n][b])
                      / statistics.median(x["propose_ms"] for x in r[base][b]) for r in rounds] for n in names[1:]}
        cells = [f"{med[n]:.1f}" for n in names]
        cells += [f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]" for v in ratios.values()]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return lines


def breakdown(rounds: list[dict], names: list[str]) -> list[str]:
    """Each tree's ms per drafting step by phase and part (median over rounds), batch by batch."""
    cols = [*PHASES, *PARTS, "outside_propose"]
    lines = ["| batch | tree | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for b in sorted({b for r in rounds for b in r[names[0]]}, key=int):
        for n in names:
            runs = [x for r in rounds for x in r[n][b]]
            cells = [f"{statistics.median(x[c] for x in runs):.2f}" if all(c in x for x in runs) else "-"
                     for c in cols]
            lines.append(f"| {b} | {n} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH of a source tree (two or more; "
                    "the first is the base of the ratios)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--batches", default="1,32", help="batch sizes, comma-separated (default 1,32)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(child(a.child, [int(b) for b in a.batches.split(",")])), flush=True)
        return 0
    trees = [t.split("=", 1) for t in a.tree]
    if len(trees) < 2 or any(len(t) != 2 for t in trees):
        ap.error("give at least two --tree NAME=PATH")
    names = [n for n, _ in trees]
    rounds = []
    for i in range(a.rounds):
        rnd = {}
        for name, path in trees:
            t0 = time.time()
            rnd[name] = run_tree(Path(path).resolve(), a.dtype, a.batches)
            print(f"round {i + 1}: {name} in {time.time() - t0:.0f} s: "
                  + ", ".join(f"batch {b} {[round(x['propose_ms'], 1) for x in v]} ms" for b, v in rnd[name].items()),
                  flush=True)
        rounds.append(rnd)
    table = summarise(rounds, names)
    table += ["", "Where the proposer's time goes (ms per drafting step; the parts are inside their phases):", "",
              *breakdown(rounds, names)]
    print("\n".join(table))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "results.json").write_text(json.dumps(
            {"command": " ".join(["benchmarks/bench_propose_ab.py", *sys.argv[1:]]), "cpu": cpu(), "dtype": a.dtype,
             "date": time.strftime("%Y-%m-%d"), "trees": dict(trees), "rounds": rounds}, indent=1) + "\n")
        (a.out / "report.md").write_text(
            f"# Proposer time per drafting step, {' vs '.join(names)}\n\n{time.strftime('%Y-%m-%d')}, {cpu()}, "
            f"{a.dtype}, {a.rounds} interleaved rounds.\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
