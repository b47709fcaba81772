"""The copy source: drafts a request's continuation from its own text (prompt and output so far).

Where a request restates its context (code edits, answers that quote the question, agent loops
that re-read tool output) the text after an earlier occurrence of its latest tokens is a better
draft than any model's. :class:`SuffixIndex` (``suffix_index.py``) keeps, per request, where each recent n-gram
(``min_match`` .. ``max_match`` tokens) last ended, updated as tokens are accepted: a step costs
O(``max_match``) hashing and dictionary operations per new token, whatever the context length,
and the prompt is indexed once, vectorised (``benchmarks/bench_copy_source.py``). The draft is the
text that followed the most recent earlier occurrence of the longest suffix found (the earliest when
that suffix is only ``min_match`` tokens; continued with itself where it runs into the present:
:meth:`SuffixIndex.propose`); its match
length (extended backwards past ``max_match``, up to ``MATCH_CAP``) is the evidence the budget
calibrates on.

:class:`CopySource` is a :class:`~vllm_dspark.spec_decode.common.drafts.DraftSource`. A copied
draft is a deterministic proposal (q is one-hot on the copied token), so it goes through the
rejection sampler exactly as a greedy draft does. Its per-position confidence is a fixed,
increasing function of the match length (:func:`match_confidence`): the budget's per-source
calibrator turns it into measured survival, so the number itself only ranks matches.

:class:`SharedText` (``copy_shared``: a token budget, off by default) adds what suffix decoding
adds: the outputs of recent requests, one index over all of them, so a request can copy what an
earlier request wrote (a batch of similar edits, an agent re-reading a tool's answer). A request
takes whichever of its own text and the shared text holds the longer match (its own on a tie).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_dspark.spec_decode.common.drafts import DraftBatch, Drafts
from vllm_dspark.spec_decode.common.sources import COPY_SOURCE
from vllm_dspark.spec_decode.common.suffix_index import (  # noqa: F401 (re-exported)
    MATCH_CAP,
    SEP,
    SharedText,
    SuffixIndex,
    match_confidence,
)


class CopySource:
    """Drafts from each request's own text (a :class:`DraftSource`).

    Each batch row's request id and accepted tokens so far (prompt and output) come with the batch
    (``DraftBatch.texts``) as two pieces, ``head`` and ``tail`` (the runner's token array, read
    without a copy, and the few tokens this step added); the source extends its index by what is
    new since the last step and drops the index of a request it no longer sees (:meth:`retain`).
    """

    name = COPY_SOURCE
    reads_hidden = False

    def __init__(self, *, min_match: int = 2, max_match: int = 8, shared: int | None = None):
        self.min_match, self.max_match = min_match, max_match
        self.indexes: dict[str, SuffixIndex] = {}
        self.prompt_lens: dict[str, int] = {}
        self.shared = SharedText(shared, min_match, max_match) if shared else None
        self.last_shared = np.zeros(0, dtype=bool)  # which rows' drafts came from the shared text
        self.counts = {"drafts": 0, "from_shared": 0}
        self.last_matches: np.ndarray = np.zeros(0, dtype=np.int64)

    def _index(self, req_id: str, head: Sequence[int], tail: Sequence[int] = ()) -> SuffixIndex:
        """The request's index, extended to ``head + tail``."""
        idx = self.indexes.get(req_id)
        size, cut = len(head) + len(tail), len(head)

        def at(j: int) -> int:
            return int(head[j]) if j < cut else int(tail[j - cut])

        if idx is None or len(idx) > size or (len(idx) and idx.tokens[-1] != at(len(idx) - 1)):
            # New, or its text changed under us (preempted and recomputed): index it anew.
            idx = self.indexes[req_id] = SuffixIndex(self.min_match, self.max_match)
        start = len(idx)
        if start < cut:
            idx.extend(head[start:])
        idx.extend(tail[max(0, start - cut):])
        return idx

    def report(self) -> dict:
        sh = self.shared
        return {**self.counts, "requests_indexed": len(self.indexes),
                "shared": None if sh is None else {"capacity": sh.capacity, "tokens": sh.size, "texts": len(sh.texts),
                                                   "rebuilds": sh.rebuilds}}

    def retain(self, req_ids: Sequence[str]) -> None:
        """Drop the requests no longer seen; their outputs join the shared text, when there is one."""
        keep = set(req_ids)
        for gone in [r for r in self.indexes if r not in keep]:
            idx = self.indexes.pop(gone)
            start = self.prompt_lens.pop(gone, 0)
            if self.shared is not None:
                self.shared.add(idx.tokens[start:])

    def draft(self, batch: DraftBatch) -> Drafts:
        rows = list(batch.rows)
        n = batch.num_tokens
        # Filled in numpy and handed to torch without a copy: torch's per-op cost was most of a step here.
        tokens = np.zeros((len(rows), n), dtype=np.int64)
        conf = np.zeros((len(rows), n), dtype=np.float32)
        matches = [0] * len(rows)
        from_shared = [False] * len(rows)
        if batch.texts is None:
            raise ValueError("CopySource.draft: the batch carries no texts (DraftBatch.texts) to copy from")
        if batch.req_ids is not None:
            self.retain(batch.req_ids)
        for i, row in enumerate(rows):
            req_id, head, tail, *rest = batch.texts[row]
            if rest:  # the prompt's length: what the shared text must not take (outputs only)
                self.prompt_lens[req_id] = int(rest[0])
            idx = self._index(req_id, head, tail)
            got, match = idx.propose(n)
            if self.shared is not None:
                got_s, match_s = self.shared.find(idx.tokens[-MATCH_CAP:], n)
                if match_s > match:
                    got, match, from_shared[i] = got_s, match_s, True
            if got:
                tokens[i, :len(got)] = got
                conf[i, :len(got)] = match_confidence(match)
            matches[i] = match
        self.last_matches = np.array(matches, dtype=np.int64)
        self.last_shared = np.array(from_shared, dtype=bool)
        self.counts["drafts"] += sum(m > 0 for m in matches)
        self.counts["from_shared"] += sum(from_shared)
        # q is one-hot on the copied token: the rejection sampler needs no probabilities for it
        # (greedy rows), and a sampled row's one-hot q is built by the caller that sends it.
        return Drafts(torch.from_numpy(tokens), torch.from_numpy(conf), None, self.name, "copy")
