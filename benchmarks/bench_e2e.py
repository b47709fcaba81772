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
``benchmarks/plot_record.py`` draws them again from ``results.json``. What a suite runs:
``benchmarks/harness/e2e_suite.py``; the report and plots: ``benchmarks/harness/e2e_report.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from benchmarks.harness import e2e_suite
    from vllm_dspark.tools import cpu_setup

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=e2e_suite.SUITES, default="default")
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
    args = ap.parse_args(argv)
    if args.queued and not args.lockstep:
        ap.error("--queued needs --lockstep (it sets the in-process schedulers' admission limit per cell)")
    return args


def main() -> int:
    from benchmarks.harness import e2e_suite
    from vllm_dspark.tools import cpu_setup

    args = parse_args()
    if args.report_only:
        from benchmarks.harness.e2e_report import rewrite_report

        return rewrite_report(Path(args.out))
    cpu_setup.reexec_with(not args.no_cpu_setup)
    return e2e_suite.run(args)


if __name__ == "__main__":
    sys.exit(main())
