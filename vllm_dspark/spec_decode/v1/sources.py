"""The V1 proposer's draft sources: what each is given, and how their drafts become one step's.

The proposer iterates two kinds of :class:`~vllm_dspark.spec_decode.common.drafts.DraftSource`:

* **text sources** (``reads_hidden`` false: the copy source) draft from each request's accepted
  text, before the step's plan: their drafts are an :class:`Offer` the planner weighs. Each gets
  the batch's texts (:func:`request_texts`) in its :class:`DraftBatch`, never a callback into
  the proposer;
* the **model source** (the Markov stage) drafts from the block forward's hidden rows, after the
  plan, when the plan runs the drafter.

Once the planner has picked each request's source, :func:`pick_rows` takes each row's drafts
from the source it picked. The decisions are the planner's (``common/planner.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vllm_dspark.spec_decode.common import copy_prior
from vllm_dspark.spec_decode.common.copy_prior import CopyPrior
from vllm_dspark.spec_decode.common.drafts import DraftBatch, Drafts, DraftSource
from vllm_dspark.spec_decode.common.planner import CopyDrafts
from vllm_dspark.spec_decode.common.sources import MODEL_SOURCE

logger = logging.getLogger("vllm_dspark")


@dataclass(frozen=True)
class Offer:
    """A text source's drafts for the whole batch, made before the plan (they are what it weighs)."""

    drafts: Drafts  # [batch, N] target ids; confidence 0 past each draft
    lengths: list[int]  # drafted tokens per request (0: no draft, or the request does not draft)

    def view(self) -> CopyDrafts:
        """What the planner reads of it (NumPy, as the policies take it)."""
        return CopyDrafts(self.drafts.confidence.numpy(), self.lengths)


def request_texts(runner, req_ids: list[str], cad, num_rejected, next_token_ids) -> dict[int, tuple]:
    """Each decoding request's known text, by batch row: ``(req id, head, tail, prompt length)``.

    ``head`` is the runner's token array up to the drafts this step's verify accepted (they are
    still in the request's spec slots: the runner's bookkeeping runs after the drafter), read
    without a copy; ``tail`` is the new token. A request mid-prefill has none yet.
    """
    if runner is None:
        return {}
    ib = runner.input_batch
    n = len(req_ids)
    qlen = np.diff(cad.query_start_loc_cpu[: n + 1].numpy())
    rej = num_rejected.tolist() if num_rejected is not None else [0] * n
    nxt = next_token_ids[:n].tolist()
    out = {}
    for i, rid in enumerate(req_ids):
        n0 = int(ib.num_tokens_no_spec[i])
        spec = int(ib.num_computed_tokens_cpu[i]) + int(qlen[i]) - n0  # drafts this step verified
        if spec < 0:
            continue  # a prefill chunk: the prompt is not all in yet
        accepted = max(0, spec - int(rej[i]))
        out[i] = (rid, ib.token_ids_cpu[i, : n0 + accepted], (int(nxt[i]),), int(ib.num_prompt_tokens[i]))
    return out


def text_offers(sources: Sequence[DraftSource], req_ids: list[str], caps: list[int], texts: dict[int, tuple],
                next_token_ids, n: int) -> dict[str, Offer]:
    """Every text source's drafts for the requests that may draft this step. The batch names every
    request in it (``req_ids``), so a source can retire what it keeps for requests that left."""
    batch_size = len(req_ids)
    rows = [i for i in range(batch_size) if caps[i] > 0 and i in texts]
    batch = DraftBatch(rows=rows, anchors=next_token_ids, num_tokens=n, sampled=np.zeros(batch_size, dtype=bool),
                       texts=texts, req_ids=req_ids)
    offers = {}
    for src in sources:
        got = widen(src.draft(batch), batch_size, rows, n)
        offers[src.name] = Offer(got, [sum(c > 0 for c in row) for row in got.confidence.tolist()])
    return offers


def widen(drafts: Drafts, batch: int, rows: list[int], n: int) -> Drafts:
    """Drafts for ``rows`` ([len(rows), k]) placed in a [batch, n] record, zero elsewhere."""
    k = drafts.tokens.shape[1]
    if k == n and len(rows) == batch and rows == list(range(batch)):
        return drafts  # every row, in order: already the record (the usual copy offer at batch 1)
    dev = drafts.tokens.device
    tokens = torch.zeros(batch, n, dtype=torch.int64, device=dev)
    conf = torch.zeros(batch, n, dtype=torch.float32, device=dev)
    tokens[rows, :k], conf[rows, :k] = drafts.tokens, drafts.confidence
    probs = None
    if drafts.probs is not None:
        probs = torch.zeros(batch, n, drafts.probs.shape[-1], dtype=torch.float32, device=drafts.probs.device)
        probs[rows, :k] = drafts.probs
    return Drafts(tokens, conf, probs, drafts.source, drafts.path)


def pick_rows(drafts: Mapping[str, Drafts], picks: list[str], sampled: np.ndarray) -> Drafts:
    """One [batch, N] record: each row's drafts from the source ``picks`` names.

    The model's drafts are the base when it ran (its q for sampled rows); a row taken from a text
    source is a deterministic proposal, so a sampled row's q becomes one-hot on its token (the
    rejection sampler's ratio test is then exact) and greedy rows need none. Without the model's
    drafts there is no q at all: the rejection sampler then treats every draft as deterministic.
    """
    base = drafts.get(MODEL_SOURCE) or next(iter(drafts.values()))
    moved = [i for i, p in enumerate(picks) if p != base.source and p in drafts]
    if not moved:
        return base
    dev = base.tokens.device
    tokens, conf = base.tokens.clone(), base.confidence.clone()
    for i in moved:
        tokens[i] = drafts[picks[i]].tokens[i].to(dev)
        conf[i] = drafts[picks[i]].confidence[i].to(dev)
    probs = base.probs
    if probs is not None:
        probs = probs.clone()
        for i in moved:
            probs[i].zero_()
            if sampled[i]:
                probs[i].scatter_(-1, tokens[i].to(probs.device)[:, None], 1.0)
    return Drafts(tokens, conf, probs, base.source, base.path)


def copy_prior_for(s, spec) -> CopyPrior | None:
    """The copy's acceptance by match length stored with the drafter, when the copy drafts."""
    if not s.copies:
        return None
    draft_dir = getattr(spec.draft_model_config, "model", None) or getattr(spec, "model", None)
    prior = copy_prior.load(draft_dir) if draft_dir and Path(str(draft_dir)).is_dir() else None
    if prior is None:
        logger.info("vllm_dspark: the drafter has no %s: the copy source starts unproven and probes until its "
                    "acceptance is measured (training/copy_prior.py writes one)", copy_prior.PRIOR_FILE)
    else:
        logger.info("vllm_dspark: copy source from the first step: acceptance by match length from the drafter's "
                    "%s (%.2f copied tokens accepted per drafting step offline)", copy_prior.PRIOR_FILE,
                    prior.accepted_per_step())
    return prior
