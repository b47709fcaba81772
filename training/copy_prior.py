#!/usr/bin/env python
"""Measure the copy source's acceptance by match length on the committed evaluation answers, and store it
with the drafter (``copy_prior.json``), where serving starts the copy's calibrator from it.

    .venv/bin/python training/copy_prior.py                      # the default drafter's prior
    .venv/bin/python training/copy_prior.py --draft-dir DIR --sets eval_chat

The answers are the target's own greedy answers (``vllm_dspark/assets/smollm2/conversations``); each is
replayed with the copy drafting at every step (``vllm_dspark.spec_decode.common.copy_prior.measure``).
Sampled answers are left out: a copy is accepted there with the target's probability of the token, not
by equality.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from training.pipeline.conversations import unpack  # noqa: E402
from vllm_dspark.spec_decode.common import copy_prior  # noqa: E402
from vllm_dspark.tools import default_pair  # noqa: E402

SETS = ("eval_chat", "eval_humaneval", "eval_sharegpt")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-dir", type=Path, default=default_pair.draft_dir())
    ap.add_argument("--conversations", type=Path, default=default_pair.assets_dir() / "conversations")
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--positions", type=int, default=16, help="draft positions measured (a cap above the block's)")
    ap.add_argument("--min-match", type=int, default=2)
    ap.add_argument("--max-match", type=int, default=8)
    args = ap.parse_args(argv)
    if not (args.draft_dir / "config.json").is_file():
        ap.error(f"--draft-dir {args.draft_dir} holds no drafter (config.json)")
    texts, used = [], {}
    for name in args.sets.split(","):
        path = args.conversations / f"{name}.npz"
        if not path.is_file():
            ap.error(f"no {path}: the sets are {', '.join(SETS)}")
        rows, _ = unpack(path)
        greedy = [r for r in rows if float(r.get("temperature", 0.0)) == 0.0]
        texts += [(r["ids"], [tuple(s) for s in r["gen_spans"]]) for r in greedy]
        used[name] = {"conversations": len(rows), "greedy": len(greedy)}
        print(f"[copy_prior] {name}: {len(greedy)} of {len(rows)} conversations greedy", flush=True)
    t0 = time.perf_counter()
    prior = copy_prior.measure(texts, args.positions, min_match=args.min_match, max_match=args.max_match)
    prior.meta.update({"sets": used, "seconds": round(time.perf_counter() - t0, 1),
                       "command": " ".join(["training/copy_prior.py", *(argv if argv is not None else sys.argv[1:])])})
    out = args.draft_dir / copy_prior.PRIOR_FILE
    prior.save(out)
    rate = prior.hits.sum(axis=1) / prior.counts.sum(axis=1).clip(min=1)
    print(f"[copy_prior] {prior.meta['answers']} answers, {prior.meta['drafting_steps']} drafting steps, "
          f"{prior.accepted_per_step():.2f} copied tokens accepted per drafting step; conditional acceptance "
          f"by position {json.dumps([round(float(x), 2) for x in rate[:8]])}; wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
