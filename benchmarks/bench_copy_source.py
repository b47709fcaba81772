#!/usr/bin/env python
"""What the copy source costs per request: indexing a prompt once, then one decode step.

    .venv/bin/python benchmarks/bench_copy_source.py --out docs/benchmarks/copy-source

For contexts of 1K and 32K tokens (a code-like text with repeats, drawn from a fixed seed): the
time to index the prompt (once per request) and the time of one step (extend by the accepted
tokens, then propose k) with 1 and k + 1 tokens accepted, median over many steps. Writes
``report.md`` and ``results.json``. Pause other work first: this is a single-thread timing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_dspark.spec_decode.common.copy_source import SuffixIndex  # noqa: E402
from vllm_dspark.tools.cpu_setup import describe  # noqa: E402


def text(n: int, seed: int) -> list[int]:
    """Token ids with the statistics that matter here: a large vocabulary, and spans that recur."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        if len(out) > 64 and rng.random() < 0.3:
            start = rng.randrange(len(out) - 32)
            out.extend(out[start:start + rng.randrange(4, 32)])
        else:
            out.extend(rng.randrange(49152) for _ in range(rng.randrange(4, 16)))
    return out[:n]


def measure(context: int, k: int, steps: int, seed: int) -> dict:
    toks = text(context + steps * (k + 1), seed)
    idx = SuffixIndex()
    t0 = time.perf_counter()
    idx.extend(toks[:context])
    index_s = time.perf_counter() - t0
    per_step = {}
    for accepted in (1, k + 1):
        times = []
        pos = len(idx)
        for _ in range(steps):
            t0 = time.perf_counter()
            idx.extend(toks[pos:pos + accepted])
            idx.propose(k)
            times.append(time.perf_counter() - t0)
            pos += accepted
            if pos + accepted > len(toks):
                break
        per_step[accepted] = statistics.median(times)
    return {"context": context, "index_ms": index_s * 1e3,
            "step_us": {str(a): t * 1e6 for a, t in per_step.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "copy-source")
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    machine = describe()
    rows = [measure(int(c), args.k, args.steps, args.seed) for c in args.contexts.split(",")]
    result = {"machine": machine, "k": args.k, "steps": args.steps, "rows": rows,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(["benchmarks/bench_copy_source.py", *sys.argv[1:]])}
    lines = ["# The copy source's own cost per request\n", f"{result['date']}, {machine['cores']} cores, "
             f"{machine['cpu']}, flags: {' '.join(machine['flags'])}; `{result['command']}`\n",
             f"| context | index the prompt (once) | one step, 1 accepted | one step, {args.k + 1} accepted |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context']:,} | {r['index_ms']:.1f} ms | {r['step_us']['1']:.1f} us | "
                     f"{r['step_us'][str(args.k + 1)]:.1f} us |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
