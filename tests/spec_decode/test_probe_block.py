"""probe_queries: a probe's query blocks moved to the front, with metadata of the probed requests alone."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_dspark.spec_decode.v1.probe_block import probe_queries

PER_REQ = 3


def _layout(batch: int):
    n = batch * PER_REQ
    ids = torch.arange(n, dtype=torch.int32) + 100
    positions = torch.arange(n, dtype=torch.int64) + 1000
    slots = torch.arange(n, dtype=torch.int64) + 5000
    loc = torch.arange(batch + 1, dtype=torch.int32) * PER_REQ
    cad = CommonAttentionMetadata(
        query_start_loc=loc.clone(), query_start_loc_cpu=loc.clone(),
        seq_lens=torch.arange(batch, dtype=torch.int32) + 20, num_reqs=batch, num_actual_tokens=n,
        max_query_len=PER_REQ, max_seq_len=20 + batch, block_table_tensor=torch.arange(batch * 2).view(batch, 2),
        slot_mapping=slots[:n], causal=False, seq_lens_cpu_upper_bound=torch.arange(batch, dtype=torch.int32) + 30)
    return (ids, positions, slots), cad


@pytest.mark.parametrize("within", [[0, 1, 2], [1, 2]])  # anchor-first samples every row; 1 + N the masks
def test_the_probed_blocks_come_first_in_the_order_asked(within):
    bufs, cad = _layout(5)
    sample_rows = (torch.arange(5)[:, None] * PER_REQ + torch.tensor(within)).reshape(-1).to(torch.int32)
    num, rows, sub = probe_queries(bufs, cad, sample_rows, 5, PER_REQ, [3, 1])
    assert num == 6
    assert bufs[0][:6].tolist() == [109, 110, 111, 103, 104, 105]
    assert bufs[1][:6].tolist() == [1009, 1010, 1011, 1003, 1004, 1005]
    assert sub.slot_mapping.tolist() == [5009, 5010, 5011, 5003, 5004, 5005]
    assert rows.tolist() == [i * PER_REQ + w for i in range(2) for w in within]
    assert sub.seq_lens.tolist() == [23, 21] and sub.seq_lens_cpu_upper_bound.tolist() == [33, 31]
    assert sub.block_table_tensor.tolist() == [[6, 7], [2, 3]]
    assert sub.query_start_loc_cpu.tolist() == [0, 3, 6] and sub.num_reqs == 2 and sub.num_actual_tokens == 6
    assert sub.causal is False


@pytest.mark.parametrize("rows", [[], [0, 1, 2, 3], [1, 1], [4], [-1]])
def test_rows_that_are_not_a_proper_subset_are_refused(rows):
    bufs, cad = _layout(4)
    with pytest.raises(ValueError, match="probe rows"):
        probe_queries(bufs, cad, torch.arange(12, dtype=torch.int32), 4, PER_REQ, rows)
