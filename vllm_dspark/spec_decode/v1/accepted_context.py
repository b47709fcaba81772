"""The context rows of a verify step that the target accepted: the only ones the drafter needs.

A verify step hands the drafter the target's states of every token it ran, 1 + k per request,
``num_rejected`` of them rejected. Upstream's layout keeps the rejected rows ("padded mode"): it
runs ``fc`` and every draft layer's K/V projection over them and stores their K/V in slots past
the request's accepted length, where the block's own query K/V overwrite them before anything
reads them (the queries start at the first rejected position and span ``block_size`` >= k
positions). That is dead work, and it grows with the rejection: at batch 32 with a drafter
accepted ~1.1 tokens a step, 7 of every 8 rows (``fc`` alone was 10 of the drafter's 59 ms at
batch 32 in float32 on the 2-core EPYC).

:func:`accepted_context` drops those rows before ``fc``. The K/V stored for the accepted rows,
the query positions and slots, and the attention lengths are exactly upstream's, so the drafter's
output is unchanged. It needs the rejected counts on the host to size the result, which on CUDA
would cost a device sync per step; there upstream's padded layout stays (``None``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class AcceptedContext:
    """A step's context with its rejected rows dropped, and the metadata that describes it."""

    token_ids: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]
    hidden_states: torch.Tensor  # [n, ...] the target's (aux) states of the kept rows
    cad: object  # the step's CommonAttentionMetadata, with query_start_loc and seq_lens of the kept rows


def accepted_context(token_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor, cad,
                     num_rejected: torch.Tensor | None) -> AcceptedContext | None:
    """The kept rows and their metadata, or None when nothing was rejected or the step is on a GPU.

    With the result, the layout runs without rejected counts (``num_rejected_tokens=None``): its
    ``query_start_loc`` spans the kept rows and its ``seq_lens`` are already the accepted lengths.
    """
    if num_rejected is None or hidden_states.device.type != "cpu":
        return None
    batch = cad.batch_size()
    rejected = num_rejected[:batch].to(torch.int64).numpy()
    if not rejected.any():
        return None
    starts = cad.query_start_loc_cpu[: batch + 1].to(torch.int64).numpy()
    keep = np.diff(starts) - rejected
    if (keep < 1).any():
        raise ValueError(f"a request rejected all of its context rows (kept {keep.tolist()}): "
                         "the runner's rejected counts disagree with its query lengths")
    new_starts = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(keep, out=new_starts[1:])
    total = int(new_starts[-1])
    # Kept row i sits in its request's block as it did before, shifted by the rows dropped before it.
    idx = torch.from_numpy(np.arange(total, dtype=np.int64) + np.repeat(starts[:-1] - new_starts[:-1], keep))
    loc_cpu = torch.from_numpy(new_starts.astype(np.int32))
    new_cad = dataclasses.replace(
        cad, query_start_loc=loc_cpu.to(cad.query_start_loc.device), query_start_loc_cpu=loc_cpu,
        seq_lens=cad.seq_lens - num_rejected.to(cad.seq_lens.dtype),
        num_actual_tokens=total, max_query_len=int(keep.max()))
    return AcceptedContext(token_ids[idx], positions[idx], hidden_states[idx], new_cad)


@dataclasses.dataclass(frozen=True)
class AcceptedRows:
    """Which of a step's context rows the target accepted, and whose they are."""

    index: torch.Tensor | slice  # the rows of the step's context: a slice when they are contiguous
    owners: list[int]  # each row's request (batch row)
    most: int  # the most rows any one request keeps

    @property
    def count(self) -> int:
        return len(self.owners)


def accepted_rows(cad, num_rejected: torch.Tensor | None, device: torch.device) -> AcceptedRows | None:
    """The accepted rows of a step (every row when nothing was rejected), for holding them; None on a GPU,
    where the rejected counts are not on the host.

    Plain ints: it runs on every step the drafter sits out, on a handful of rows, and the numpy and
    torch calls it made cost 0.14 ms of a 1.3 ms copy-only step at batch 1 (float32, 2-core EPYC).
    Rows a slice can name (one request, or nothing rejected) are indexed without an index tensor."""
    if device.type != "cpu":
        return None
    batch = cad.batch_size()
    starts = cad.query_start_loc_cpu[: batch + 1].tolist()
    rejected = [0] * batch if num_rejected is None else num_rejected[:batch].tolist()
    keep = [b - a - r for a, b, r in zip(starts[:-1], starts[1:], rejected, strict=True)]
    if min(keep, default=1) < 1:
        return None  # the runner's counts disagree with its query lengths: the eager path says so
    owners = [i for i, k in enumerate(keep) for _ in range(k)]
    first = starts[0]
    if batch <= 1 or not any(rejected):
        index: torch.Tensor | slice = slice(first, first + len(owners))
    else:
        rows = [s + j for s, k in zip(starts[:-1], keep, strict=True) for j in range(k)]
        index = torch.tensor(rows, dtype=torch.int64)
    return AcceptedRows(index, owners, max(keep, default=0))
