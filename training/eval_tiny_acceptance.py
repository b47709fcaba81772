#!/usr/bin/env python
"""Offline acceptance of the bundled (or any) target + DSpark drafter pair at greedy.

    python training/eval_tiny_acceptance.py [--target DIR] [--drafter DIR] [--out FILE]

Plain torch, no vLLM: the target (Hugging Face) decodes each held-out prompt
greedily, then greedy speculative decoding is replayed with the reference
drafter (see ``training.pipeline.evaluate``). Prints and writes the mean
acceptance length and per-position acceptance with the Markov head, without
it (the DFlash-style ablation of the same drafter), and with the
confidence-gated early stop.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ASSETS = ROOT / "tests" / "fixtures" / "toy_pair"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, default=ASSETS / "target")
    ap.add_argument("--drafter", type=Path, default=ASSETS / "drafter")
    ap.add_argument("--prompts", type=Path, default=ASSETS / "prompts_heldout.jsonl")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--thresholds", default="0.3,0.5", help="early-stop thresholds to report")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch

    from training.pipeline.capture import load_target
    from training.pipeline.corpus import read_jsonl
    from training.pipeline.evaluate import greedy_chains, simulate_acceptance
    from training.pipeline.tokenizer import load_tokenizer
    from vllm_dspark.checkpoint import load_reference_model

    torch.set_num_threads(args.threads)
    t0 = time.time()
    tok = load_tokenizer(args.target)
    target = load_target(args.target)
    drafter = load_reference_model(args.drafter).eval()
    prompts = [r["prompt"] for r in read_jsonl(args.prompts)][:args.num_prompts]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    chains = greedy_chains(target, ids, args.new_tokens)
    lens = [len(i) for i in ids]
    print(f"{len(prompts)} prompts, {args.new_tokens} greedy tokens each "
          f"({time.time() - t0:.0f} s)", flush=True)
    results = {}
    runs = [("dspark", True, 0.0), ("no_markov", False, 0.0)]
    runs += [(f"dspark_early_stop_{t}", True, float(t)) for t in args.thresholds.split(",") if t]
    for name, use_markov, thr in runs:
        r = simulate_acceptance(target, drafter, chains, lens, use_markov=use_markov, threshold=thr)
        results[name] = {**r.as_dict(), "use_markov": use_markov, "threshold": thr}
        per = " ".join(f"{x:.2f}" for x in r.per_position)
        print(f"{name:>24}: mean acceptance length {r.mean_acceptance_length:.3f} "
              f"(drafted {r.mean_drafted:.2f}/step, {r.steps} steps) per position [{per}]", flush=True)
    out = {"target": str(args.target), "drafter": str(args.drafter), "prompts": str(args.prompts),
           "num_prompts": len(prompts), "new_tokens": args.new_tokens, "results": results,
           "wall_s": round(time.time() - t0, 1)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
