"""What the V1 proposer needs around the copy source: each request's known text from the runner,
the copy's drafts for the whole batch, and the copies merged into the drafter's drafts.

The decisions (when copies are sent, which source a request takes) are the budget's
(``spec_decode/common/copy_policy.py``); the index is ``spec_decode/common/copy_source.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_dspark.spec_decode.common.copy_source import CopySource
from vllm_dspark.spec_decode.common.drafts import DraftBatch, Drafts
from vllm_dspark.spec_decode.common.sources import COPY_SOURCE


@dataclass(frozen=True)
class CopyOffer:
    """The copy source's drafts for the whole batch, made before the plan (they are what it weighs)."""

    drafts: Drafts  # [batch, N] target ids; confidence 0 past each copy
    lengths: list[int]  # copied tokens per request (0: no match, or not drafting)


def copy_texts(runner, req_ids: list[str], cad, num_rejected, next_token_ids) -> dict[int, tuple]:
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


def copy_offer(source: CopySource, req_ids: list[str], caps: list[int], texts: dict[int, tuple],
               next_token_ids, n: int) -> CopyOffer:
    """The copy source's drafts for every request that may draft this step, from ``texts`` (carried in
    the batch it drafts); the indexes of requests no longer in the batch are retired first."""
    source.retain(req_ids)
    rows = [i for i in range(len(req_ids)) if caps[i] > 0 and i in texts]
    tokens = torch.zeros(len(req_ids), n, dtype=torch.int64)
    conf = torch.zeros(len(req_ids), n, dtype=torch.float32)
    lengths = [0] * len(req_ids)
    if rows:
        got = source.draft(DraftBatch(rows=rows, anchors=next_token_ids, num_tokens=n,
                                      sampled=np.zeros(len(req_ids), dtype=bool), texts=texts))
        tokens[rows], conf[rows] = got.tokens, got.confidence
        for j, i in enumerate(rows):
            lengths[i] = int((got.confidence[j] > 0).sum())
    return CopyOffer(Drafts(tokens, conf, None, COPY_SOURCE, "copy"), lengths)


def merge_copies(model: Drafts, copy: Drafts, picks: list[str], sampled: np.ndarray) -> Drafts:
    """The model's drafts with the rows that picked the copy replaced by it. A sampled row's copy is a
    deterministic proposal: its q is one-hot on the copied token (the rejection sampler's ratio test
    is then exact); greedy rows need no q."""
    rows = [i for i, p in enumerate(picks) if p == COPY_SOURCE]
    dev = model.tokens.device
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    tokens, conf = model.tokens.clone(), model.confidence.clone()
    tokens[idx] = copy.tokens[rows].to(dev)
    conf[idx] = copy.confidence[rows].to(dev)
    probs = model.probs
    if probs is not None:
        probs = probs.clone()
        for i in rows:
            probs[i].zero_()
            if sampled[i]:
                probs[i].scatter_(-1, tokens[i].to(probs.device)[:, None], 1.0)
    return Drafts(tokens, conf, probs, model.source, model.path)
