"""A drafter that is never accepted and says it will be: the budget's worst case (issue 18).

The shipped drafter's config (same shapes, same cost per step) with seeded
noise for weights, so its drafts are as good as random, and a confidence head
that says ``confidence`` (0.9) at every position: a head that is confidently
wrong. A budget that took the head's word would verify every draft.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from vllm_dspark.cache import file_sha256
from vllm_dspark.checkpoint.io import load_checkpoint, save_checkpoint


def _fingerprint(like: Path) -> str:
    """sha256 of the source drafter's config and weights (26 MB for the default pair: a fraction of a second)."""
    digests = " ".join(file_sha256(like / name) for name in ("config.json", "model.safetensors"))
    return f"sha256={hashlib.sha256(digests.encode()).hexdigest()[:16]}"


def never_accepted_drafter(like: str | Path, out_dir: str | Path, *, confidence: float = 0.9,
                           seed: int = 0, scale: float = 0.02) -> Path:
    """Write the drafter into ``out_dir`` (reused when present with the same recipe) and return it."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), not {confidence}")
    out = Path(out_dir)
    # The source's files are part of the recipe: a drafter retrained in place (another trained
    # context, so another draft window) must not leave the worst case built from the old one.
    recipe = (f"like={Path(like).resolve()} {_fingerprint(Path(like))} confidence={confidence} seed={seed} "
              f"scale={scale}")
    stamp = out / "RECIPE"
    if stamp.is_file() and stamp.read_text() == recipe and (out / "model.safetensors").is_file():
        return out
    cfg, state = load_checkpoint(like)
    if not any(k.startswith("confidence_head.") for k in state):
        raise ValueError(f"{like}: the drafter has no confidence head; the worst case needs one")
    g = torch.Generator().manual_seed(seed)
    noisy = {}
    for name, t in state.items():
        if name.endswith("norm.weight"):
            noisy[name] = torch.empty(t.shape).uniform_(0.8, 1.2, generator=g)
        else:
            noisy[name] = torch.empty(t.shape).normal_(0.0, scale, generator=g)
    # The head reads nothing and says `confidence`: sigmoid(bias) = confidence everywhere.
    for name in noisy:
        if name.startswith("confidence_head.") and name.endswith("weight"):
            noisy[name].zero_()
        elif name.startswith("confidence_head.") and name.endswith("bias"):
            noisy[name].fill_(math.log(confidence / (1.0 - confidence)))
    save_checkpoint(out, cfg, noisy, extra_config={"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
    stamp.write_text(recipe)
    return out
