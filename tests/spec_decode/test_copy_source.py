"""The copy source: the longest recurring suffix's continuation, found incrementally, never the suffix itself."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_dspark.spec_decode.common.copy_source import (
    MATCH_CAP,
    SEP,
    CopySource,
    SharedText,
    SuffixIndex,
    match_confidence,
)
from vllm_dspark.spec_decode.common.drafts import DraftBatch, DraftSource


def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> tuple[list[int], int]:
    """The definition: for the longest n in [lo, hi] whose suffix recurs earlier, the latest such
    occurrence's continuation (the earliest's when that match is only ``lo`` tokens); its match
    extended backwards up to MATCH_CAP."""
    size = len(tokens)

    def matched(end: int, n: int) -> int:
        match = n
        while match < MATCH_CAP and end - match >= 0 and tokens[end - match] == tokens[size - 1 - match]:
            match += 1
        return match

    for n in range(min(hi, size - 1), lo - 1, -1):
        suffix = tokens[size - n:]
        ends = [end for end in range(n - 1, size - 1) if tokens[end - n + 1:end + 1] == suffix]
        if not ends:
            continue
        end = ends[-1]
        if matched(end, n) == lo:
            end = ends[0]
        text = list(tokens)
        for j in range(end + 1, end + 1 + k):  # an overlapping copy: the draft continues itself
            text.append(text[j])
        return text[end + 1:end + 1 + k], matched(end, n)
    return [], 0


def test_it_copies_what_followed_the_earlier_occurrence():
    idx = SuffixIndex(2, 4)
    idx.extend([5, 6, 7, 8, 9, 1, 2, 5, 6])
    assert idx.propose(3) == ([7, 8, 9], 2)
    idx.extend([7])  # the suffix grows: 5 6 7 recurs
    assert idx.propose(3) == ([8, 9, 1], 3)


def test_no_match_and_never_itself():
    idx = SuffixIndex(2, 4)
    idx.extend([1, 2, 3, 4])
    assert idx.propose(4) == ([], 0)
    idx.extend([1])
    assert idx.propose(4) == ([], 0)  # a 1-token suffix is below min_match
    idx.extend([2])
    assert idx.propose(4) == ([3, 4, 1, 2], 2)


def test_the_latest_occurrence_wins_and_the_continuation_may_run_into_the_suffix():
    idx = SuffixIndex(2, 3)
    idx.extend([5, 1, 2, 9, 5, 1, 2, 8, 5, 1, 2])
    assert idx.propose(2) == ([8, 5], 3)
    rep = SuffixIndex(2, 8)
    rep.extend([4] * 6)
    assert rep.propose(3) == ([4, 4, 4], 5)  # the latest earlier end is one before the last: period 1


def test_a_suffix_recurring_only_at_the_shortest_length_copies_its_earliest_occurrence():
    idx = SuffixIndex(2, 3)
    idx.extend([1, 2, 9, 1, 2, 8, 1, 2])  # "1 2" recurs, "8 1 2" does not: n-gram's choice, the first
    assert idx.propose(2) == ([9, 1], 2)
    idx.extend([9, 1, 2])  # now "9 1 2" recurs: the latest occurrence of the longer match
    assert idx.propose(2) == ([8, 1], 5)  # (matched back to the start: "1 2 9 1 2")
    bulk = SuffixIndex(2, 3)
    bulk.extend([3, 4] + [0] * 300 + [3, 4, 6, 1, 3, 4])  # indexed in bulk: the first end is the prompt's
    assert bulk.propose(1) == ([0], 2)


def test_a_continuation_that_reaches_the_present_repeats_its_period():
    idx = SuffixIndex(2, 8)
    idx.extend([9, 1, 2, 3, 1, 2, 3, 1, 2])  # period 3: "1 2" last ended 3 tokens back, with "3" after it
    assert idx.propose(7) == ([3, 1, 2, 3, 1, 2, 3], 5)
    assert idx.propose(1) == ([3], 5)  # a draft no longer than the period is a plain copy
    code = SuffixIndex(2, 8)
    code.extend([7, 5, 5, 5, 6, 8, 5, 5, 5, 5])  # indentation: the latest "5 5 5" ends one token back
    assert code.propose(4) == ([5, 5, 5, 5], 3)


@pytest.mark.parametrize("seed", range(20))
def test_incremental_equals_the_definition(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 120))]
    idx = SuffixIndex(2, 6)
    pos = 0
    while pos < len(tokens):  # grown in uneven chunks, as steps accept 1..k tokens
        step = rng.randrange(1, 5)
        idx.extend(tokens[pos:pos + step])
        pos = min(len(tokens), pos + step)
        assert idx.propose(5) == brute_force(tokens[:pos], 5, 2, 6), (seed, pos)


def test_bad_match_lengths_are_refused():
    with pytest.raises(ValueError, match="min_match <= max_match"):
        SuffixIndex(5, 3)


def test_the_source_drafts_per_request_and_follows_each_request():
    texts = {"a": [1, 2, 3, 4, 1, 2], "b": [7, 7, 8]}
    order = ["a", "b"]
    # (request id, head, tail): the runner's array and this step's new tokens, split anywhere.
    src = CopySource(min_match=2, max_match=4)
    assert isinstance(src, DraftSource)

    def batch():
        return DraftBatch(rows=[0, 1], anchors=None, num_tokens=3, sampled=np.zeros(2, bool),  # type: ignore[arg-type]
                          texts={row: (order[row], texts[order[row]][:-1], texts[order[row]][-1:]) for row in (0, 1)})

    d = src.draft(batch())
    assert d.source == "copy" and d.probs is None
    assert d.tokens[0].tolist() == [3, 4, 1] and d.tokens[1].tolist() == [0, 0, 0]
    assert d.confidence[0].tolist() == [pytest.approx(match_confidence(2))] * 3 and d.confidence[1].sum() == 0
    assert src.last_matches.tolist() == [2, 0]
    texts["a"] = texts["a"] + [3]  # one token accepted: indexed incrementally
    texts["b"] = [9, 9, 9]  # its text changed under us (recomputed): indexed anew
    d = src.draft(batch())
    assert d.tokens[0].tolist() == [4, 1, 2] and src.last_matches[0] == 3
    assert d.tokens[1].tolist() == [9, 9, 9]  # period 1, continued
    src.retain(["b"])
    assert list(src.indexes) == ["b"]
    with pytest.raises(ValueError, match="no texts"):
        src.draft(DraftBatch(rows=[0], anchors=None, num_tokens=3, sampled=np.zeros(1, bool)))  # type: ignore[arg-type]


def test_head_and_tail_index_as_one_text():
    rng = random.Random(7)
    text = [rng.randrange(5) for _ in range(600)]
    whole = CopySource(min_match=2, max_match=5)
    pieces = CopySource(min_match=2, max_match=5)

    def batch(text_of_row):
        return DraftBatch(rows=[0], anchors=None, num_tokens=4, sampled=np.zeros(1, bool),  # type: ignore[arg-type]
                          texts={0: text_of_row})

    for end in (3, 300, 301, 420, 600):
        cut = max(0, end - rng.randrange(1, 4))
        a = whole.draft(batch(("r", text[:end], ())))
        b = pieces.draft(batch(("r", np.asarray(text[:cut]), text[cut:end])))
        assert torch.equal(a.tokens, b.tokens) and whole.last_matches.tolist() == pieces.last_matches.tolist()
        assert pieces.indexes["r"].tokens == text[:end]


def test_confidence_ranks_longer_matches_higher():
    got = [match_confidence(m) for m in range(0, 10)]
    assert got[0] == 0.0 and all(a < b for a, b in zip(got, got[1:])) and got[-1] < 1.0


@pytest.mark.parametrize("seed", range(6))
def test_a_prompt_indexed_in_bulk_equals_one_by_one(seed):
    rng = random.Random(100 + seed)
    tokens = [rng.randrange(6) for _ in range(rng.randrange(300, 900))]
    bulk, single = SuffixIndex(2, 6), SuffixIndex(2, 6)
    cut = rng.randrange(0, 40)
    bulk.extend(tokens[:cut])  # a short head, then a bulk tail (a prompt's remainder)
    bulk.extend(tokens[cut:])
    for t in tokens:
        single.extend([t])
    assert bulk._last_end == single._last_end and bulk._first_end == single._first_end
    for extra in ([1], [2, 3], [rng.randrange(6) for _ in range(5)]):
        bulk.extend(extra)
        single.extend(extra)
        assert bulk.propose(7) == single.propose(7) == brute_force(bulk.tokens, 7, 2, 6)


def _brute_find(text: list[int], query: list[int], k: int, lo: int, hi: int) -> tuple[list[int], int]:
    """The longest suffix of ``query`` (lo..hi tokens) occurring in ``text`` (latest occurrence), its
    continuation up to a separator, and the match extended backwards (as the index reports it)."""
    for n in range(min(hi, len(query)), lo - 1, -1):
        suf = query[len(query) - n:]
        for end in range(len(text) - 1, n - 2, -1):
            if text[end - n + 1:end + 1] == suf:
                got = text[end + 1:end + 1 + k]
                if SEP in got:
                    got = got[:got.index(SEP)]
                if not got:
                    return [], 0
                m = n
                while m < MATCH_CAP and end - m >= 0 and m < len(query) and text[end - m] == query[len(query) - 1 - m]:
                    m += 1
                return got, m
    return [], 0


@pytest.mark.parametrize("seed", range(4))
def test_shared_text_finds_what_a_brute_force_search_finds(seed):
    rng = random.Random(300 + seed)
    shared = SharedText(10_000, 2, 5)
    texts = [[rng.randrange(5) for _ in range(rng.randrange(3, 400))] for _ in range(6)]
    for t in texts:
        shared.add(t)
    flat = [x for t in texts for x in (*t, SEP)]
    assert shared.index.tokens == flat
    for _ in range(40):
        q = [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
        assert shared.find(q, 4) == _brute_find(flat, q, 4, 2, 5), q


def test_shared_text_is_bounded_and_keeps_the_newest():
    shared = SharedText(1000, 2, 4)
    for i in range(30):
        shared.add([i, i + 1000, i + 2000] * 30)  # 90 tokens each
    assert shared.size <= 1000 and shared.rebuilds >= 2
    assert shared.texts[-1][:3] == [29, 1029, 2029] and shared.texts[0][0] > 0
    assert shared.find([29, 1029], 2) == ([2029], 2)  # the latest occurrence, cut at its text's end
    assert shared.find([0, 1000], 2) == ([], 0)  # dropped with the oldest outputs


def test_a_request_copies_an_earlier_requests_output():
    texts: dict[int, tuple] = {}
    src = CopySource(min_match=2, max_match=4, shared=4096)
    batch = DraftBatch(rows=[0], anchors=None, num_tokens=3, sampled=np.zeros(1, bool),  # type: ignore[arg-type]
                       texts=texts)  # the dict is read at each draft: filled below
    # Request a: prompt [1, 2, 3] (3 tokens), output [10, 11, 12, 13, 14].
    texts[0] = ("a", [1, 2, 3, 10, 11, 12, 13], [14], 3)
    src.draft(batch)
    src.retain(["b"])  # a finished: its OUTPUT joins the shared text, not its prompt
    assert src.shared is not None and src.shared.texts == [[10, 11, 12, 13, 14]]
    texts[0] = ("b", [7, 7, 11], [12], 3)  # b's own text has no earlier "11 12"
    d = src.draft(batch)
    assert d.tokens[0].tolist() == [13, 14, 0] and bool(src.last_shared[0]) and src.last_matches[0] == 2
    texts[0] = ("b", [7, 7, 11, 12, 7, 7], [11], 3)  # now its own text matches longer: "7 7 11"
    d = src.draft(batch)
    assert d.tokens[0].tolist() == [12, 7, 7] and not src.last_shared[0]
