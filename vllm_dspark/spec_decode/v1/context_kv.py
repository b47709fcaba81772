"""Context the drafter has not stored yet: the target states of decode steps that drafted nothing.

A step that drafts nothing must still give the drafter this step's tokens, or
the next step that drafts would read a context with holes in it. Storing them
at once runs the drafter's ``fc``, ``hidden_norm`` and every layer's K/V
projection for one token per request, plus the query layout the block forward
needs: about 1.2 ms of small operators per step at batch 1 (bf16, 2-core
EPYC), 5% of a decode step, paid on every step the budget decides not to
draft. Held here instead, the states are stored in one call, for all pending
steps at once, when the drafter next runs or when this buffer must be emptied.

The buffer is emptied (``flush``) before anything else writes the drafter's
cache, and a held write must never land on a block that changed hands:

* a step is held whole only when it is decode-only (one token per request);
  a verify step in which the drafter does not run (the copy source drafted
  alone, or nothing is sent) is held without its rejected rows
  (:func:`.accepted_context.accepted_rows`), so no held token sits in a slot the
  next step writes again;
* a flush stores only the tokens of requests still in the current batch; those
  of requests that finished, were aborted or were preempted are dropped. Their
  blocks may already belong to another request, and with a drafter KV group of
  its own (a draft window) vLLM lays the drafter's layers over the same memory
  as target layers, so such a write would overwrite the TARGET's cache of the
  new owner, which its forward wrote earlier in this very step;
* a step joins the held ones only when the batch is the same requests in the
  same order; otherwise what is held is flushed first;
* at most ``max_steps`` steps and ``max_tokens`` tokens of any request are
  held, so a sliding-window KV manager cannot free a held slot (its window must
  exceed ``max_tokens`` plus one KV block; the proposer holds nothing otherwise).

Dropping costs at most draft quality, and seldom that. The dropped positions
are a request's last ``max_steps`` or fewer; only full blocks are cached, so
with blocks of at least ``max_steps`` tokens (128 on CPU, 16 on GPU) the cached
ones among them all lie in the request's last full block, and vLLM's EAGLE
block drop (on for DSpark unless ``disable_eagle_block_drop``) recomputes the
last block of every prefix-cache hit: a hit that ends there does not read
them. A hit that runs through that block into blocks another request with the
same prefix cached later, or any hit with the drop disabled or smaller blocks,
finds up to ``max_steps`` positions without drafter K/V: its drafts are
verified as always, only accepted less.

The stores are exactly the eager ones, batched: the same positions, slots and
states, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class PendingContext:
    """Target states of held decode steps (see the module docstring for when it is emptied)."""

    def __init__(self, max_steps: int = 16, max_tokens: int = 64):
        if max_steps < 1 or max_tokens < max_steps:
            raise ValueError(f"need 1 <= max_steps <= max_tokens, not {max_steps}, {max_tokens}")
        self.max_steps, self.max_tokens = max_steps, max_tokens
        self.req_ids: tuple[str, ...] | None = None
        self._states: list[torch.Tensor] = []
        self._positions: list[torch.Tensor] = []
        self._slots: list[torch.Tensor] = []
        # Per held step, each row's request (its index in req_ids); None for a decode-only step (row i is
        # request i), whose owners are only built if a flush must drop rows.
        self._owners: list[list[int] | None] = []
        # Tokens held per request, in plain ints: asked every held step (tensor reductions cost more here).
        self._per_request: list[int] | None = None
        self.counts = {"held_steps": 0, "held_tokens": 0, "flushes": 0, "flushed_tokens": 0, "dropped_tokens": 0}

    @property
    def steps(self) -> int:
        return len(self._states)

    def accepts(self, req_ids: Sequence[str], tokens: int = 1) -> bool:
        """Whether a step of this batch adding up to ``tokens`` per request may join what is held (else
        flush first)."""
        if self.steps == 0:
            return tokens <= self.max_tokens
        held = max(self._per_request, default=0) if self._per_request is not None else 0
        return tuple(req_ids) == self.req_ids and self.steps < self.max_steps and held + tokens <= self.max_tokens

    def hold(self, req_ids: Sequence[str], states: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor, owners: Sequence[int] | None = None) -> None:
        """Hold one step: raw target states [n, A], positions [n], drafter-cache slots [n]; ``owners`` [n]
        each row's request (its index in ``req_ids``), None for a decode-only step (row i is request i)."""
        n = states.shape[0]
        if owners is None:
            if n != len(req_ids):
                raise ValueError(f"hold: {n} states for {len(req_ids)} requests (a decode-only step has one "
                                 "token per request; pass owners for more)")
            per = [1] * n
        else:
            owners = [int(o) for o in owners]
            if len(owners) != n:
                raise ValueError(f"hold: {n} states, {len(owners)} owners")
            per = [0] * len(req_ids)
            for o in owners:
                per[o] += 1
        if positions.shape[0] != n or slots.shape[0] != n:
            raise ValueError(f"hold: {n} states, {positions.shape[0]} positions, {slots.shape[0]} slots")
        if not self.accepts(req_ids, max(per, default=0)):
            raise RuntimeError("PendingContext.hold: flush first (the batch changed or the buffer is full)")
        self._per_request = per if self._per_request is None else [a + b for a, b in
                                                                    zip(self._per_request, per, strict=True)]
        self._owners.append(owners)
        self.req_ids = tuple(req_ids)
        # Copies: the runner reuses its position and slot buffers on the next step.
        self._states.append(states.clone())
        self._positions.append(positions.clone())
        self._slots.append(slots.clone())
        self.counts["held_steps"] += 1
        self.counts["held_tokens"] += n

    def flush(self, store: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
              live: Sequence[str]) -> int:
        """Store the held tokens of the requests in ``live`` (the current batch) with one
        ``store(states, positions, slots)`` call, drop the others; returns the tokens stored."""
        if not self._states:
            return 0
        alive = set(live)
        keep_l = [rid in alive for rid in (self.req_ids or ())]
        states, positions, slots = torch.cat(self._states), torch.cat(self._positions), torch.cat(self._slots)
        held = states.shape[0]
        if not all(keep_l):
            keep = torch.tensor(keep_l, dtype=torch.bool)
            owners = [torch.arange(s.shape[0]) if o is None else torch.tensor(o, dtype=torch.int64)
                      for o, s in zip(self._owners, self._states, strict=True)]
            mask = keep[torch.cat(owners)]
            states, positions, slots = states[mask], positions[mask], slots[mask]
        self._states, self._positions, self._slots, self._owners = [], [], [], []
        self.req_ids, self._per_request = None, None
        n = int(states.shape[0])
        self.counts["dropped_tokens"] += held - n
        if n:
            store(states, positions, slots)
            self.counts["flushes"] += 1
            self.counts["flushed_tokens"] += n
        return n
