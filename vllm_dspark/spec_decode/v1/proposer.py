"""DSpark proposer for vLLM's V1 model runner (CPU backend, and GPU users on V1).

A subclass of vLLM's ``DFlashProposer``: context-KV precompute, the non-causal
block forward, the KV cache and the rejection sampler are upstream's. Each
step (``propose``):

1. **Feedback.** The verify step that just ran tells how many of each
   request's previous drafts were accepted (``num_rejected_tokens_gpu``); that
   feeds the confidence calibrator, the counters and the trace. Its duration
   corrects the cost model. The text sources (the copy, on by default) draft
   from each request's text, and the planner plans with them (:mod:`.sources`).
2. **Layout.** Anchor-first: ``block_size`` queries ``[anchor, mask x (B-1)]``
   at positions ``p..p+B-1``, every row sampled (B drafts, the target verifies
   up to 1 + B tokens). ``one_plus_n`` checkpoints keep upstream's 1 + N layout.
3. **Block forward** (skipped on steps the budget forecast says will not pay:
   every request decodes plainly, and the step's target states are held in
   :mod:`.context_kv` until the drafter next runs, then stored in one call,
   so the drafter's cache stays complete; copy-only steps' accepted rows too).
4. **Sequential stage.** Greedy requests draft through the Markov draft op;
   requests with temperature > 0 draft by sampling their Markov-corrected,
   top-k/top-p-filtered distribution (``draft_sampling: auto``), whose
   probabilities go to the rejection sampler.
5. **Verification.** How many drafts each request sends to the target:
   ``budget`` (survival-ranked slots admitted while they pay for their verify
   cost, :mod:`.budget`), ``threshold`` (the DSpark reference rule),
   ``product`` (the project's earlier rule) or ``fixed``, and which source each
   request's drafts come from (:func:`.sources.pick_rows`); requests past
   ``max_draft_context`` get none.

Every overridden upstream method and every upstream helper called is listed,
with its signature, in :mod:`.overrides` and checked when the proposer is built.
Settings come from one :class:`~vllm_dspark.serving.settings.DSparkSettings`.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_dspark.serving.metrics import Publisher
from vllm_dspark.serving.settings import DSparkSettings, for_async_scheduling, settings_of
from vllm_dspark.spec_decode.common.budget import PlanMode
from vllm_dspark.spec_decode.common.consensus import Consensus, divergence_for_rank
from vllm_dspark.spec_decode.common.copy_source import CopySource
from vllm_dspark.spec_decode.common.costs import CostModel
from vllm_dspark.spec_decode.common.drafts import DraftBatch, Drafts, DraftSource, MarkovStage
from vllm_dspark.spec_decode.common.planner import StepPlanner
from vllm_dspark.spec_decode.common.sources import COPY_SOURCE, MODEL_SOURCE
from vllm_dspark.spec_decode.v1 import step_inputs as SI
from vllm_dspark.spec_decode.v1.accepted_context import AcceptedRows, accepted_context, accepted_rows
from vllm_dspark.spec_decode.v1.context_kv import PendingContext
from vllm_dspark.spec_decode.v1.held import HeldContext
from vllm_dspark.spec_decode.v1.layout import lay_out_queries
from vllm_dspark.spec_decode.v1.overrides import check_couplings
from vllm_dspark.spec_decode.v1.probe_block import probe_queries
from vllm_dspark.spec_decode.v1.report import ProposerReport
from vllm_dspark.spec_decode.v1.sources import copy_prior_for, pick_rows, request_texts, text_offers, widen
from vllm_dspark.spec_decode.v1.step_state import Decision, StepState

logger = logging.getLogger("vllm_dspark")

# Parts of the block forward and of the Markov stage (each also inside its phase's own total): the
# attention metadata, the context K/V of the step's new tokens, the LM head, the confidence head, the
# greedy rows' op, the sampled rows.
PARTS = ("block.metadata", "block.context_kv", "stage.lm_head", "stage.confidence", "stage.markov_op",
         "stage.sampled")


class DSparkProposer(HeldContext, ProposerReport, DFlashProposer):
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
        self.planner = StepPlanner(s, self.n_draft, self.consensus.decide, copy_prior_for(s, spec))
        self.stats, self.policy, self.copy_policy = self.planner.stats, self.planner.policy, self.planner.copy_policy
        self.calibrator = self.policy.calibrator
        self.copy_source: CopySource | None = None
        if s.copies:
            self.copy_source = CopySource(min_match=s.copy_min_match, max_match=max(8, s.copy_min_match),
                                          shared=s.copy_shared)
        # Sources that draft from the requests' texts, before the plan (the model source drafts after it).
        self.text_sources: list[DraftSource] = [self.copy_source] if self.copy_source is not None else []
        self.costs: CostModel | None = None
        if s.costs is not None:
            self.costs = CostModel.from_dict(s.costs, source="speculative_config['dspark']['costs']", given=True)
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
        self.state = StepState(hold_ok=not s.window or s.window > self.pending.max_tokens + 2 * self.block_size)
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
        # A verify step the drafter sits out keeps its accepted context rows too, when holding is proven.
        rows = self._accepted_rows_to_hold(d, cad, num_rejected_tokens_gpu, target_hidden_states)
        holdable = (decode_only and not d.plan.runs) or rows is not None
        t = self._flush_if_due(d.plan, holdable, d.req_ids, d.t1, 1 if rows is None else rows.most)
        if rows is not None:
            self.pending.hold(d.req_ids, target_hidden_states[rows.index], target_positions[rows.index],
                              cad.slot_mapping[rows.index], rows.owners)
            self.state.copy_steps_held += int(d.plan.runs)
            self.state.verify_steps_held += int(not d.plan.runs)
            t = self._lap("held", t)
            return self._send_copies(d, next_token_ids, t, t)
        if not d.plan.runs and decode_only and self.state.hold_ok:
            self._hold(d.req_ids, target_token_ids, target_hidden_states, target_positions, cad, next_token_ids,
                       token_indices_to_sample, num_rejected_tokens_gpu)
            self._lap("held", t)
            return self._no_drafts(d)

        t_layout = t  # the drafter's cost runs from here: its step needs the layout, a step without it does not
        num_query, sample_rows, block_cad = self._lay_out(
            d.batch, target_token_ids, target_positions, target_hidden_states, next_token_ids,
            token_indices_to_sample, cad, num_rejected_tokens_gpu)
        t = self._lap("layout", t)
        if not d.plan.drafter_runs:
            # The drafter's K/V of this step's tokens must still be written, or later drafts would
            # read a context with holes in it; the block forward and the Markov stage are skipped.
            n = self._dflash_num_context
            self.model.precompute_and_store_context_kv(
                self._dflash_hidden_states, self._context_positions_buffer[:n],
                self._context_slot_mapping_buffer[:n])
            self._check_hold(cad, num_rejected_tokens_gpu, target_positions, n)
            t = self._lap("context_kv_only", t)
            return self._send_copies(d, next_token_ids, t, t_layout)

        probed = d.plan.mode is PlanMode.PROBE and len(d.plan.rows) < d.batch and mm_embed_inputs is None
        if probed:  # the probed requests' query blocks alone (their context K/V is stored for all)
            num_query, sample_rows, block_cad = probe_queries(
                (self.input_ids, self.positions, self._slot_mapping_buffer), block_cad, sample_rows, d.batch,
                self.block, d.plan.rows)
            self.state.probe_blocks_cut += 1
        rows = self._block_forward(num_query, sample_rows, block_cad, mm_embed_inputs)
        t = self._lap("block_forward", t)
        model = self._draft_model(d, rows, next_token_ids, sampling_metadata, cad, probed)
        t = self._lap("markov_stage", t)
        offer = d.offers.get(COPY_SOURCE)
        conf = model.confidence.cpu().numpy().astype(np.float64)
        kept, picks = self.planner.allocate(d.plan, d.caps, d.sampled, conf, offer.view() if offer else None)
        drafts = pick_rows({MODEL_SOURCE: model, **{k: o.drafts for k, o in d.offers.items()}}, picks, d.sampled)
        return self._record(d, drafts, kept, next_token_ids, t, t_layout, picks)

    def _accepted_rows_to_hold(self, d: Decision, cad, num_rejected, hidden_states) -> AcceptedRows | None:
        """The accepted context rows of a step the drafter sits out, to hold (:mod:`.context_kv`) once holding
        is proven: one that sends copies, or verified drafts and sends none (stored at once before: 0.6 ms of
        layout, on 104 of 636 steps of HumanEval at batch 1 with the drafter's plan forced to skip)."""
        st = self.state
        if d.plan.drafter_runs or not (st.hold_ok and st.hold_checked) or int(cad.max_query_len) > self.block + 1:
            return None  # (a prefill chunk in the step)
        if not d.plan.runs and int(cad.max_query_len) == 1:
            return None  # decode-only, sending nothing: held whole (_hold)
        return accepted_rows(cad, num_rejected, hidden_states.device)

    def _send_copies(self, d: Decision, next_token_ids, t: float, t_layout: float) -> list[list[int]]:
        """End a step the drafter did not draft in: what the plan copies, nothing else."""
        if COPY_SOURCE not in d.offers or not any(d.plan.copy_kept):
            return self._no_drafts(d)
        kept, picks = self.planner.allocate(d.plan, d.caps, d.sampled, None, d.offers[COPY_SOURCE].view())
        drafts = pick_rows({k: o.drafts for k, o in d.offers.items()}, picks, d.sampled)
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

    def _draft_model(self, d: Decision, rows: torch.Tensor, next_token_ids, sampling_metadata, cad,
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
        return widen(drafts, d.batch, idx, n)

    def _record(self, d: Decision, drafts: Drafts, kept: list[int], next_token_ids, t: float,
                t_layout: float, picks: list[str]) -> list[list[int]]:
        """Counters, the feedback the next step awaits, the trace and the drafter's observed cost.
        ``picks``: the source of each request's drafts."""
        conf_l = drafts.confidence.tolist()
        tok_l = drafts.tokens.tolist()
        self.planner.record(d.req_ids, d.plan, d.cap, kept, picks, conf_l, d.sampled)
        if drafts.probs is not None:
            self._last_draft_probs = drafts.probs
        end = time.perf_counter()  # before the trace: a diagnostic, not a cost the budget should learn
        self.timings["verify"] += end - t
        if self.settings.trace_path:
            SI.write_trace(self.settings.trace_path, SI.draft_records(
                self.planner.step, str(self.planner.sent_kind), d.req_ids, self._trace_positions,
                next_token_ids[:d.batch].tolist(), tok_l, conf_l, kept, d.sampled, picks, self.settings,
                self.markov_stage.last_path))
        if self.costs is not None and d.plan.mode is PlanMode.DRAFT and d.plan.drafter_runs:
            # What the profile's draft point measures (block forward, LM head, sequential stage, choice) and the
            # layout before them (0.35-0.7 ms at batch 1 in bf16), which the online scale takes in.
            self.costs.observe_draft(d.batch, (end - t_layout) * self._draft_time_scale())
            self._check_stale()
        elif self.costs is not None and not d.plan.drafter_runs:  # the copy's own cost of a step it sends
            self.costs.observe_source(COPY_SOURCE, d.batch, end - d.t1)
        if not d.plan.drafter_runs:
            self.state.copy_only_steps += 1
            self.state.copy_only_s += end - d.t0
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
        offers = {}
        if self.text_sources and next_token_ids is not None and max(caps, default=0) > 0:
            t_copy = time.perf_counter()
            texts = request_texts(self.runner, req_ids, cad, num_rejected, next_token_ids)
            offers = text_offers(self.text_sources, req_ids, caps, texts, next_token_ids, self.n_draft)
            self._lap("copy_source", t_copy)
        copy = offers.get(COPY_SOURCE)
        plan = self.planner.plan(caps, sampled, copy.view() if copy else None)
        t1 = time.perf_counter()
        self.timings["feedback"] += t1 - t0
        return Decision(t1, batch, req_ids, cap, caps, sampled, plan, offers, t0)

    def _no_drafts(self, d: Decision) -> list[list[int]]:
        """End a step that drafted nothing: counters, no feedback pending, empty proposals."""
        self.planner.record_none(d.cap, d.batch)
        self.state.last_end = time.perf_counter()
        self._maybe_log()
        return [[] for _ in range(d.batch)]

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
