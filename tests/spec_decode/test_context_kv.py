"""``PendingContext``: what it holds is stored once, in order, and it refuses what it must not hold."""

from __future__ import annotations

import pytest
import torch

from vllm_dspark.spec_decode.v1.context_kv import PendingContext


def _step(n: int, base: int):
    return torch.arange(base, base + n * 3, dtype=torch.float32).view(n, 3), torch.arange(base, base + n), \
        torch.arange(100 + base, 100 + base + n)


def test_flush_stores_every_held_step_once_in_order():
    p = PendingContext(max_steps=4)
    calls = []
    steps = [_step(2, 10 * i) for i in range(3)]
    for s, pos, slots in steps:
        assert p.accepts(["a", "b"])
        p.hold(["a", "b"], s, pos, slots)
    assert p.steps == 3
    assert p.flush(lambda *a: calls.append(a), ["a", "b"]) == 6
    assert len(calls) == 1
    got_s, got_pos, got_slots = calls[0]
    torch.testing.assert_close(got_s, torch.cat([s for s, _, _ in steps]))
    assert got_pos.tolist() == [0, 1, 10, 11, 20, 21] and got_slots.tolist() == [100, 101, 110, 111, 120, 121]
    assert p.steps == 0 and p.flush(lambda *a: calls.append(a), ["a", "b"]) == 0 and len(calls) == 1
    assert p.counts == {"held_steps": 3, "held_tokens": 6, "flushes": 1, "flushed_tokens": 6, "dropped_tokens": 0}


def test_requests_gone_from_the_batch_are_dropped_not_stored():
    """Their blocks may belong to another request already (and, with a drafter KV group of its own,
    lie over target layers' memory): a held write there would corrupt the new owner's cache."""
    p = PendingContext()
    for i in range(2):
        s, pos, slots = _step(3, 10 * i)
        p.hold(["a", "b", "c"], s, pos, slots)
    calls = []
    assert p.flush(lambda *a: calls.append(a), ["c", "x", "a"]) == 4
    _, pos, slots = calls[0]
    assert pos.tolist() == [0, 2, 10, 12] and slots.tolist() == [100, 102, 110, 112]
    assert p.counts["dropped_tokens"] == 2
    p.hold(["b"], *_step(1, 0))
    assert p.flush(lambda *a: calls.append(a), ["a"]) == 0 and len(calls) == 1  # nothing stored at all


def test_holds_copies_not_the_runners_buffers():
    p = PendingContext()
    s, pos, slots = _step(1, 0)
    p.hold(["a"], s, pos, slots)
    s.fill_(-1), pos.fill_(-1), slots.fill_(-1)
    out = []
    p.flush(lambda *a: out.append(a), ["a"])
    assert out[0][1].tolist() == [0] and out[0][2].tolist() == [100] and out[0][0].min() >= 0


def test_a_changed_batch_or_a_full_buffer_must_flush_first():
    p = PendingContext(max_steps=2)
    s, pos, slots = _step(2, 0)
    p.hold(["a", "b"], s, pos, slots)
    assert not p.accepts(["b", "a"]) and not p.accepts(["a"]) and not p.accepts(["a", "b", "c"])
    with pytest.raises(RuntimeError, match="flush first"):
        p.hold(["a", "c"], s, pos, slots)
    p.hold(["a", "b"], s, pos, slots)
    assert not p.accepts(["a", "b"])  # full
    p.flush(lambda *a: None, ["a", "b"])
    assert p.accepts(["x"])


def test_mismatched_shapes_are_refused():
    p = PendingContext()
    s, pos, slots = _step(2, 0)
    with pytest.raises(ValueError, match="one token per request"):
        p.hold(["a"], s, pos, slots)
    with pytest.raises(ValueError, match="2 states, 1 positions"):
        p.hold(["a", "b"], s, pos[:1], slots)
    with pytest.raises(ValueError, match="max_steps"):
        PendingContext(max_steps=0)
