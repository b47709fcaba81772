"""The V1 proposer's held context: steps without drafts keep their K/V rows until the drafter next runs.

A decode-only step in which no request runs the drafter still owes the drafter its context K/V
(later drafts attend to every earlier position). Storing it costs about 1 ms a step; holding the
step's target states in :class:`~.context_kv.PendingContext` and storing every held step in one
call when the drafter next runs costs a fraction of that. A mixin of ``DSparkProposer``: it reads
the proposer's model, state, planner and laps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm_dspark.spec_decode.common.budget import Plan, PlanMode
from vllm_dspark.spec_decode.v1.accepted_context import accepted_rows

if TYPE_CHECKING:
    from vllm_dspark.spec_decode.common.planner import StepPlanner
    from vllm_dspark.spec_decode.v1.context_kv import PendingContext
    from vllm_dspark.spec_decode.v1.step_state import StepState

logger = logging.getLogger("vllm_dspark")


class HeldContext:
    """``propose_before_glue`` and the hold / flush of the context (see the module docstring)."""

    # What it reads of the proposer it is mixed into.
    state: StepState
    planner: StepPlanner
    pending: PendingContext
    text_sources: list
    model: Any
    _context_positions_buffer: torch.Tensor
    _context_slot_mapping_buffer: torch.Tensor
    block: int
    _decide: Callable[..., Any]
    _lap: Callable[[str, float], float]
    _no_drafts: Callable[..., list]
    _send_copies: Callable[..., list]
    set_inputs_first_pass: Callable[..., Any]

    def propose_before_glue(self, num_speculative_tokens, cad, sampling_metadata, num_tokens: int,
                            states: Callable[[], torch.Tensor], positions: Callable[[], torch.Tensor],
                            sampled: Callable[[], torch.Tensor | None] = lambda: None):
        """A decode-only step with no drafts in it, decided before the runner's draft glue (patch
        ``v1-runner-no-draft-glue``). Returns the step's proposals when it holds its context and sends
        nothing or only copies; None when the runner must take its full path to :meth:`propose`, which
        then uses the plan made here (a plan is made once a step: under TP it is a broadcast).

        The glue it skips prepares the next tokens, the rejected counts and the drafter's query
        metadata: 0.3-0.4 ms of a 30 ms step at batch 1, none of it read by a step the drafter sits
        out. ``states`` and ``positions`` give the target's aux hidden states and positions of the
        step's ``num_tokens`` tokens, as upstream's glue would hand them to :meth:`propose`; ``sampled``
        each request's sampled token (its next token: no draft was verified), None where the glue must
        decide. With the copy on (the default) a step cannot be planned without it: the copy drafts
        from each request's text, this step's token included.
        """
        st = self.state
        if self.planner.sent or not (st.hold_ok and st.hold_checked) or int(cad.max_query_len) != 1:
            return None  # feedback needs the rejected counts, or the first hold checks the layout
        next_tokens = sampled() if self.text_sources else None
        if self.text_sources and next_tokens is None:
            return None
        d = self._decide(num_speculative_tokens, cad, None, sampling_metadata, next_tokens)
        copies_only = d.plan.runs and not d.plan.drafter_runs
        if d.plan.mode is not PlanMode.SKIP and not copies_only:
            st.decided = d
            return None
        t1 = self._flush_if_due(d.plan, True, d.req_ids, d.t1)
        self.pending.hold(d.req_ids, states(), positions()[:num_tokens], cad.slot_mapping[:num_tokens])
        st.before_glue_steps += 1
        t1 = self._lap("held", t1)
        if not copies_only:
            return self._no_drafts(d)
        st.copy_steps_held += 1
        st.copy_steps_before_glue += 1
        return self._send_copies(d, next_tokens, t1, t1)

    def _flush_if_due(self, plan: Plan, holdable: bool, req_ids: list[str], t1: float, tokens: int = 1) -> float:
        """Store the held context when this step cannot join it (:mod:`.context_kv`): the drafter runs, the
        step cannot be held (``holdable``: decode-only, or only the copy drafts), or its batch changed or
        the buffer is full (``tokens``: the most rows a request adds). Returns the time after it."""
        if not self.pending.steps or (not plan.drafter_runs and holdable and self.pending.accepts(req_ids, tokens)):
            return t1
        self.pending.flush(self._store_context, req_ids)
        return self._lap("context_flush", t1)

    def _check_hold(self, cad, num_rejected, target_positions: torch.Tensor, n: int) -> None:
        """Prove holding on a copy-only step just stored at once: its accepted rows' positions and slots
        must be the ones the eager store laid out. Under load every step may copy, and a step with no
        source at all (where :meth:`_hold` proves it) may never come: at batch 8 on the copy-heavy set
        none did, and every step stored its context at once."""
        st = self.state
        if st.hold_checked or not st.hold_ok or int(cad.max_query_len) > self.block + 1:
            return
        rows = accepted_rows(cad, num_rejected, target_positions.device)
        if rows is None or rows.count != n:
            return
        self._prove_hold(target_positions[rows.index], cad.slot_mapping[rows.index], n)

    def _prove_hold(self, positions: torch.Tensor, slots: torch.Tensor, n: int) -> bool:
        """Whether the step's ``n`` rows sit where the eager store laid them out (its context buffers):
        holding is then proven; otherwise it is turned off for good, with a warning."""
        if torch.equal(self._context_positions_buffer[:n].to(positions.dtype), positions) \
                and torch.equal(self._context_slot_mapping_buffer[:n].to(slots.dtype), slots):
            self.state.hold_checked = True
            return True
        self.state.hold_ok = False
        logger.warning("vllm_dspark: the runner's slot mapping differs from the drafter's context layout; "
                       "steps without drafts store their context at once (about 1 ms a step)")
        return False

    def _store_context(self, states, positions, slots) -> None:
        self.model.precompute_and_store_context_kv(self.model.combine_hidden_states(states), positions, slots)

    def _hold(self, req_ids, target_token_ids, target_hidden_states, target_positions, cad, next_token_ids,
              token_indices, num_rejected) -> None:
        """Hold a decode-only step's context (see :mod:`.context_kv`): its positions are the target's and
        its slots the drafter group's slot mapping, which the first held step checks against the
        layout the eager store uses."""
        n = int(target_hidden_states.shape[0])
        positions, slots = target_positions[:n], cad.slot_mapping[:n]
        if not self.state.hold_checked:
            self.set_inputs_first_pass(target_token_ids, next_token_ids, target_positions,
                                       self.model.combine_hidden_states(target_hidden_states), token_indices,
                                       cad, num_rejected)
            if not self._prove_hold(positions, slots, n):
                self._store_context(target_hidden_states, self._context_positions_buffer[:n],
                                    self._context_slot_mapping_buffer[:n])
                return
        self.pending.hold(req_ids, target_hidden_states, positions, slots)