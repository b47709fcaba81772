"""Holding proven on a copy-only step (``HeldContext._check_hold``): under load every step may copy, and
the step without any source where holding used to be proven may never come. No engine: the proposer's
buffers and the step's metadata are made here."""

from __future__ import annotations

import types

import torch

from vllm_dspark.spec_decode.v1.held import HeldContext
from vllm_dspark.spec_decode.v1.step_state import StepState


def _proposer(positions: list[int], slots: list[int]) -> HeldContext:
    p = HeldContext()
    p.state = StepState()
    p.state.hold_ok, p.state.hold_checked = True, False
    p.block = 7
    p._context_positions_buffer = torch.tensor(positions + [0] * 8)
    p._context_slot_mapping_buffer = torch.tensor(slots + [0] * 8)
    return p


def _verify_step(qlens: list[int]):
    starts = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(starts[-1])
    cad = types.SimpleNamespace(max_query_len=max(qlens), query_start_loc_cpu=starts,
                                slot_mapping=torch.arange(n) + 100, batch_size=lambda: len(qlens))
    return cad, torch.arange(n) + 10


def test_a_copy_step_whose_accepted_rows_match_the_eager_layout_proves_holding():
    cad, positions = _verify_step([3, 3])
    # Request 0 rejected its last row: the eager store laid out rows 0, 1 and 3..5.
    p = _proposer([10, 11, 13, 14, 15], [100, 101, 103, 104, 105])
    p._check_hold(cad, torch.tensor([1, 0]), positions, 5)
    assert p.state.hold_checked and p.state.hold_ok


def test_a_layout_that_differs_turns_holding_off():
    cad, positions = _verify_step([3, 3])
    p = _proposer([10, 11, 13, 14, 15], [100, 101, 103, 104, 999])
    p._check_hold(cad, torch.tensor([1, 0]), positions, 5)
    assert not p.state.hold_ok and not p.state.hold_checked


def test_a_prefill_chunk_or_another_row_count_proves_nothing():
    cad, positions = _verify_step([3, 12])  # a prefill chunk beside a verify
    p = _proposer(list(range(10, 25)), list(range(100, 115)))
    p._check_hold(cad, torch.tensor([0, 0]), positions, 15)
    assert not p.state.hold_checked and p.state.hold_ok
    cad, positions = _verify_step([3, 3])
    p = _proposer([10, 11, 12, 13, 14, 15], list(range(100, 106)))
    p._check_hold(cad, torch.tensor([1, 0]), positions, 6)  # the store laid out 6 rows, 5 were accepted
    assert not p.state.hold_checked and p.state.hold_ok
