"""DSpark proposer for vLLM's V1 model runner (CPU backend, and GPU users on V1).

A subclass of vLLM's ``DFlashProposer``: context-KV precompute, the non-causal
block forward, the KV cache and the rejection sampler are upstream's. Each
step (``propose``):

1. **Feedback.** The verify step that just ran tells how many of each
   request's previous drafts were accepted (``num_rejected_tokens_gpu``); that
   feeds the confidence calibrator, the counters and the trace. Its duration
   corrects the cost model.
2. **Layout.** Anchor-first: ``block_size`` queries ``[anchor, mask x (B-1)]``
   at positions ``p..p+B-1``, every row sampled (B drafts, the target verifies
   up to 1 + B tokens). ``one_plus_n`` checkpoints keep upstream's 1 + N layout.
3. **Block forward** (skipped on steps the budget forecast says will not pay:
   every request decodes plainly, and the step's target states are held in
   :mod:`.context_kv` until the drafter next runs, then stored in one call,
   so the drafter's cache stays complete).
4. **Sequential stage.** Greedy requests draft through the Markov draft op;
   requests with temperature > 0 draft by sampling their Markov-corrected,
   top-k/top-p-filtered distribution (``draft_sampling: auto``), whose
   probabilities go to the rejection sampler.
5. **Verification.** How many drafts each request sends to the target:
   ``budget`` (survival-ranked slots admitted while they pay for their verify
   cost, :mod:`.budget`), ``threshold`` (the DSpark reference rule),
   ``product`` (the project's earlier rule) or ``fixed``; requests past
   ``max_draft_context`` get none.

Every overridden upstream method and every upstream helper called is listed,
with its signature, in :mod:`.overrides` and checked when the proposer is built.
Settings come from one :class:`~vllm_dspark.serving.settings.DSparkSettings`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_dspark.serving.metrics import Publisher
from vllm_dspark.serving.settings import DSparkSettings, for_async_scheduling, settings_of
from vllm_dspark.spec_decode.common.budget import Plan, PlanMode
from vllm_dspark.spec_decode.common.consensus import Consensus, divergence_for_rank
from vllm_dspark.spec_decode.common.copy_source import CopySource
from vllm_dspark.spec_decode.common.costs import CostModel
from vllm_dspark.spec_decode.common.drafts import DraftBatch, Drafts, MarkovStage
from vllm_dspark.spec_decode.common.planner import CopyDrafts, StepPlanner
from vllm_dspark.spec_decode.common.sources import COPY_SOURCE
from vllm_dspark.spec_decode.v1 import step_inputs as SI
from vllm_dspark.spec_decode.v1.accepted_context import accepted_context
from vllm_dspark.spec_decode.v1.context_kv import PendingContext
from vllm_dspark.spec_decode.v1.copy_glue import CopyOffer, copy_offer, copy_texts, merge_copies
from vllm_dspark.spec_decode.v1.layout import lay_out_queries
from vllm_dspark.spec_decode.v1.overrides import check_couplings
from vllm_dspark.spec_decode.v1.probe_block import probe_queries
from vllm_dspark.spec_decode.v1.step_state import Decision, StepState

logger = logging.getLogger("vllm_dspark")

# Parts of the block forward and of the Markov stage (each also inside its phase's own total): the
# attention metadata, the context K/V of the step's new tokens, the LM head, the confidence head, the
# greedy rows' op, the sampled rows.
PARTS = ("block.metadata", "block.context_kv", "stage.lm_head", "stage.confidence", "stage.markov_op",
         "stage.sampled")


class DSparkProposer(DFlashProposer):
    def __init__(self, vllm_config, device, runner=None):
        check_couplings()
        super().__init__(vllm_config, device, runner)
        self.runner = runner
        spec = vllm_config.speculative_config
        s = settings_of(spec.draft_model_config.hf_config)
        if getattr(runner, "use_async_scheduling", False):
            s, warning = for_async_scheduling(s)
            if warning:
                logger.warning("vllm_dspark: %s", warning)
        self.settings: DSparkSettings = s
        self.block = s.block_size
        self.n_draft = s.num_draft_tokens
        self.anchor_first = s.query_layout == "anchor_first"
        # TP: decisions that change what ranks execute are made on rank 0 and broadcast.
        self.consensus = Consensus()
        # The step's decisions (budget, copy policy, verification rules, counters, drafts awaiting their
        # verdict): torch-free, apart from this adapter.
        self.planner = StepPlanner(s, self.n_draft, self.consensus.decide)
        self.stats, self.policy, self.copy_policy = self.planner.stats, self.planner.policy, self.planner.copy_policy
        self.calibrator = self.policy.calibrator
        self.copy_source: CopySource | None = None
        if s.copies:
            self.copy_source = CopySource(min_match=s.copy_min_match, max_match=max(8, s.copy_min_match),
                                          shared=s.copy_shared)
        elif s.copy == "auto":
            logger.info("vllm_dspark: copy: auto drafts with verification 'budget' only (which weighs the copy "
                        "against the drafter); with %r the drafter drafts alone", s.verification)
        self.costs: CostModel | None = None
        if s.costs is not None:
            self.costs = CostModel.from_dict(s.costs, source="speculative_config['dspark']['costs']")
            self.planner.costs = self.costs
        # Per-source acceptance for /metrics (serving/metrics.py), labelled as vLLM labels its own.
        self.metrics = Publisher(model_name=str(getattr(vllm_config.model_config, "served_model_name", "") or ""))
        self._hook: dict | None = None  # the TP test's divergence hook, read once the TP group exists
        self.profile_info: dict | None = None
        seed = getattr(getattr(vllm_config, "model_config", None), "seed", None)
        self._seed_base = int(seed) if seed is not None else 0
        self._last_log = time.monotonic()
        self._last_draft_probs = None  # upstream's name: the runner takes sampled drafts' q from it
        self._trace_positions: list[int] = []  # the step's anchor positions, per request (the trace's)
        self.pending = PendingContext()
        # A sliding-window KV manager frees blocks behind the window: held slots must stay inside it.
        self.state = StepState(hold_ok=not s.window or s.window > self.pending.max_steps + 2 * self.block_size)
        self._stage: MarkovStage | None = None
        self._stage_src = None  # the weights the stage was built from (rebuilt if the model's change)
        # Seconds per phase, summed over steps (report(): where a step's time goes).
        self.timings: dict[str, float] = dict.fromkeys(
            ("outside_propose", "feedback", "held", "context_flush", "layout", "context_kv_only", "block_forward",
             "markov_stage", "copy_source", "verify", *PARTS), 0.0)
        logger.info("vllm_dspark: DSpark proposer ready: %s", s.describe())
        note = s.context_note()
        if note:
            logger.info("vllm_dspark: %s", note)

    # ------------------------------------------------------------------ costs
    def on_engine_ready(self) -> None:
        """Called once the engine is warm (worker patch): profile or load the cost model."""
        if self.settings.verification != "budget" or self.costs is not None:
            return
        from vllm_dspark.spec_decode.common.profile import profile_or_load

        self.costs = profile_or_load(self, self.consensus, self._divergence())
        self.planner.costs = self.costs
        logger.info("vllm_dspark: budget cost model (%s): verify %s s by tokens, draft %s s by requests",
                    self.costs.source, [(n, round(t, 4)) for n, t in self.costs.verify],
                    [(n, round(t, 4)) for n, t in self.costs.draft])

    # ------------------------------------------------------------------ layout
    def set_inputs_first_pass(self, target_token_ids, next_token_ids, target_positions, target_hidden_states,
                              token_indices_to_sample, cad, num_rejected_tokens_gpu):
        """Lay out ``block_size`` queries per request (:func:`.layout.lay_out_queries`)."""
        return lay_out_queries(self, target_token_ids, next_token_ids, target_positions, target_hidden_states, cad,
                               num_rejected_tokens_gpu)

    # ------------------------------------------------------------------ one step
    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None):
        """Decide, run the sources the plan names, allocate, record."""
        cad = common_attn_metadata
        d = self.state.take_decision() or self._decide(num_speculative_tokens, cad, num_rejected_tokens_gpu,
                                                       sampling_metadata, next_token_ids)
        decode_only = int(cad.max_query_len) == 1
        t = self._flush_if_due(d.plan, decode_only, d.req_ids, d.t1)
        if not d.plan.runs and decode_only and self.state.hold_ok:
            self._hold(d.req_ids, target_token_ids, target_hidden_states, target_positions, cad, next_token_ids,
                       token_indices_to_sample, num_rejected_tokens_gpu)
            self._lap("held", t)
            return self._no_drafts(d)

        num_query, sample_rows, block_cad = self._lay_out(
            d.batch, target_token_ids, target_positions, target_hidden_states, next_token_ids,
            token_indices_to_sample, cad, num_rejected_tokens_gpu)
        t_layout = t = self._lap("layout", t)
        if not d.plan.drafter_runs:
            # The drafter's K/V of this step's tokens must still be written, or later drafts would
            # read a context with holes in it; the block forward and the Markov stage are skipped.
            n = self._dflash_num_context
            self.model.precompute_and_store_context_kv(
                self._dflash_hidden_states, self._context_positions_buffer[:n],
                self._context_slot_mapping_buffer[:n])
            t = self._lap("context_kv_only", t)
            if d.copy is None or not any(d.plan.copy_kept):
                return self._no_drafts(d)
            kept, picks = self.planner.allocate(d.plan, d.caps, d.sampled, None, _copy_view(d.copy))
            return self._record(d, d.copy.drafts, kept, next_token_ids, t, t_layout, picks)

        probed = d.plan.mode is PlanMode.PROBE and len(d.plan.rows) < d.batch and mm_embed_inputs is None
        if probed:  # the probed requests' query blocks alone (their context K/V is stored for all)
            num_query, sample_rows, block_cad = probe_queries(
                (self.input_ids, self.positions, self._slot_mapping_buffer), block_cad, sample_rows, d.batch,
                self.block, d.plan.rows)
            self.state.probe_blocks_cut += 1
        rows = self._block_forward(num_query, sample_rows, block_cad, mm_embed_inputs)
        t = self._lap("block_forward", t)
        drafts = self._run_sources(d, rows, next_token_ids, sampling_metadata, cad, probed)
        t = self._lap("markov_stage", t)
        kept, picks = self._allocate(d, drafts)
        if d.copy is not None and COPY_SOURCE in picks:
            drafts = merge_copies(drafts, d.copy.drafts, picks, d.sampled)
        return self._record(d, drafts, kept, next_token_ids, t, t_layout, picks)

    def _lay_out(self, batch: int, token_ids, positions, hidden_states, next_token_ids, token_indices, cad,
                 num_rejected):
        """``fc`` and the query layout over the step's context, its rejected rows left out (on CPU:
        :mod:`.accepted_context`)."""
        accepted = accepted_context(token_ids, positions, hidden_states, cad, num_rejected)
        if accepted is not None:
            self.state.rejected_rows_dropped += int(token_ids.shape[0]) - int(accepted.token_ids.shape[0])
            token_ids, positions, hidden_states, cad, num_rejected = (
                accepted.token_ids, accepted.positions, accepted.hidden_states, accepted.cad, None)
        out = self.set_inputs_first_pass(token_ids, next_token_ids, positions,
                                         self.model.combine_hidden_states(hidden_states), token_indices, cad,
                                         num_rejected)
        if self.settings.trace_path:  # each request's anchor position, before a probe reorders the buffers
            self._trace_positions = self.positions[: batch * self.block].view(-1, self.block)[:, 0].tolist()
        return out

    def _block_forward(self, num_query: int, sample_rows: torch.Tensor, block_cad, mm_embed_inputs):
        """The drafter's non-causal pass over every request's block: the sampled rows [R * N, H]."""
        t = time.perf_counter()
        per_group, per_layer = self.build_per_group_and_layer_attn_metadata(block_cad)
        mode, num_input, across_dp = self._determine_batch_execution_and_padding(num_query)
        t = self._lap("block.metadata", t)
        kwargs, slot_size = self.build_model_inputs_first_pass(num_query, num_input, mm_embed_inputs)
        t = self._lap("block.context_kv", t)  # upstream stores this step's context K/V here
        with set_forward_context(per_layer, self.vllm_config, num_tokens=num_input,
                                 num_tokens_across_dp=across_dp, cudagraph_runtime_mode=mode,
                                 slot_mapping=self._get_slot_mapping(slot_size, block_cad.slot_mapping)):
            out = self.model(**kwargs)
        last_hidden = out[0] if isinstance(out, tuple) else out
        return last_hidden[sample_rows]

    def _run_sources(self, d: Decision, rows: torch.Tensor, next_token_ids, sampling_metadata, cad,
                     probed: bool = False) -> Drafts:
        """The Markov stage's drafts as [batch, N]. A probe drafts only its requests' first few
        positions: the LM head and the sequential stage run on those rows alone (``probed``: the
        block forward ran on those requests alone, so ``rows`` holds theirs only)."""
        n, plan = self.n_draft, d.plan
        if plan.mode is PlanMode.PROBE:
            idx, k = list(plan.rows), plan.tokens
            blocks = rows.view(len(idx), n, -1) if probed else rows.view(d.batch, n, -1)[idx]
            hidden = blocks[:, :k].reshape(len(idx) * k, -1)
        else:
            idx, k, hidden = list(range(d.batch)), n, rows
        temps = getattr(sampling_metadata, "temperature", None)
        batch = DraftBatch(rows=idx, anchors=next_token_ids[:d.batch], num_tokens=k, sampled=d.sampled,
                           hidden=hidden, temperature=temps, top_k=getattr(sampling_metadata, "top_k", None),
                           top_p=getattr(sampling_metadata, "top_p", None),
                           seeds=lambda r: SI.draft_seeds(self.runner, r, cad, self._seed_base))
        drafts = self.markov_stage.draft(batch)
        if plan.mode is not PlanMode.PROBE:
            return drafts
        return _widen(drafts, d.batch, idx, n)

    def _allocate(self, d: Decision, drafts: Drafts) -> tuple[list[int], list[str]]:
        """Drafts to verify per request and the source of each (:meth:`StepPlanner.allocate`)."""
        conf = drafts.confidence.cpu().numpy().astype(np.float64)
        return self.planner.allocate(d.plan, d.caps, d.sampled, conf, _copy_view(d.copy))

    def _record(self, d: Decision, drafts: Drafts, kept: list[int], next_token_ids, t: float,
                t_layout: float, picks: list[str]) -> list[list[int]]:
        """Counters, the feedback the next step awaits, the trace and the drafter's observed cost.
        ``picks``: the source of each request's drafts."""
        conf_l = drafts.confidence.tolist()
        tok_l = drafts.tokens.tolist()
        self.planner.record(d.req_ids, d.plan, d.cap, kept, picks, conf_l, d.sampled)
        if drafts.probs is not None:
            self._last_draft_probs = drafts.probs
        if self.settings.trace_path:
            SI.write_trace(self.settings.trace_path, SI.draft_records(
                self.planner.step, str(self.planner.sent_kind), d.req_ids, self._trace_positions,
                next_token_ids[:d.batch].tolist(), tok_l, conf_l, kept, d.sampled, picks, self.settings,
                self.markov_stage.last_path))
        end = time.perf_counter()
        self.timings["verify"] += end - t
        if self.costs is not None and d.plan.mode is PlanMode.DRAFT and d.plan.drafter_runs:
            # What the profile's draft point measures: block forward, LM head, sequential stage, choice.
            self.costs.observe_draft(d.batch, (end - t_layout) * self._draft_time_scale())
            self._check_stale()
        self.state.last_end = end
        self._maybe_log()
        return [row[:k] for row, k in zip(tok_l, kept, strict=True)]

    def _lap(self, phase: str, since: float) -> float:
        """Add the time since ``since`` to ``phase``'s total; returns now."""
        now = time.perf_counter()
        self.timings[phase] += now - since
        return now

    def _decide(self, num_speculative_tokens, cad, num_rejected, sampling_metadata,
                next_token_ids=None) -> Decision:
        """The start of every step: the previous drafts' feedback, then this step's plan (made once)."""
        t0 = time.perf_counter()
        st = self.state
        if st.last_end is not None:
            self.timings["outside_propose"] += t0 - st.last_end  # the target's step, sampling, scheduling
        batch = cad.batch_size()
        req_ids = SI.req_ids(self.runner, batch)
        self._feedback(req_ids, cad, num_rejected, t0)
        cap = max(0, min(self.settings.max_draft_tokens, int(num_speculative_tokens)))
        self._last_draft_probs = None
        gated = SI.past_context_gate(self.settings.max_draft_context, cad, batch)
        caps = [0 if g else cap for g in gated]
        sampled = SI.sampled_requests(self.settings.draft_sampling, self._enable_probabilistic_draft_probs,
                                      sampling_metadata, batch).numpy()
        offer = None
        if self.copy_source is not None and next_token_ids is not None and max(caps, default=0) > 0:
            t_copy = time.perf_counter()
            texts = copy_texts(self.runner, req_ids, cad, num_rejected, next_token_ids)
            offer = copy_offer(self.copy_source, req_ids, caps, texts, next_token_ids, self.n_draft)
            self._lap("copy_source", t_copy)
        plan = self.planner.plan(caps, sampled, _copy_view(offer))
        t1 = time.perf_counter()
        self.timings["feedback"] += t1 - t0
        return Decision(t1, batch, req_ids, cap, caps, sampled, plan, offer)

    def propose_before_glue(self, num_speculative_tokens, cad, sampling_metadata, num_tokens: int,
                            states: Callable[[], torch.Tensor], positions: Callable[[], torch.Tensor]):
        """A decode-only step with no drafts in it, decided before the runner's draft glue (patch
        ``v1-runner-no-draft-glue``). Returns the step's empty proposals when it only holds its
        context; None when the runner must take its full path to :meth:`propose`, which then uses
        the plan made here (a plan is made once a step: under TP it is a broadcast).

        The glue it skips prepares the next tokens, the rejected counts and the drafter's query
        metadata: 0.3-0.4 ms of a 30 ms step at batch 1, none of it read by a step that holds.
        ``states`` and ``positions`` give the target's aux hidden states and positions of the
        step's ``num_tokens`` tokens, as upstream's glue would hand them to :meth:`propose`.
        """
        st = self.state
        if self.planner.sent or not (st.hold_ok and st.hold_checked) or int(cad.max_query_len) != 1:
            return None  # feedback needs the rejected counts, or the first hold checks the layout
        if self.copy_source is not None:
            return None  # the copy weighs this step's new token, which the glue prepares
        d = self._decide(num_speculative_tokens, cad, None, sampling_metadata)
        if d.plan.mode is not PlanMode.SKIP:
            st.decided = d
            return None
        t1 = self._flush_if_due(d.plan, True, d.req_ids, d.t1)
        self.pending.hold(d.req_ids, states(), positions()[:num_tokens], cad.slot_mapping[:num_tokens])
        st.before_glue_steps += 1
        self._lap("held", t1)
        return self._no_drafts(d)

    def _flush_if_due(self, plan: Plan, decode_only: bool, req_ids: list[str], t1: float) -> float:
        """Store the held context when this step cannot join it (:mod:`.context_kv`): it drafts, it is
        not decode-only, or its batch changed or the buffer is full. Returns the time after it."""
        if not self.pending.steps or (plan.mode is PlanMode.SKIP and decode_only
                                      and self.pending.accepts(req_ids)):
            return t1
        self.pending.flush(self._store_context, req_ids)
        return self._lap("context_flush", t1)

    def _no_drafts(self, d: Decision) -> list[list[int]]:
        """End a step that drafted nothing: counters, no feedback pending, empty proposals."""
        self.planner.record_none(d.cap, d.batch)
        self.state.last_end = time.perf_counter()
        self._maybe_log()
        return [[] for _ in range(d.batch)]

    # ------------------------------------------------------------------ held context
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
            want_pos = self._context_positions_buffer[:n]
            want_slots = self._context_slot_mapping_buffer[:n]
            if not (torch.equal(want_pos.to(positions.dtype), positions)
                    and torch.equal(want_slots.to(slots.dtype), slots)):
                self.state.hold_ok = False
                logger.warning("vllm_dspark: the runner's slot mapping differs from the drafter's context "
                               "layout; steps without drafts store their context at once (about 1 ms a step)")
                self._store_context(target_hidden_states, want_pos, want_slots)
                return
            self.state.hold_checked = True
        self.pending.hold(req_ids, target_hidden_states, positions, slots)

    # ------------------------------------------------------------------ pieces
    def _divergence(self) -> dict:
        if self._hook is None:
            self._hook = divergence_for_rank(self.consensus.rank)
        return self._hook

    def _draft_time_scale(self) -> float:
        return float(self._divergence().get("draft_time_scale", 1.0))

    def mark_step_start(self) -> None:
        """The runner's ``execute_model`` began (``v1-runner-step-clock`` patch).

        The verify step is timed from here to ``propose``. Timing it from the
        previous ``propose`` would also count the time between steps: an engine
        waiting for requests, or other engines stepped in the same process (the
        lockstep benchmark measured 3-5x the profile that way, and the budget
        dropped its cached profile as stale).
        """
        self.state.step_start = time.perf_counter()
        self.state.step_marks += 1
        self.state.decided = None  # a plan belongs to the step it was made for

    def _feedback(self, req_ids, cad, num_rejected, t0) -> None:
        """Acceptance of the previous drafts, and the duration of the verify step that measured it."""
        st = self.state
        if self.costs is not None and st.last_end is not None and cad.max_query_len <= self.block + 1:
            # Decode-only steps: the interval is the target's verify step (prefill chunks would skew it).
            start = st.last_end if st.step_start is None else max(st.last_end, st.step_start)
            self.costs.observe_verify(int(cad.num_actual_tokens), t0 - start)
            self._check_stale()
        rej = num_rejected.tolist() if num_rejected is not None and self.planner.sent else None
        trace = self.settings.trace_path
        records = self.planner.feedback(req_ids, rej, trace=bool(trace))
        if trace and records:
            SI.write_trace(trace, records)

    def _check_stale(self) -> None:
        """A profile the online corrections keep disowning: drop its cache entry, fold the corrections in."""
        costs = self.costs
        if costs is None or not costs.stale or not self.consensus.is_decider:
            return
        from vllm_dspark.spec_decode.common.profile import drop_cached

        dropped = drop_cached(costs.cache_path)
        logger.warning(
            "vllm_dspark: the budget's cost profile (%s) no longer matches this machine: measured steps took "
            "%.2fx (verify) and %.2fx (draft) its times for %d steps in a row. %s; the measured corrections are "
            "folded into the cost model.", costs.source, costs.scale_verify, costs.scale_draft,
            max(costs.far_verify, costs.far_draft),
            f"Dropped the cached profile {costs.cache_path}, so the next start profiles again" if dropped
            else "Nothing cached to drop")
        costs.cache_path = None
        costs.rebase()

    @property
    def markov_stage(self) -> MarkovStage:
        """The drafter's :class:`MarkovStage`, built once its weights are loaded; with ``use_markov``
        off (the ablation), over the bias-free copy of the weights."""
        mw = self.model.markov
        if self._stage is None or self._stage_src is not mw:
            self._stage_src = mw
            # With a draft vocabulary the model scores its N rows only (draft_logits); else compute_logits.
            logits = getattr(self.model, "draft_logits", None)
            self._stage = MarkovStage(mw if self.settings.use_markov else mw.without_bias(),
                                      logits() if logits is not None else self.model.compute_logits)
            self._stage.lap = self._lap
        return self._stage

    # ------------------------------------------------------------------ observability
    def _maybe_log(self) -> None:
        if self.consensus.rank == 0:  # every rank counts the same acceptances; one publishes them
            self.metrics.maybe_publish(lambda: self.stats.as_dict()["by_source"])
        interval = self.settings.stats_interval_s
        if interval <= 0:
            return
        now = time.monotonic()
        if now - self._last_log >= interval:
            self._last_log = now
            logger.info(self.stats.line(self.settings.verification))

    def report(self) -> dict:
        """Counters, calibration and the cost model (for tests, benchmarks and ``collective_rpc``)."""
        c = self.costs
        stats = self.stats.as_dict()
        if self.consensus.rank == 0:
            self.metrics.maybe_publish(lambda: stats["by_source"], force=True)
        return {"stats": stats, "calibration": self.calibrator.table(),
                "timings_s": dict(self.timings),
                "costs": None if c is None else {**c.to_dict(), "scale_verify": c.scale_verify,
                                                 "scale_draft": c.scale_draft, "rebased": c.rebased,
                                                 "cache_path": c.cache_path},
                "held_context": {**self.pending.counts, "enabled": self.state.hold_ok,
                                 "before_glue_steps": self.state.before_glue_steps},
                "layout": {"rejected_rows_dropped": self.state.rejected_rows_dropped,
                           "probe_blocks_cut": self.state.probe_blocks_cut},
                "step_clock": {"marks": self.state.step_marks,
                               "from": "execute_model" if self.state.step_marks else "previous propose"},
                "policy": self.policy.report(), "consensus": self.consensus.report(),
                "copy": None if self.copy_policy is None or self.copy_source is None
                else {**self.copy_policy.report(), "source": self.copy_source.report()},
                "profile": self.profile_info, "settings": self.settings.to_dict()}


def _widen(drafts: Drafts, batch: int, rows: list[int], n: int) -> Drafts:
    """A probe's drafts for ``rows`` ([len(rows), k]) placed in a [batch, n] record, zero elsewhere."""
    k = drafts.tokens.shape[1]
    dev = drafts.tokens.device
    tokens = torch.zeros(batch, n, dtype=torch.int64, device=dev)
    conf = torch.zeros(batch, n, dtype=torch.float32, device=dev)
    tokens[rows, :k], conf[rows, :k] = drafts.tokens, drafts.confidence
    probs = None
    if drafts.probs is not None:
        probs = torch.zeros(batch, n, drafts.probs.shape[-1], dtype=torch.float32, device=drafts.probs.device)
        probs[rows, :k] = drafts.probs
    return Drafts(tokens, conf, probs, drafts.source, drafts.path)


def _copy_view(offer: CopyOffer | None) -> CopyDrafts | None:
    """What the planner reads of the copy's offer (NumPy, as the policies take it)."""
    return None if offer is None else CopyDrafts(offer.drafts.confidence.numpy(), offer.lengths)
