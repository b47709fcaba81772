"""Patches of ``vllm.v1.worker.gpu_model_runner`` (the V1 runner; the CPU runner inherits it).

1. ``GPUModelRunner.__init__``: a draft that ``config_speculative`` resolved
   as DSpark gets ``DSparkProposer`` (a ``DFlashProposer`` subclass, so every
   ``isinstance`` check in the runner still holds) instead of upstream's
   ``DFlashProposer``, right after the runner is built and before any model is
   loaded.

2. ``GPUModelRunner._sample`` and ``GPUModelRunner._bookkeeping_sync`` (CPU
   only): a seeded request whose prefill is split over several steps crashes
   the whole engine on vLLM 0.32's CPU backend. For such a partial step the
   runner samples a token it then discards, and rewinds the request's
   generator with ``gen.set_offset(gen.get_offset() - 4)``; a CPU
   ``torch.Generator`` has no offset and raises ``RuntimeError: CPU Generator
   does not use offset`` in the engine core, which takes every in-flight
   request down with it (seen under ``vllm serve`` with long seeded prompts,
   with or without speculation). The patches keep upstream's intent on CPU:
   the state of those requests' generators is saved before sampling and
   restored after it, and the offset rewind is skipped for them.

3. ``GPUModelRunner.execute_model``: tells a DSpark proposer when a step
   begins (``mark_step_start``), so the budget times the verify step itself
   and not the gap since the previous step.

4. ``GPUModelRunner.propose_draft_token_ids``: a decode-only step with no
   draft in the batch asks the DSpark proposer for its plan before upstream's
   draft glue (next-token and rejected-count preparation, the drafter's query
   metadata), and skips the glue when the step only holds its context or only
   the copy drafts (``DSparkProposer.propose_before_glue``). Each request's
   next token is then the one it sampled (``_sampled_once``).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_dspark.patch.registry import Patch, register_patch
from vllm_dspark.serving.settings import ATTR


def _is_dspark_draft(vllm_config) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    return bool(draft is not None and getattr(draft.hf_config, ATTR, None) is not None)


def _make_init(original):
    def __init__(self, vllm_config, device, *args, **kwargs):
        original(self, vllm_config, device, *args, **kwargs)
        if _is_dspark_draft(vllm_config) and hasattr(self, "drafter"):
            from vllm_dspark.spec_decode.v1.proposer import DSparkProposer

            self.drafter = DSparkProposer(vllm_config, self.device, self)
    return __init__


def _make_execute_model(original):
    def execute_model(self, *args, **kwargs):
        mark = getattr(getattr(self, "drafter", None), "mark_step_start", None)
        if mark is not None:
            mark()
        return original(self, *args, **kwargs)
    return execute_model


def _glue_free(runner, scheduler_output, aux_hidden_states, spec_decode_metadata) -> bool:
    """Whether this step may be planned before the glue: decode-only, no draft in the batch, the
    hidden states DSpark reads, and nothing the glue would do for others (the async-scheduling copy
    of the valid counts, the drafter's multimodal inputs)."""
    return (aux_hidden_states is not None and getattr(runner, "use_aux_hidden_state_outputs", False)
            and (spec_decode_metadata is None or spec_decode_metadata.max_spec_len == 0)
            and getattr(runner, "valid_sampled_token_count_event", None) is None
            and not (runner.supports_mm_inputs and getattr(runner.drafter, "supports_mm_inputs", False))
            and not getattr(runner, "uses_mrope", False)
            and scheduler_output.total_num_scheduled_tokens == runner.input_batch.num_reqs)


def _sampled_once(runner, sampled_token_ids, n: int) -> torch.Tensor | None:
    """[n] the token each request sampled in a step that ran one token per request and verified no draft:
    the next token upstream's glue would prepare for it. None where the glue must decide (a request whose
    token is discarded, a partial prefill, or tokens not held as a [requests, 1 + drafts] tensor)."""
    if not isinstance(sampled_token_ids, torch.Tensor) or sampled_token_ids.dim() != 2 \
            or sampled_token_ids.shape[0] < n or sampled_token_ids.shape[1] < 1:
        return None
    if bool(runner.discard_request_mask.np[:n].any()):
        return None
    tokens = sampled_token_ids[:n, 0]
    return None if bool((tokens < 0).any()) else tokens


def _make_propose_draft_token_ids(original):
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        early = getattr(getattr(self, "drafter", None), "propose_before_glue", None)
        if early is not None and _glue_free(self, scheduler_output, aux_hidden_states, spec_decode_metadata):
            n = scheduler_output.total_num_scheduled_tokens
            self._draft_probs = None
            self._draft_prob_req_ids = None
            out = early(scheduler_output.num_spec_tokens_to_schedule, common_attn_metadata, sampling_metadata, n,
                        lambda: torch.cat([h[:n] for h in aux_hidden_states], dim=-1),
                        lambda: self._get_positions(n), lambda: _sampled_once(self, sampled_token_ids, n))
            if out is not None:
                return out
        return original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                        sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                        slot_mappings)
    return propose_draft_token_ids


