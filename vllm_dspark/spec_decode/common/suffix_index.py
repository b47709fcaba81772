"""The copy source's index: where each recent n-gram of a text last ended, and the suffix matches it finds.

Torch-free, so that the planner's side (the copy prior's offline walk, ``copy_prior.py``) reads it
without the runner's imports; :class:`~.copy_source.CopySource` drafts with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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
        # The shortest n-grams' FIRST ends too: a suffix that recurs only that short copies from its
        # earliest occurrence (see propose).
        self._first_end: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Sequence[int]) -> None:
        new = [int(t) for t in new]
        if len(new) > _BULK:
            self._extend_bulk(new)
            return
        toks, tables, lo, first = self.tokens, self._last_end, self.min_match, self._first_end
        for t in new:
            end = len(toks) - 1  # the previous newest token becomes indexable
            # _hashes_ending inlined: this runs for every accepted token of every request, every step.
            h = 0
            for n in range(1, min(self.max_match, end + 1) + 1):
                h = (h + (toks[end - n + 1] + 1) * _POW[n - 1]) & _MASK
                if n >= lo:
                    tables[n][h] = end
                    if n == lo:
                        first.setdefault(h, end)
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
                hs, es = h.tolist(), ends.tolist()
                self._last_end[n].update(zip(hs, es, strict=True))  # later ends win
                if n == self.min_match:  # earlier ends win, those already indexed first of all
                    merged = dict(zip(reversed(hs), reversed(es), strict=True))
                    merged.update(self._first_end)
                    self._first_end = merged

    def propose(self, k: int) -> tuple[list[int], int]:
        """``k`` tokens that followed the latest earlier occurrence of the longest suffix, and the
        match length (0 and no tokens when no suffix of ``min_match`` tokens recurs).

        A suffix that recurs only ``min_match`` tokens long copies from its EARLIEST occurrence instead,
        as vLLM's n-gram proposer does for every match. Walked over SmolLM2's float32 greedy answers
        (a step per verified draft, every draft sent), that took the steps from 3,203 to 3,173 on 40
        HumanEval prompts (n-gram 3,222) and from 713 to 707 on the copy-heavy set (n-gram 707), and
        cost 23 of 5,922 steps on chat (n-gram 6,217): with two tokens to go on, the first occurrence
        (often the prompt's) is the better guess; with more, the latest.

        An occurrence ``p`` tokens back whose continuation runs into the present (``p < k``: the text
        repeats with period ``p``, as code indentation and repeated lines do) continues with itself,
        as an overlapping LZ77 copy does: token ``j`` of the draft is token ``j - p``. Cut at the
        text's end instead, such a draft was 1 or 2 tokens long where its match said 16 or more;
        walked over SmolLM2's greedy HumanEval answers, this took the tokens accepted per proposal
        from 4.16 to 5.09 (vLLM's n-gram: 4.74), and changed nothing on the chat or copy-heavy sets.
        """
        # The index holds n-grams ending before the newest token only, so the text's own suffix
        # can only be found earlier in it.
        got, match = self.find(self.tokens, k, earliest_short=True)
        period = len(got)
        if 0 < period < k:  # (own text: no SEP, so a short continuation is one that reached the end)
            got = [got[j % period] for j in range(k)]
        return got, match

    def find(self, query: Sequence[int], k: int, *, earliest_short: bool = False) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the latest indexed occurrence of ``query``'s longest
        suffix (``min_match``..``max_match`` tokens, cut at a :data:`SEP`), and the match length,
        extended backwards up to ``MATCH_CAP``; no tokens and 0 when none is found. With
        ``earliest_short``, a match of only ``min_match`` tokens takes the earliest occurrence."""
        toks = self.tokens
        size = len(query)
        hashes = _hashes_ending(query, size - 1, min(self.max_match, size))
        for n in range(len(hashes), self.min_match - 1, -1):
            end = self._last_end[n].get(hashes[n - 1])
            if end is None or toks[end - n + 1:end + 1] != [int(t) for t in query[size - n:]]:
                continue
            match = self._matched(query, end, n)
            if earliest_short and match == self.min_match:
                first = self._first_end.get(hashes[n - 1])
                if first is not None and first != end and toks[first - n + 1:first + 1] == toks[end - n + 1:end + 1]:
                    end, match = first, self._matched(query, first, n)
            got = toks[end + 1:end + 1 + k]
            if SEP in got:
                got = got[:got.index(SEP)]
            return (got, match) if got else ([], 0)
        return [], 0

    def _matched(self, query: Sequence[int], end: int, n: int) -> int:
        """The match of ``query``'s suffix at ``end`` (``n`` tokens known equal), extended backwards."""
        toks, size, match = self.tokens, len(query), n
        while match < MATCH_CAP and end - match >= 0 and match < size \
                and toks[end - match] == int(query[size - 1 - match]):
            match += 1
        return match


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
