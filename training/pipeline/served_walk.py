"""Acceptance as serving sees it: each held-out answer walked the way vLLM walks it.

The teacher-forced metric (:func:`.trainer.evaluate`) averages over anchors drawn
uniformly from the answers. Serving does not: at anchor ``t`` it drafts a block,
the target accepts the longest prefix equal to its own argmax (``n`` drafts) and
adds its bonus token, and the next draft starts at ``t + n + 1``. A run of easy
tokens (a copied span) is accepted at many neighbouring anchors, so it counts
many times in the uniform mean and once when served. This module reports what a
greedy server with every draft verified (``verification: fixed``) would count.

Why the walk can be computed offline, exactly: with greedy verification every
accepted token is the target's own argmax, which on a greedy held-out answer is
the answer's next token. So the context a draft at ``t`` reads is the answer's
own prefix whatever the earlier drafts were, and the drafter's output at ``t``
does not depend on the walk. The hits of every anchor of an answer are computed
once, teacher-forced, in dense batches; the walk then only reads them. (The
Markov head's previous token is the drafter's own pick in serving and the
text's here; they agree on every position up to the first miss, which is all
the accepted length reads.)

Conventions, as vLLM's spec-decode metrics:

* one step per draft block; its acceptance length is ``1 + n`` (``n`` accepted
  drafts), so the mean is ``1 + accepted / drafts``;
* ``p_run_ge`` [k - 1] = P(n >= k) = ``num_accepted_tokens_per_pos[k-1] / num_drafts``.

Each answer (a maximal run of target-written tokens) is walked on its own: its
first token came from the prompt's prefill, so the first draft anchors on it;
the walk stops at the answer's last token (the end of the turn: no draft
follows it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from vllm_dspark.model.reference import DSparkDraftModel


def answer_spans(gen: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs ``[a, b)`` of target-written tokens (``gen`` 1)."""
    g = np.concatenate([[0], np.asarray(gen, dtype=np.int8), [0]])
    edges = np.flatnonzero(np.diff(g))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def walk(hits: np.ndarray, spans: Sequence[tuple[int, int]]) -> list[int]:
    """Accepted drafts per step of a greedy server walking ``spans``.

    ``hits`` [L, B] bool: ``hits[t, i]`` is True when the draft anchored at ``t``
    is right at its position ``i`` (already False past the answer's end).
    """
    steps = []
    for a, b in spans:
        t = a
        while t < b - 1:
            row = hits[t]
            n = int(np.argmin(row)) if not row.all() else len(row)
            steps.append(n)
            t += n + 1
    return steps


def summarize(steps: Sequence[int], block: int) -> dict:
    """Mean acceptance length and P(run >= k), k = 1..block, in vLLM's convention."""
    s = np.asarray(steps, dtype=np.int64)
    if len(s) == 0:
        return {"steps": 0, "accept_len": 1.0, "p_run_ge": [0.0] * block}
    return {"steps": int(len(s)), "accept_len": round(float(1 + s.mean()), 4),
            "p_run_ge": [round(float((s >= k).mean()), 4) for k in range(1, block + 1)]}


@torch.no_grad()
def anchor_hits(model: DSparkDraftModel, data, conv: int, embed: torch.Tensor, lm_head: torch.Tensor,
                scale: torch.Tensor | None, *, block_hits: Callable[..., torch.Tensor], use_markov: bool = True,
                chunk: int = 48) -> np.ndarray:
    """[L, B] hits of a draft at every anchor of conversation ``conv`` that a walk can visit.

    ``block_hits`` is the trainer's (``trainer.block_hits``, the teacher-forced eval's own hit
    computation), passed in so that this module and the trainer do not import each other."""
    length = data.length(conv)
    gen = data.gen[int(data.offsets[conv]):int(data.offsets[conv + 1])]
    anchors = torch.tensor([t for a, e in answer_spans(gen) for t in range(a, e - 1)], dtype=torch.int64)
    hits = np.zeros((length, model.config.block_size), dtype=bool)
    for s in range(0, len(anchors), chunk):
        part = anchors[s:s + chunk]
        hits[part.numpy()] = block_hits(model, data, conv, part, embed, lm_head, scale,
                                        use_markov=use_markov).numpy()
    return hits


@torch.no_grad()
def walk_conversations(model: DSparkDraftModel, data, embed: torch.Tensor, lm_head: torch.Tensor,
                       scale: torch.Tensor | None = None, *, block_hits: Callable[..., torch.Tensor],
                       max_tokens: int | None = None, use_markov: bool = True) -> list[list[int]]:
    """Each conversation's walk (accepted drafts per step), in order until ``max_tokens`` were read
    (None: all of them)."""
    was = model.training
    model.eval()
    per_conv: list[list[int]] = []
    tokens = 0
    for c in range(len(data)):
        if max_tokens is not None and tokens >= max_tokens:
            break
        gen = data.gen[int(data.offsets[c]):int(data.offsets[c + 1])]
        hits = anchor_hits(model, data, c, embed, lm_head, scale, block_hits=block_hits, use_markov=use_markov)
        per_conv.append(walk(hits, answer_spans(gen)))
        tokens += data.length(c)
    model.train(was)
    return per_conv


def served_walk(model: DSparkDraftModel, data, embed: torch.Tensor, lm_head: torch.Tensor,
                scale: torch.Tensor | None = None, *, block_hits: Callable[..., torch.Tensor],
                max_tokens: int | None = None, use_markov: bool = True) -> dict:
    """The served-walk metric on a held-out :class:`FeatureSet`: conversations in order until
    ``max_tokens`` (None: all). Returns :func:`summarize`'s dict plus the conversations and tokens read."""
    per_conv = walk_conversations(model, data, embed, lm_head, scale, block_hits=block_hits, max_tokens=max_tokens,
                                  use_markov=use_markov)
    steps = [n for conv in per_conv for n in conv]
    tokens = sum(data.length(c) for c in range(len(per_conv)))
    return {**summarize(steps, model.config.block_size), "conversations": len(per_conv), "tokens": tokens}


def bootstrap_accept_len(per_conv: Sequence[Sequence[int]], *, reps: int = 2000, seed: int = 0,
                         level: float = 0.95) -> dict:
    """The walk's acceptance length with a bootstrap interval over conversations: conversations are
    drawn with replacement, and each draw's acceptance length is ``1 + accepted / steps`` over the
    conversations drawn (a long answer weighs as much as it does when served)."""
    acc = np.asarray([sum(c) for c in per_conv], dtype=np.float64)
    steps = np.asarray([len(c) for c in per_conv], dtype=np.float64)
    if steps.sum() == 0:
        return {"accept_len": 1.0, "lo": 1.0, "hi": 1.0, "conversations": len(per_conv), "steps": 0}
    g = np.random.default_rng(seed)
    draw = g.integers(0, len(acc), size=(reps, len(acc)))
    boot = 1.0 + acc[draw].sum(1) / np.maximum(steps[draw].sum(1), 1.0)
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return {"accept_len": round(float(1 + acc.sum() / steps.sum()), 4), "lo": round(float(lo), 4),
            "hi": round(float(hi), 4), "conversations": len(per_conv), "steps": int(steps.sum())}
