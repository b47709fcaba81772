#!/usr/bin/env python
"""The step planner's own time per step (feedback, plan, allocation, record), for two source trees.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/bench_planner.py --tree before=/tmp/before --tree after=. --batches 1,8

Answers "did this change make the draft step's decisions slower or faster?" without an engine: the
planner is torch-free, so each tree's :class:`StepPlanner` is driven in its own process
(``PYTHONPATH`` = the tree) through the same seeded sequence of steps: the copy's offers (match
lengths drawn per request), the drafter's confidences on the steps its forward runs, and each sent
draft's verdict drawn from its confidence. Between steps a cache-sized array is rewritten, as the
target's forward does to the caches in an engine (the planner's numpy otherwise runs warm and reads
several times faster than it does in serving). The cost model is a float32 profile of the default
pair on a 2-core AVX2 EPYC. Rounds interleave the trees; ratios are taken within a round.

It measures the planner's part of the proposer only: the copy's own drafting, the held context and
the runner's glue are not in it (``bench_propose_ab.py`` and the engine's timers have those).
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
N = 7
# verify seconds by tokens, drafter seconds by requests: the default pair in float32 (2-core AVX2 EPYC).
VERIFY = [(1, 0.0426), (2, 0.0442), (4, 0.0508), (8, 0.0634), (16, 0.085), (32, 0.128), (64, 0.21), (128, 0.38)]
DRAFT = [(1, 0.0055), (8, 0.012), (32, 0.035)]


def child(batch: int, steps: int, seed: int) -> dict:
    """Drive the tree's planner for ``steps`` steps at ``batch``; seconds per step of each call."""
    import numpy as np

    from vllm_dspark.serving.settings import DSparkSettings
    from vllm_dspark.spec_decode.common.costs import CostModel
    from vllm_dspark.spec_decode.common.planner import CopyDrafts, StepPlanner
    from vllm_dspark.spec_decode.common.suffix_index import match_confidence

    s = DSparkSettings(draft="d", block_size=N, num_draft_tokens=N, max_draft_tokens=N, query_layout="anchor_first",
                       has_confidence_head=True, verification="budget", threshold=0.5, window=None,
                       max_draft_context=None, draft_sampling="auto", use_markov=True, trained_context=4096,
                       served_context=4096)
    planner = StepPlanner(s, N, lambda fn: fn())
    planner.costs = CostModel(verify=VERIFY, draft=DRAFT, source="bench")
    rng = np.random.default_rng(seed)
    cold = np.zeros(4 << 20, dtype=np.uint8)  # 4 MiB: past L2, as a target forward's weights are
    req_ids = [f"r{i}" for i in range(batch)]
    caps, sampled = [N] * batch, np.zeros(batch, dtype=bool)
    timers = dict.fromkeys(("feedback", "plan", "allocate", "record"), 0.0)
    rejected: list[int] | None = None
    trail = []  # what was decided, step by step: two trees that decide alike leave the same trail
    for _ in range(steps):
        cold += 1  # the target's forward, as far as the caches can tell
        t0 = time.perf_counter()
        planner.feedback(req_ids, rejected)
        t1 = time.perf_counter()
        matches = [int(m) if rng.random() < 0.6 else 0 for m in rng.integers(2, 24, size=batch)]
        lengths = [N if m else 0 for m in matches]
        conf = np.array([[match_confidence(m)] * N if m else [0.0] * N for m in matches], dtype=np.float32)
        copy = CopyDrafts(conf, lengths)
        plan = planner.plan(caps, sampled, copy)
        t2 = time.perf_counter()
        model_conf = rng.random((batch, N)) * 0.6 if plan.drafter_runs else None
        if not plan.runs:
            planner.record_none(N, batch)
            t3 = t4 = time.perf_counter()
            rejected = None
        else:
            kept, picks = planner.allocate(plan, caps, sampled, model_conf, copy)
            t3 = time.perf_counter()
            confs = [(conf[i] if p == "copy" else (model_conf[i] if model_conf is not None else conf[i])).tolist()
                     for i, p in enumerate(picks)]
            planner.record(req_ids, plan, N, kept, picks, confs, sampled)
            t4 = time.perf_counter()
            # Each sent draft accepted position by position with its confidence's chance (a copy's, higher).
            acc = [next((j for j in range(k) if rng.random() > min(0.95, confs[i][j] + 0.2)), k)
                   for i, k in enumerate(kept)]
            rejected = [k - a for k, a in zip(kept, acc, strict=True)]
            trail.append((str(plan.mode), plan.sources, tuple(kept), tuple(picks)))
        for name, a, b in (("feedback", t0, t1), ("plan", t1, t2), ("allocate", t2, t3), ("record", t3, t4)):
            timers[name] += b - a
    import hashlib

    return {k: v / steps for k, v in timers.items()} | {"trail": hashlib.sha1(repr(trail).encode()).hexdigest()[:12],
                                                        "steps_sent": len(trail)}


def run_tree(tree: Path, batch: int, steps: int, seed: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--child", str(batch), str(steps), str(seed)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH (two or more)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.tree)
    if len(trees) < 2:
        ap.error("give two trees, NAME=PATH each")
    names = list(trees)
    print(f"[bench_planner] {os.uname().nodename}, {args.rounds} rounds x {args.steps} steps, trees {trees}",
          flush=True)
    for batch in (int(b) for b in args.batches.split(",")):
        per: dict[str, list[float]] = {n: [] for n in names}
        parts: dict[str, dict[str, list[float]]] = {n: {} for n in names}
        trails: dict[str, tuple] = {}
        for r in range(args.rounds):
            for n in (names if r % 2 == 0 else names[::-1]):
                got = run_tree(Path(trees[n]).resolve(), batch, args.steps, args.seed)
                trail = got.pop("trail"), got.pop("steps_sent")
                per[n].append(sum(got.values()))
                for k, v in got.items():
                    parts[n].setdefault(k, []).append(v)
                trails[n] = trail
        base = names[0]
        for n in names:
            ratios = [a / b for a, b in zip(per[n], per[base], strict=True)]
            detail = ", ".join(f"{k} {1e3 * statistics.median(v):.3f}" for k, v in parts[n].items())
            # The fastest round of each tree too: on a shared VM a neighbour only ever adds time.
            print(f"batch {batch} {n}: {1e3 * statistics.median(per[n]):.3f} ms a step ({detail}); "
                  f"/ {base} {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}], "
                  f"fastest rounds {min(per[n]) / min(per[base]):.3f}; "
                  f"decisions {trails[n][0]} ({trails[n][1]} steps sent drafts)", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
        sys.exit(0)
    sys.exit(main())
