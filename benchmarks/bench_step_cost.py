#!/usr/bin/env python
"""What one target step costs, by tokens per request: vLLM (plain, speculative) against a plain-PyTorch floor.

    .venv/bin/python benchmarks/bench_step_cost.py --dtypes bfloat16 --ks 0,7 --out /tmp/step-cost
    .venv/bin/python benchmarks/bench_step_cost.py --render-only --out docs/benchmarks/step-cost-floor-in-pair

For the default target (SmolLM2-135M-Instruct) in each dtype, at batch 1, 8 and 32:

- **plain**: vLLM without speculation, a decode step (1 token per request);
- **no drafts**: vLLM with DSpark, a step in which no draft is admitted (1 token per request;
  the drafter only stores the new tokens' context K/V, the path the budget takes when drafting
  does not pay);
- **verify k**: vLLM with DSpark verifying exactly k drafts per request (1 + k tokens);
- **floor**: the same checkpoint as a minimal Llama in plain PyTorch (no vLLM): fused QKV and
  gate/up GEMMs, a preallocated KV cache written in place, SDPA, the same threads, one forward
  of q tokens per request over a cache of ``--floor-context`` tokens, logits at every one of
  the q positions. Its logits are checked against vLLM's (plain decode steps, and a DSpark
  8-token verify step); the max abs differences go into the record and the run fails past
  ``--tolerance``.

What exactly is timed, and how the noise of a shared machine is kept out of the ratios
(lockstep, one process, rotated builds): ``benchmarks/harness/step_cost.py``. On a shared
machine, pause other work first (``docs/benchmarks/method.md``). Writes ``results.json``,
``report.md`` and PNG plots into ``--out`` (``benchmarks/harness/step_cost_report.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "step-cost", help="output folder")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ks", default="0,1,2,3,4,5,6,7", help="drafts per request of the speculative cells")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats per build")
    ap.add_argument("--builds", type=int, default=1,
                    help="start the worker this many times, its parts built in a rotated order, each build measuring "
                         "every cell --repeats times (a start's weight placement biases its repeats alike)")
    ap.add_argument("--min-seconds", type=float, default=0.5, help="per cell")
    ap.add_argument("--min-steps", type=int, default=5, help="per cell")
    ap.add_argument("--prompt-len", type=int, default=257,
                    help="tokens per prompt (2 full KV blocks of 128 + 1: re-added prompts hit the prefix cache)")
    ap.add_argument("--floor-context", type=int, default=None,
                    help="tokens in the floor's cache (default prompt-len + 32, about the engines' mean context)")
    ap.add_argument("--profile-steps", type=int, default=5, help="steps per profiled cell (0 = no profiler pass)")
    ap.add_argument("--profile-ks", default="0,1,3,5,7",
                    help="k of the profiled speculative cells (others use the nearest one's operator split)")
    ap.add_argument("--threads", type=int, default=None, help="OMP threads of the worker (default: all CPUs)")
    ap.add_argument("--kv-space", type=int, default=2,
                    help="VLLM_CPU_KVCACHE_SPACE (GiB) per engine (2 is plenty: cells hold batch x ~300-900 tokens)")
    ap.add_argument("--max-foreign", type=float, default=0.1,
                    help="re-run a cell when other processes used more CPUs than this during it")
    ap.add_argument("--retries", type=int, default=2, help="re-runs of a disturbed cell")
    ap.add_argument("--lockstep-gap-ms", type=float, default=20.0, help="untimed pause before every lockstep step")
    ap.add_argument("--tolerance", default="float32=0.01,bfloat16=1.0",
                    help="max abs logit difference allowed between the floor and vLLM, per dtype")
    ap.add_argument("--cpu-setup", action="store_true",
                    help="run with vLLM's CPU set-up (tcmalloc and Intel OpenMP preloaded). Off by default: it "
                         "speeds vLLM's engines and slows the plain-PyTorch floor (docs/cpu-backend.md), so ratios "
                         "to the floor would flatter vLLM")
    ap.add_argument("--render-only", action="store_true",
                    help="measure nothing: rewrite --out's report.md and plots from its results.json")
    a = ap.parse_args(argv)
    a.dtypes = a.dtypes.split(",")
    a.batches, a.ks, a.profile_ks = ([int(x) for x in v.split(",")] for v in (a.batches, a.ks, a.profile_ks))
    a.floor_context = a.floor_context or a.prompt_len + 32
    a.threads = a.threads or os.cpu_count() or 1
    a.tol = {k: float(v) for k, v in (p.split("=") for p in a.tolerance.split(","))}
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks.harness import step_cost

    if args.render_only:
        return step_cost.render_only(args.out)
    if argv is None:  # run as a script (the re-exec repeats its command line)
        from vllm_dspark.tools import cpu_setup

        cpu_setup.reexec_with(args.cpu_setup)
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join([".venv/bin/python benchmarks/bench_step_cost.py", *given])
    return step_cost.run(args, command)


if __name__ == "__main__":
    raise SystemExit(main())
