"""Checks of a draft vocabulary's id maps, ``d2t`` and ``t2d``, against the target vocabulary.

A drafter with a draft vocabulary of Vd ids scores over those ids only and hands
the target TARGET ids, mapped with ``d2t`` int64 [Vd]: OFFSETS, target id =
draft id + d2t[draft id] (speculators' convention; vLLM's
``map_draft_to_target`` does the same). A map that leaves the target vocabulary
crashes an embedding lookup on the GPU; one that sends two draft ids to one
target id makes the draft distribution double-count that token; a map that is
shifted proposes the wrong tokens and every draft is rejected without an error.
``t2d`` bool [V] (training only) marks the target ids the draft vocabulary
holds; when present it must mark exactly the ids ``d2t`` maps to.
"""

from __future__ import annotations

import torch

from vllm_dspark.ops.markov_reference import d2t_target_ids

MAX_EXAMPLES = 3


def _examples(draft_ids: torch.Tensor, targets: torch.Tensor) -> str:
    pairs = [f"draft id {int(d)} -> {int(t)}" for d, t in zip(draft_ids[:MAX_EXAMPLES], targets[:MAX_EXAMPLES])]
    return ", ".join(pairs)


def d2t_problems(d2t: torch.Tensor, vocab_size: int) -> list[str]:
    """Every reason ``d2t`` [Vd] is not a one-to-one map into the target vocabulary (empty when it is).

    Parameters
    ----------
    d2t : [Vd] integer offsets
    vocab_size : V, the target's vocabulary size
    """
    target = d2t_target_ids(d2t.to(torch.int64).reshape(-1))  # [Vd]
    problems = []
    outside = ((target < 0) | (target >= vocab_size)).nonzero().reshape(-1)
    if outside.numel():
        hint = ""
        # A map of absolute target ids (not offsets) is the usual mistake; say so when d2t itself would be valid.
        if bool(((d2t >= 0) & (d2t < vocab_size)).all()) and torch.unique(d2t).numel() == d2t.numel():
            hint = ("; d2t looks like absolute target ids, but it holds OFFSETS: store d2t[i] = target_id(i) - i")
        problems.append(
            f"d2t: {outside.numel()} of {d2t.numel()} draft ids map outside the target vocabulary "
            f"(0..{vocab_size - 1}) with target id = draft id + d2t[draft id] ({_examples(outside, target[outside])})"
            f"{hint}; re-export d2t for this target's vocabulary")
    values, counts = torch.unique(target, return_counts=True)
    repeated = values[counts > 1]
    if repeated.numel():
        first = int(repeated[0])
        sources = (target == first).nonzero().reshape(-1)[:MAX_EXAMPLES].tolist()
        problems.append(
            f"d2t: {repeated.numel()} target ids are reached from more than one draft id (e.g. target id {first} "
            f"from draft ids {sources}); the draft vocabulary must map one-to-one into the target's; re-export d2t")
    return problems


def t2d_problems(t2d: torch.Tensor, d2t: torch.Tensor, vocab_size: int) -> list[str]:
    """Every way ``t2d`` [V] bool disagrees with ``d2t`` [Vd] (empty when it marks exactly the mapped ids)."""
    if t2d.numel() != vocab_size:
        return []  # the shape check names it
    target = d2t_target_ids(d2t.to(torch.int64).reshape(-1))
    target = target[(target >= 0) & (target < vocab_size)]  # d2t_problems names the rest
    marked = t2d.reshape(-1).to(torch.bool)
    expected = torch.zeros(vocab_size, dtype=torch.bool)
    expected[target] = True
    differ = (marked != expected).nonzero().reshape(-1)
    if not differ.numel():
        return []
    unmarked = int((expected & ~marked).sum())
    extra = int((marked & ~expected).sum())
    return [f"t2d: disagrees with d2t at {differ.numel()} target ids (first: {int(differ[0])}): {unmarked} ids d2t "
            f"maps to are not marked and {extra} marked ids are not mapped (t2d marks {int(marked.sum())}, d2t maps "
            f"{d2t.numel()}); t2d must mark exactly the target ids draft id + d2t[draft id]: re-export t2d from d2t "
            "or drop it (serving reads only d2t)"]
