"""A probe's block forward on the probed requests only.

A probe (``PlanMode.PROBE``) verifies a few drafts of at most ``probe_requests`` requests, but
the layout lays out a query block for every request of the batch, and upstream's forward would
run the draft layers on all of them: at batch 32 that is 32 blocks for 4 probed requests (the
layers were ~27 of the drafter's 59 ms at batch 32 in float32 on the 2-core EPYC). Every
request's context K/V is still stored (upstream does that before the queries, from the whole
context); only the query blocks are cut to the probed requests.

:func:`probe_queries` moves the probed requests' query rows (ids, positions, slots) to the front
of the proposer's buffers and describes them with attention metadata of those requests alone
(their block-table rows and sequence lengths). Each request's block attends to its own context
and its own block only, so its rows come out as they would in the full batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


def probe_queries(buffers: Sequence[torch.Tensor], block_cad, sample_rows: torch.Tensor, batch: int,
                  per_req: int, rows: Sequence[int]) -> tuple[int, torch.Tensor, object]:
    """(query tokens, sampled rows, attention metadata) of the probed ``rows`` only.

    ``buffers`` are the layout's per-query buffers (input ids, positions, query slots), whose
    first ``batch * per_req`` entries hold every request's block in batch order; their first
    ``len(rows) * per_req`` entries are overwritten with the probed requests' blocks, in the order
    of ``rows``. The sampled rows keep their offsets within a block (all of them anchor-first, the
    masks in 1 + N).
    """
    idx = torch.as_tensor(list(rows), dtype=torch.int64)
    m = int(idx.numel())
    if m == 0 or m >= batch or len(set(idx.tolist())) < m or int(idx.min()) < 0 or int(idx.max()) >= batch:
        raise ValueError(f"probe rows {list(rows)} are not distinct requests of a proper subset of "
                         f"the batch's {batch}")
    offsets = torch.arange(per_req, dtype=torch.int64)
    src = (idx[:, None] * per_req + offsets).reshape(-1).to(buffers[0].device)
    for buf in buffers:
        buf[: m * per_req] = buf[src]  # a gather copies first, so overlapping rows are safe
    per_block = sample_rows.numel() // batch
    within = sample_rows[:per_block].to(torch.int64)  # request 0's block starts at row 0
    new_rows = (torch.arange(m, dtype=torch.int64)[:, None] * per_req + within).reshape(-1)
    dev = block_cad.query_start_loc.device
    loc_cpu = (torch.arange(m + 1, dtype=torch.int32) * per_req)
    seq_lens = block_cad.seq_lens[idx.to(block_cad.seq_lens.device)]
    upper = block_cad.seq_lens_cpu_upper_bound
    cad = dataclasses.replace(
        block_cad, query_start_loc=loc_cpu.to(dev), query_start_loc_cpu=loc_cpu, seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=None if upper is None else upper[idx],
        num_reqs=m, num_actual_tokens=m * per_req,
        block_table_tensor=block_cad.block_table_tensor[idx.to(block_cad.block_table_tensor.device)],
        slot_mapping=buffers[-1][: m * per_req])
    return m * per_req, new_rows.to(sample_rows.dtype).to(sample_rows.device), cad