def _discarded_with_generator(runner) -> list[int]:
    n = runner.input_batch.num_reqs
    idx = np.nonzero(runner.discard_request_mask.np[:n])[0]
    gens = runner.input_batch.generators
    return [int(i) for i in idx if int(i) in gens]


def _make_sample(original):
    def _sample(self, logits, spec_decode_metadata):
        if self.device.type != "cpu":
            return original(self, logits, spec_decode_metadata)
        gens = self.input_batch.generators
        saved = {i: gens[i].get_state() for i in _discarded_with_generator(self)}
        out = original(self, logits, spec_decode_metadata)
        for i, state in saved.items():
            gens[i].set_state(state)
        return out
    return _sample


def _make_bookkeeping(original):
    def _bookkeeping_sync(self, *args, **kwargs):
        if self.device.type != "cpu":
            return original(self, *args, **kwargs)
        gens = self.input_batch.generators
        hidden = {i: gens.pop(i) for i in _discarded_with_generator(self)}
        try:
            return original(self, *args, **kwargs)
        finally:
            gens.update(hidden)
    return _bookkeeping_sync


PATCH = register_patch(Patch(
    name="v1-runner-dspark-proposer",
    module="vllm.v1.worker.gpu_model_runner",
    attribute="GPUModelRunner.__init__",
    what="after the runner is built, a DSpark-resolved draft gets DSparkProposer instead of DFlashProposer",
    why="the V1 runner chooses its proposer class by method and knows no DSpark proposer",
    versions=("0.32",),
    removable_when="vLLM's V1 runner constructs a DSpark proposer itself (or takes a proposer class hook)",
    make=_make_init,
))

STEP_CLOCK_PATCH = register_patch(Patch(
    name="v1-runner-step-clock",
    module="vllm.v1.worker.gpu_model_runner",
    attribute="GPUModelRunner.execute_model",
    what="a DSpark proposer is told when execute_model begins, and times the verify step from there",
    why="timed from the previous propose, the step also holds the time between steps (an idle engine, "
        "other engines stepped in one process): the budget read 3-5x its profile and dropped it as stale",
    versions=("0.32",),
    removable_when="vLLM hands proposers the step's start time (or the V1 runner times its steps)",
    make=_make_execute_model,
))

SAMPLE_PATCH = register_patch(Patch(
    name="cpu-seeded-partial-prefill-sample",
    module="vllm.v1.worker.gpu_model_runner",
    attribute="GPUModelRunner._sample",
    what="on CPU, the generator state of a seeded request in a partial (discarded) step is saved before "
         "sampling and restored after it",
    why="vLLM 0.32 rewinds those generators with set_offset, which CPU generators do not support: the "
        "engine core crashes ('CPU Generator does not use offset') on the first split seeded prefill",
    versions=("0.32",),
    removable_when="vLLM rewinds CPU generators by state (or skips sampling discarded requests)",
    make=_make_sample,
))

BOOKKEEPING_PATCH = register_patch(Patch(
    name="cpu-seeded-partial-prefill-bookkeeping",
    module="vllm.v1.worker.gpu_model_runner",
    attribute="GPUModelRunner._bookkeeping_sync",
    what="on CPU, the offset rewind of discarded seeded requests is skipped (their state was restored "
         "by cpu-seeded-partial-prefill-sample)",
    why="CPU torch.Generator has no offset; set_offset raises and kills the engine core",
    versions=("0.32",),
    removable_when="together with cpu-seeded-partial-prefill-sample",
    make=_make_bookkeeping,
))

NO_DRAFT_GLUE_PATCH = register_patch(Patch(
    name="v1-runner-no-draft-glue",
    module="vllm.v1.worker.gpu_model_runner",
    attribute="GPUModelRunner.propose_draft_token_ids",
    what="a decode-only step with no draft in the batch is planned by the DSpark proposer before upstream's "
         "draft glue, and a step that only holds its context skips the glue",
    why="the glue (prepare_next_token_ids_padded, prepare_inputs_padded, the aux-state concat) cost 0.3-0.4 ms "
        "of a 30 ms batch-1 step, on every step the budget drafts nothing; nothing it prepares is read then",
    versions=("0.32",),
    removable_when="vLLM asks the proposer whether it drafts before preparing its inputs",
    make=_make_propose_draft_token_ids,
))
