"""The copy source: drafts a request's continuation from its own text (prompt and output so far).

Where a request restates its context (code edits, answers that quote the question, agent loops
that re-read tool output) the text after an earlier occurrence of its latest tokens is a better
draft than any model's. :class:`SuffixIndex` keeps, per request, where each recent n-gram
(``min_match`` .. ``max_match`` tokens) last ended, updated as tokens are accepted: a step costs
O(``max_match``) hashing and dictionary operations per new token, whatever the context length,
and the prompt is indexed once, vectorised (``benchmarks/bench_copy_source.py``). The draft is the
text that followed the most recent earlier occurrence of the longest suffix found; its match
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

MATCH_CAP = 64  # match lengths are measured up to here: beyond it, longer says nothing more


def match_confidence(match: int) -> float:
    """A match length's rank as a confidence in (0, 1); 0 for no match. Monotone, so that the
    calibrator's confidence bins order matches by length before it has measured them."""
    return 0.0 if match <= 0 else match / (match + 4.0)


_P = 0x9E3779B97F4A7C15  # odd 64-bit multiplier of the n-gram hash
_MASK = (1 << 64) - 1
_BULK = 256  # extensions longer than this (a prompt) are hashed with numpy
_POW = [pow(_P, i, 1 << 64) for i in range(MATCH_CAP + 1)]


class SuffixIndex:
    """One request's tokens, with the last end of every n-gram of ``min_match``..``max_match`` tokens.

    n-grams are keyed by a 64-bit polynomial hash, one table per length; a hit is checked against
    the tokens themselves, so a collision costs a lookup, never a wrong match. A prompt is hashed
    with numpy in max_match squared vector passes (32K tokens in 0.1 s, where a tuple of every
    n-gram took 0.7 s); accepted tokens are hashed one by one.
    """

    def __init__(self, min_match: int = 2, max_match: int = 8):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"copy source: need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.min_match, self.max_match = min_match, max_match
        self.tokens: list[int] = []
        # Per length: n-gram hash -> index of its last token, over n-grams ending before the newest
        # token (the newest suffix must find an EARLIER occurrence, never itself).
        self._last_end: dict[int, dict[int, int]] = {n: {} for n in range(min_match, max_match + 1)}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Sequence[int]) -> None:
        new = [int(t) for t in new]
        if len(new) > _BULK:
            self._extend_bulk(new)
            return
        toks = self.tokens
        for t in new:
            end = len(toks) - 1  # the previous newest token becomes indexable
            hashes = _hashes_ending(toks, end, min(self.max_match, end + 1))
            for n in range(self.min_match, len(hashes) + 1):
                self._last_end[n][hashes[n - 1]] = end
            toks.append(t)

    def _extend_bulk(self, new: list[int]) -> None:
        first = len(self.tokens)  # n-grams ending at first - 1 .. last - 1 become indexable
        self.tokens.extend(new)
        arr = np.asarray(self.tokens, dtype=np.uint64) + np.uint64(1)
        last = len(self.tokens) - 1
        with np.errstate(over="ignore"):  # the hash is arithmetic mod 2**64
            for n in range(self.min_match, self.max_match + 1):
                lo = max(first - 1, n - 1)  # the first end to index: a whole n-gram, not yet indexed
                if lo >= last:
                    continue
                ends = np.arange(lo, last, dtype=np.int64)
                h = np.zeros(len(ends), dtype=np.uint64)
                for j in range(n):
                    h = h * np.uint64(_P) + arr[ends - (n - 1) + j]
                self._last_end[n].update(zip(h.tolist(), ends.tolist(), strict=True))  # later ends win

    def propose(self, k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix,
        and the match length (0 and no tokens when no suffix of ``min_match`` tokens recurs)."""
        # The index holds n-grams ending before the newest token only, so the text's own suffix
        # can only be found earlier in it.
        return self.find(self.tokens, k)

    def find(self, query: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the latest indexed occurrence of ``query``'s longest
        suffix (``min_match``..``max_match`` tokens, cut at a :data:`SEP`), and the match length,
        extended backwards up to ``MATCH_CAP``; no tokens and 0 when none is found."""
        toks = self.tokens
        size = len(query)
        hashes = _hashes_ending(query, size - 1, min(self.max_match, size))
        for n in range(len(hashes), self.min_match - 1, -1):
            end = self._last_end[n].get(hashes[n - 1])
            if end is None or toks[end - n + 1:end + 1] != [int(t) for t in query[size - n:]]:
                continue
            match = n
            while match < MATCH_CAP and end - match >= 0 and match < size \
                    and toks[end - match] == int(query[size - 1 - match]):
                match += 1
            got = toks[end + 1:end + 1 + k]
            if SEP in got:
                got = got[:got.index(SEP)]
            return (got, match) if got else ([], 0)
        return [], 0


SEP = 1 << 62  # between texts in a shared index: no token equals it, so no match runs across it


def _hashes_ending(toks: Sequence[int], end: int, upto: int) -> list[int]:
    """Hashes of the n-grams of ``toks`` ending at ``end``, n = 1..upto, in one backward pass (the hash
    of n tokens is the hash of n - 1 plus the new first token times P^(n-1))."""
    out, h = [], 0
    for n in range(1, upto + 1):
        h = (h + (int(toks[end - n + 1]) + 1) * _POW[n - 1]) & _MASK
        out.append(h)
    return out


class SharedText:
    """Recent requests' outputs, one :class:`SuffixIndex` over them (separated by :data:`SEP`).

    Bounded by ``capacity`` tokens: past it the oldest outputs are dropped until three quarters
    remain and the index is rebuilt in bulk (a rebuild costs about 0.1 s per 32K tokens, once per
    quarter of the capacity written).
    """

    def __init__(self, capacity: int, min_match: int = 2, max_match: int = 8):
        self.capacity, self.min_match, self.max_match = int(capacity), min_match, max_match
        self.texts: list[list[int]] = []
        self.size = 0
        self.rebuilds = 0
        self.index = SuffixIndex(min_match, max_match)

    def add(self, tokens: Sequence[int]) -> None:
        text = [int(t) for t in tokens][-self.capacity:]
        if len(text) < self.min_match + 1:
            return
        self.texts.append(text)
        self.size += len(text) + 1
        if self.size > self.capacity:
            while self.texts and self.size > 0.75 * self.capacity:
                self.size -= len(self.texts.pop(0)) + 1
            self.index = SuffixIndex(self.min_match, self.max_match)
            self.index.extend([t for x in self.texts for t in (*x, SEP)])
            self.rebuilds += 1
            return
        self.index.extend([*text, SEP])

    def find(self, query: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the latest occurrence of ``query``'s longest suffix found
        here, and the match length (:meth:`SuffixIndex.find`)."""
        return self.index.find(query, k)


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
        tokens = torch.zeros(len(rows), n, dtype=torch.int64)
        conf = torch.zeros(len(rows), n, dtype=torch.float32)
        matches = np.zeros(len(rows), dtype=np.int64)
        from_shared = np.zeros(len(rows), dtype=bool)
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
                tokens[i, :len(got)] = torch.tensor(got, dtype=torch.int64)
                conf[i, :len(got)] = match_confidence(match)
            matches[i] = match
        self.last_matches, self.last_shared = matches, from_shared
        self.counts["drafts"] += int((matches > 0).sum())
        self.counts["from_shared"] += int(from_shared.sum())
        # q is one-hot on the copied token: the rejection sampler needs no probabilities for it
        # (greedy rows), and a sampled row's one-hot q is built by the caller that sends it.
        return Drafts(tokens, conf, None, self.name, "copy")
