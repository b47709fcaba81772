"""accepted_context: a verify step's rejected context rows are left out of the drafter's layout."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_dspark.spec_decode.v1.accepted_context import accepted_context, accepted_rows


def _cad(query_lens: list[int], seq_lens: list[int]) -> CommonAttentionMetadata:
    loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(loc[-1])
    return CommonAttentionMetadata(
        query_start_loc=loc.clone(), query_start_loc_cpu=loc.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(query_lens), num_actual_tokens=n,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.zeros(len(query_lens), 4, dtype=torch.int32),
        slot_mapping=torch.arange(n, dtype=torch.int64))


def _step(query_lens, seq_lens):
    n = sum(query_lens)
    ids = torch.arange(100, 100 + n)
    positions = torch.arange(n) + 1000
    states = torch.arange(n * 3, dtype=torch.float32).view(n, 3)
    return ids, positions, states, _cad(query_lens, seq_lens)


def test_rejected_rows_are_dropped_and_the_metadata_follows():
    ids, positions, states, cad = _step([8, 8, 1], [20, 30, 40])
    rejected = torch.tensor([5, 0, 0], dtype=torch.int32)
    got = accepted_context(ids, positions, states, cad, rejected)
    assert got is not None
    keep = [0, 1, 2, *range(8, 16), 16]  # request 0 keeps its first 3 rows; the others keep all
    assert torch.equal(got.token_ids, ids[keep])
    assert torch.equal(got.positions, positions[keep])
    assert torch.equal(got.hidden_states, states[keep])
    assert got.cad.query_start_loc_cpu.tolist() == [0, 3, 11, 12]
    assert got.cad.query_start_loc.tolist() == [0, 3, 11, 12]
    assert got.cad.seq_lens.tolist() == [15, 30, 40]  # the accepted lengths, as upstream computes them
    assert got.cad.num_actual_tokens == 12 and got.cad.max_query_len == 8
    # What the layout reads besides: unchanged.
    assert got.cad.block_table_tensor is cad.block_table_tensor and got.cad.num_reqs == 3


def test_nothing_rejected_or_no_counts_keeps_upstreams_layout():
    ids, positions, states, cad = _step([4, 4], [10, 10])
    assert accepted_context(ids, positions, states, cad, None) is None
    assert accepted_context(ids, positions, states, cad, torch.zeros(2, dtype=torch.int32)) is None


def test_counts_that_reject_every_row_are_refused():
    ids, positions, states, cad = _step([2, 4], [10, 10])
    with pytest.raises(ValueError, match="rejected all of its context rows"):
        accepted_context(ids, positions, states, cad, torch.tensor([2, 0], dtype=torch.int32))


def test_every_kept_row_is_one_the_padded_layout_would_read():
    # The padded layout reads a request's rows [start, end - rejected); the result is exactly those, in order.
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        batch = int(torch.randint(1, 9, (1,), generator=gen))
        lens = torch.randint(1, 9, (batch,), generator=gen).tolist()
        rej = [int(torch.randint(0, n, (1,), generator=gen)) for n in lens]
        ids, positions, states, cad = _step(lens, [n + 50 for n in lens])
        got = accepted_context(ids, positions, states, cad, torch.tensor(rej, dtype=torch.int32))
        starts = cad.query_start_loc_cpu.tolist()
        want = [i for r in range(batch) for i in range(starts[r], starts[r + 1] - rej[r])]
        if not any(rej):
            assert got is None
            continue
        assert got is not None and got.token_ids.tolist() == [100 + i for i in want]


@pytest.mark.parametrize("query_lens,rejected", [
    ([4], [0]), ([4], [3]), ([8], [5]),  # one request: a slice
    ([3, 3], [0, 0]), ([2, 4, 1], None),  # nothing rejected: a slice
    ([3, 3], [1, 0]), ([4, 1, 8, 2], [3, 0, 5, 1]), ([5, 5], [0, 4]),  # gaps: an index
])
def test_accepted_rows_name_each_requests_kept_prefix_and_its_owner(query_lens, rejected):
    _, positions, _, cad = _step(query_lens, [20] * len(query_lens))
    got = accepted_rows(cad, None if rejected is None else torch.tensor(rejected), positions.device)
    rej = rejected or [0] * len(query_lens)
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    want = [s + j for s, q, r in zip(starts, query_lens, rej) for j in range(q - r)]
    assert positions[got.index].tolist() == [1000 + w for w in want]
    assert got.owners == [i for i, (q, r) in enumerate(zip(query_lens, rej)) for _ in range(q - r)]
    assert got.count == len(want) and got.most == max(q - r for q, r in zip(query_lens, rej))
    # The rows a slice can name take no index tensor (what made this cheap on a copy-only step).
    assert isinstance(got.index, slice) == (len(query_lens) == 1 or not any(rej))


def test_accepted_rows_refuse_counts_that_reject_every_row_and_run_only_on_the_host():
    _, positions, _, cad = _step([3, 2], [20, 20])
    assert accepted_rows(cad, torch.tensor([0, 2]), positions.device) is None
    assert accepted_rows(cad, torch.tensor([0, 0]), torch.device("meta")) is None
