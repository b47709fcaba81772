"""The copy source: the longest recurring suffix's continuation, found incrementally, never the suffix itself."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_dspark.spec_decode.common.copy_source import MATCH_CAP, CopySource, SuffixIndex, match_confidence
from vllm_dspark.spec_decode.common.drafts import DraftBatch, DraftSource


def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> tuple[list[int], int]:
    """The definition: for the longest n in [lo, hi] whose suffix recurs earlier, the latest such
    occurrence's continuation; its match extended backwards up to MATCH_CAP."""
    size = len(tokens)
    for n in range(min(hi, size - 1), lo - 1, -1):
        suffix = tokens[size - n:]
        for end in range(size - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                match = n
                while match < MATCH_CAP and end - match >= 0 and tokens[end - match] == tokens[size - 1 - match]:
                    match += 1
                return tokens[end + 1:end + 1 + k], match
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
    idx.extend([1, 2, 9, 1, 2, 8, 1, 2])
    assert idx.propose(2) == ([8, 1], 2)
    rep = SuffixIndex(2, 8)
    rep.extend([4] * 6)
    assert rep.propose(3) == ([4], 5)  # the latest earlier end is one before the last


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
    src = CopySource(lambda row: (order[row], texts[order[row]][:-1], texts[order[row]][-1:]), min_match=2,
                     max_match=4)
    assert isinstance(src, DraftSource)
    batch = DraftBatch(rows=[0, 1], anchors=None, num_tokens=3, sampled=np.zeros(2, bool))  # type: ignore[arg-type]
    d = src.draft(batch)
    assert d.source == "copy" and d.probs is None
    assert d.tokens[0].tolist() == [3, 4, 1] and d.tokens[1].tolist() == [0, 0, 0]
    assert d.confidence[0].tolist() == [pytest.approx(match_confidence(2))] * 3 and d.confidence[1].sum() == 0
    assert src.last_matches.tolist() == [2, 0]
    texts["a"] = texts["a"] + [3]  # one token accepted: indexed incrementally
    texts["b"] = [9, 9, 9]  # its text changed under us (recomputed): indexed anew
    d = src.draft(batch)
    assert d.tokens[0].tolist() == [4, 1, 2] and src.last_matches[0] == 3
    assert d.tokens[1].tolist() == [9, 0, 0]
    src.retain(["b"])
    assert list(src.indexes) == ["b"]


def test_head_and_tail_index_as_one_text():
    rng = random.Random(7)
    text = [rng.randrange(5) for _ in range(600)]
    whole = CopySource(lambda row: ("r", text, ()), min_match=2, max_match=5)
    split = {}
    pieces = CopySource(lambda row: ("r", *split["r"]), min_match=2, max_match=5)
    batch = DraftBatch(rows=[0], anchors=None, num_tokens=4, sampled=np.zeros(1, bool))  # type: ignore[arg-type]
    for end in (3, 300, 301, 420, 600):
        cut = max(0, end - rng.randrange(1, 4))
        split["r"] = (np.asarray(text[:cut]), text[cut:end])
        whole.tokens_of = lambda row, end=end: ("r", text[:end], ())
        a, b = whole.draft(batch), pieces.draft(batch)
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
    assert bulk._last_end == single._last_end
    for extra in ([1], [2, 3], [rng.randrange(6) for _ in range(5)]):
        bulk.extend(extra)
        single.extend(extra)
        assert bulk.propose(7) == single.propose(7) == brute_force(bulk.tokens, 7, 2, 6)
