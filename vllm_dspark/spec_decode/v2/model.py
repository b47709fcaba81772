"""The DSpark draft model for vLLM 0.33's V2 GPU model runner (registered as ``Qwen3DSparkModel``).

vLLM 0.33 serves ``method: "dspark"`` in its V2 runner with
``DSparkSpeculator`` (``vllm/v1/worker/gpu/spec_decode/dspark/speculator.py``).
A SpecForge export (``architectures: ["DSparkDraftModel"]``, ``model_type:
qwen3``) is renamed to ``Qwen3DSparkModel`` by ``SpeculativeConfig``
(``vllm/config/speculative.py``), and the plugin registers
:class:`DSparkV2DraftModel` under that name. The class is upstream's
``Qwen3DSparkForCausalLM`` plus:

* the hook ``sample_sequential(speculator, num_reqs, head_hidden) -> bool``,
  which ``DSparkSpeculator._sample_sequential`` calls (when top-k gathered
  drafting is off) before its own per-position loop. It runs the whole Markov
  stage as ONE call of the Markov draft op (``torch.ops.vllm_dspark.
  markov_draft``, the CUDA kernel) and returns True; or returns False having
  done nothing, and upstream's loop runs (the reason is logged once);
* the DSpark keys SpecForge nests in ``dflash_config`` (``markov_rank`` ...)
  exposed where upstream's modules read them, and older exports' tensor names;
* for a Kimi K3 target, a clear failure when this worker lacks
  ``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1``.

The hook contract (read from vLLM 0.33.0's source)
    Called inside ``DSparkSpeculator._generate_draft``, i.e. inside the FULL
    CUDA graph the speculator captures: it must not synchronise with the host
    and its True/False must not depend on tensor values (a replay runs only
    the kernels recorded at capture). On True it must have written:

    * ``speculator.draft_tokens[:num_reqs]``: [num_reqs, N] int64, TARGET-vocab
      ids (N = ``num_speculative_steps``, one per query row: anchor-first);
    * ``speculator.draft_token_confidence_probs[:num_reqs]``: [num_reqs, N]
      fp32 ``sigmoid(confidence_head([h_i; markov_w1[prev_i]]))``, only when
      ``speculator.use_confidence_head``;
    * ``speculator.draft_logits[state, i, :V]`` (pre-temperature corrected
      logits, the rejection sampler's proposal q) when ``draft_logits`` is not
      None (``draft_sample_method="probabilistic"``); ``state`` is
      ``sample_idx_mapping`` (-1 for padded rows, which must write nothing);
    * the acceptance estimator's features (``speculator._maybe_predict_
      acceptance(logits_i, idx_map[:, i], _step_cols[i])``) when it exists.

    Inputs the hook reads: ``head_hidden`` [num_tokens_padded, H] (the
    backbone's output), ``sample_indices`` / ``sample_pos`` /
    ``sample_idx_mapping`` (flattened (request, step); ``sample_pos`` is the
    absolute position of the predicted token), the anchor
    ``input_buffers.input_ids[_anchor_idx[:num_reqs]]`` (int32), and the
    per-request-state ``temperature`` [max_num_reqs] fp32 and ``seeds``
    [max_num_reqs] int64. Upstream drafts greedily (argmax) when
    ``draft_logits`` is None, whatever the request's temperature: the
    rejection sampler then treats the draft as a one-hot proposal.

Seeds (sampled drafting)
    The op's Gumbel noise is counter-based per (seed, block position, token).
    The seed of request r is ``seeds[state_r] XOR (anchor_pos_r << 32)``, where
    ``anchor_pos_r = sample_pos[r, 0] - 1`` is the anchor's absolute position:
    distinct per decoding step of a request (the anchor moves forward by at
    least one token every step), reproducible for a seeded request, and drawn
    by a hash unrelated to vLLM's murmur3 streams, so it is independent of the
    target's verification noise (the ratio test needs that, not equality).

When the op declines (upstream's loop runs, reason logged once)
    no compiled CUDA kernel; top-k gathered drafting (upstream does not even
    call the hook then); reduced draft vocabulary (``d2t``); quantized or
    non-float Markov weights; ``logit_scale``/``soft_cap`` on the draft's
    logits processor; a watermarker; an ``apply_output_logit_transform``; and
    probabilistic drafting with a ``draft_logits`` cache that is not fp32. The
    last one keeps verification exact: the op draws from fp32 corrected logits,
    while a bf16 cache would hand the rejection sampler a slightly different q.
    Run the target with ``--hf-overrides '{"head_dtype": "float32"}'`` to use
    the op for probabilistic drafting.

Early stop
    On this path the confidence-gated early stop is upstream's adaptive
    verification (``enable_adaptive_verification``), fed by the confidences
    written here (the op computes confidences, not lengths). The settings of
    ``serving/settings_table.py`` apply to the V1 path only; set in the
    environment, they are named in one warning (``settings.not_applied_on_v2``).

Checked by ``tests/spec_decode/test_model_v2.py`` on CPU (the pure functions
below, against ``markov_draft_reference`` and a restatement of upstream's
loop, with a fake speculator). Nothing here has run on a GPU or against a real
vLLM 0.33 install: see ``docs/vllm-0.33.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from vllm_dspark.model.markov_weights import MarkovWeights
from vllm_dspark.spec_decode.common.drafts import MarkovStage
from vllm_dspark.versions import V2_SERIES, require

logger = logging.getLogger("vllm_dspark")

__all__ = [  # noqa: F822 (DSparkV2DraftModel is built on first access, see __getattr__)
    "DSparkV2DraftModel",
    "MarkovWeights",
    "check_k3_worker",
    "derive_draft_seeds",
    "request_sampling_params",
    "run_markov_stage",
    "why_not_speculator",
    "why_not_weights",
]

_logged: set[str] = set()
# vLLM's quant methods that leave a LM-head-like weight a plain float tensor.
_PLAIN_METHODS = ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.warning("vllm_dspark: DSpark V2 Markov stage runs upstream's loop, not the Markov draft op: %s",
                       reason)


# ---------------------------------------------------------------------------- pure logic
def why_not_weights(markov_w1: Any, markov_w2: Any, vocab: int) -> str | None:
    """Whether the op can read these Markov weights as they are, or the reason it can't."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    for name, w in (("markov_w1", markov_w1), ("markov_w2", markov_w2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            return f"{name} is not a plain [vocab, rank] tensor (quantized checkpoint?)"
        if w.dtype not in floats:
            return f"{name} has dtype {w.dtype} (quantized?); the op reads fp32/bf16/fp16"
        if w.shape[0] < vocab:
            return f"{name} has {w.shape[0]} rows, fewer than the draft vocabulary {vocab}"
    if markov_w1.dtype != markov_w2.dtype:
        return f"markov_w1 ({markov_w1.dtype}) and markov_w2 ({markov_w2.dtype}) differ in dtype"
    if markov_w1.shape[1] != markov_w2.shape[1]:
        return f"markov ranks differ: {markov_w1.shape[1]} vs {markov_w2.shape[1]}"
    if markov_w1.device != markov_w2.device:
        return "markov_w1 and markov_w2 are on different devices"
    return None


def why_not_speculator(speculator: Any, device: torch.device) -> str | None:
    """Static reasons (no tensor values read) the op can't serve this speculator's calls."""
    from vllm_dspark.ops import is_compiled_available

    if getattr(speculator, "_draft_topk", None) is not None:
        return "dspark_draft_topk (top-k gathered drafting) is set"
    if getattr(speculator, "_d2t_scatter_index", None) is not None:
        return "the draft has a reduced vocabulary (d2t mapping)"
    if getattr(speculator, "draft_watermarker", None) is not None:
        return "a draft watermarker is configured"
    cache = getattr(speculator, "draft_logits", None)
    if cache is not None and cache.dtype != torch.float32:
        return (f"probabilistic drafting caches the proposal in {cache.dtype}; the op samples from fp32 "
                "logits, so verification would test a slightly different q (set the target's "
                "head_dtype to float32 to use the op)")
    if not is_compiled_available(device.type):
        return f"no compiled markov_draft kernel for {device.type!r}"
    return None


def derive_draft_seeds(request_seeds: torch.Tensor, anchor_pos: torch.Tensor) -> torch.Tensor:
    """Per-request seed of the op's Gumbel noise: ``seed XOR (anchor_pos << 32)``, int64 [R].

    ``anchor_pos`` [R] is the absolute position of the block's anchor, so each
    decoding step of a request draws fresh noise; the op adds the position
    inside the block itself.
    """
    return request_seeds.to(torch.int64) ^ (anchor_pos.to(torch.int64) << 32)


def request_sampling_params(speculator: Any, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(temperature [R] fp32, seeds [R] int64) for the op, from the speculator's per-state buffers.

    Greedy (temperature 0) for every request unless the speculator caches
    draft logits (probabilistic drafting), as upstream does. Padded rows
    (``sample_idx_mapping == -1``) get temperature 0 and seed 0. No host sync.
    """
    n = speculator.num_speculative_steps
    num_sample = num_reqs * n
    state = speculator.sample_idx_mapping[:num_sample].view(num_reqs, n)[:, 0]  # [R]
    anchor_pos = speculator.sample_pos[:num_sample].view(num_reqs, n)[:, 0] - 1  # [R]
    valid = state >= 0
    safe = state.clamp(min=0)
    seeds = torch.where(valid, derive_draft_seeds(speculator.seeds[safe], anchor_pos),
                        torch.zeros_like(anchor_pos, dtype=torch.int64))
    if speculator.draft_logits is None:
        temperature = torch.zeros(num_reqs, dtype=torch.float32, device=state.device)
    else:
        temperature = torch.where(valid, speculator.temperature[safe].to(torch.float32),
                                  torch.zeros((), dtype=torch.float32, device=state.device))
    return temperature, seeds


def _write_logits_cache(cache: torch.Tensor, state: torch.Tensor, logits: torch.Tensor) -> None:
    """``cache[state[r], :, :V] = logits[r]`` for rows with ``state >= 0``, without a host sync.

    Padded rows (-1) are sent to row 0's slot, then row 0 writes its slot once
    more, so the duplicate writes of the first ``index_copy_`` cannot leave a
    padded row's values there. Padding sits after the real rows, so row 0 is
    padding only when every row is (CUDA-graph capture's warm-up): then slot 0
    gets its own earlier content back, and nothing is written.
    """
    V = logits.shape[-1]
    dst = cache if cache.shape[-1] == V else cache[:, :, :V]
    first = state[:1].clamp(min=0)  # [1]
    keep = dst.index_select(0, first)  # [1, N, V] the fallback slot as it was
    safe = torch.where(state >= 0, state, first)  # [R]
    src = logits.to(cache.dtype)
    dst.index_copy_(0, safe, src)
    dst.index_copy_(0, first, torch.where(state[:1, None, None] >= 0, src[:1], keep))


def run_markov_stage(
    speculator: Any,
    num_reqs: int,
    head_hidden: torch.Tensor,
    weights: MarkovWeights,
    compute_draft_logits: Callable[[torch.Tensor], torch.Tensor],
    op: Callable[..., Any] | None = None,
) -> None:
    """DSparkSpeculator's sequential stage as one call of the Markov draft op.

    Parameters
    ----------
    speculator : vLLM 0.33 ``DSparkSpeculator`` (or an object with its attributes)
    num_reqs : requests in this (possibly padded) step
    head_hidden : [num_tokens, H], the backbone's output for every query row
    weights : the draft model's :class:`MarkovWeights`
    compute_draft_logits : [rows, H] -> [rows, V] base logits (the target's LM head)
    op : ``torch.ops.vllm_dspark.markov_draft`` (default) or a stand-in with its schema

    Writes ``draft_tokens[:num_reqs]`` [R, N] int64, the confidences
    (``use_confidence_head``), the draft-logits cache and the acceptance
    estimator's features; see the module docstring. No host sync; the op's
    outputs go straight into the speculator's persistent buffers.
    """
    stage = MarkovStage(weights, compute_draft_logits)
    n = speculator.num_speculative_steps
    num_sample = num_reqs * n
    sample_hidden = head_hidden[speculator.sample_indices[:num_sample]]  # [R*N, H]
    use_conf = bool(getattr(speculator, "use_confidence_head", False))
    base, conf_base = stage.inputs(sample_hidden, num_reqs, n, with_confidence=use_conf)  # [R, N, V], [R, N] or None
    V = weights.vocab
    dev = base.device

    anchors = speculator.input_buffers.input_ids[speculator._anchor_idx[:num_reqs]].to(torch.int64)  # [R]
    temperature, seeds = request_sampling_params(speculator, num_reqs)

    if use_conf:
        out_conf = speculator.draft_token_confidence_probs[:num_reqs]  # [R, N] fp32
    else:
        out_conf = torch.empty(num_reqs, n, dtype=torch.float32, device=dev)

    cache = speculator.draft_logits
    estimator = getattr(speculator, "acceptance_estimator", None)
    out_logits = (torch.empty(num_reqs, n, V, dtype=torch.float32, device=dev)
                  if cache is not None or estimator is not None else None)
    out_tokens = speculator.draft_tokens[:num_reqs]  # [R, N] int64

    stage.draft_into(base, anchors, conf_base, temperature, seeds, out_tokens, out_conf, out_logits, op=op)

    if out_logits is not None:
        idx_map = speculator.sample_idx_mapping[:num_sample].view(num_reqs, n)
        if estimator is not None:
            for i in range(n):
                speculator._maybe_predict_acceptance(out_logits[:, i], idx_map[:, i], speculator._step_cols[i])
        if cache is not None:
            _write_logits_cache(cache, idx_map[:, 0], out_logits)


def check_k3_worker(vllm_config: Any) -> str:
    """For a Kimi K3 target, fail unless this worker has ``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1``.

    Runs in the worker that builds the draft model, after the driver had its
    chance to set the switch, so it only checks (``set_env=False``). Other
    targets return ``"not-needed"`` without parsing the draft's config (this
    class also serves upstream-format Qwen3 DSpark checkpoints).
    """
    from vllm_dspark.serving.compat import ensure_for_vllm_config, is_kimi_k3, load_target_config

    if not is_kimi_k3(load_target_config(vllm_config.model_config.hf_config)):
        return "not-needed"
    return ensure_for_vllm_config(vllm_config, set_env=False)


# ---------------------------------------------------------------------------- the vLLM class
def _build_class():
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    from vllm_dspark.checkpoint.io import canonical_name
    from vllm_dspark.serving.settings import not_applied_on_v2
    from vllm_dspark.spec_decode.common.draft_keys import check_v2_head, expose_dspark_keys

    class DSparkV2DraftModel(Qwen3DSparkForCausalLM):
        """Upstream's Qwen3 DSpark draft whose sequential stage runs on the Markov draft op."""

        def __init__(self, *, vllm_config, prefix: str = ""):
            hf_config = vllm_config.speculative_config.draft_model_config.hf_config
            expose_dspark_keys(hf_config, allow_no_markov=False)
            check_v2_head(hf_config)
            check_k3_worker(vllm_config)
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self._markov: MarkovWeights | None = None
            self._markov_reason: str | None = "weights not loaded yet"
            self._decision: tuple[int, bool] | None = None
            ignored = not_applied_on_v2()
            if ignored:
                logger.warning("vllm_dspark: %s", ignored)

        def load_weights(self, weights):
            loaded = super().load_weights((canonical_name(name), w) for name, w in weights)
            self._prepare_markov()
            return loaded

        def _prepare_markov(self) -> None:
            self._markov, self._decision = None, None
            V = self.logits_processor.org_vocab_size
            head = self.model.markov_head
            w1 = getattr(head.markov_w1, "weight", None)
            w2 = getattr(head.markov_w2, "weight", None)
            reason = None
            if self.draft_id_to_target_id is not None:
                reason = "the draft has a reduced vocabulary (d2t mapping)"
            elif type(head.markov_w2.quant_method).__name__ not in _PLAIN_METHODS:
                reason = f"markov_w2 is quantized ({type(head.markov_w2.quant_method).__name__})"
            elif self.logits_processor.scale != 1.0 or self.logits_processor.soft_cap is not None:
                reason = "the draft's logits processor applies logit_scale/soft_cap to the Markov bias"
            elif hasattr(self, "apply_output_logit_transform"):
                reason = "the model defines apply_output_logit_transform"
            else:
                reason = why_not_weights(w1, w2, V)
            self._markov_reason = reason
            if reason is not None:
                return
            assert w1 is not None and w2 is not None  # why_not_weights checked both
            conf = self.model.confidence_head
            bias = getattr(conf.proj, "bias", None) if conf is not None else None
            self._markov = MarkovWeights.build(
                vocab=V, markov_w1=w1.data, markov_w2=w2.data,
                conf_weight=conf.proj.weight.data if conf is not None else None,
                conf_bias=bias.data if bias is not None else None, hidden_size=self.config.hidden_size,
                conf_with_markov=bool(conf is not None and conf.with_markov))

        def sample_sequential(self, speculator, num_reqs: int, head_hidden: torch.Tensor) -> bool:
            """vLLM 0.33 hook: run the Markov stage on the op (True) or leave it to upstream (False)."""
            if self._decision is None or self._decision[0] != id(speculator):
                reason = self._markov_reason
                if reason is None:
                    assert self._markov is not None  # built whenever _markov_reason is None
                    reason = why_not_speculator(speculator, self._markov.markov_w2.device)
                    if reason is None and speculator.use_confidence_head and not self._markov.has_confidence_head:
                        reason = "the speculator wants confidences but the draft has no confidence head"
                if reason is not None:
                    _log_once(reason)
                else:
                    logger.info("vllm_dspark: DSpark V2 Markov stage runs on the Markov draft op "
                                "(%s drafting)", "greedy" if speculator.draft_logits is None else "probabilistic")
                self._decision = (id(speculator), reason is None)
            if not self._decision[1]:
                return False
            assert self._markov is not None  # the op path is chosen only when the weights were built
            run_markov_stage(speculator, num_reqs, head_hidden, self._markov, self.compute_draft_logits)
            return True

    DSparkV2DraftModel.__module__ = __name__
    DSparkV2DraftModel.__qualname__ = "DSparkV2DraftModel"
    return DSparkV2DraftModel


_cls = None


def __getattr__(name: str):
    # The class subclasses vLLM 0.33's Qwen3DSparkForCausalLM, built on first
    # access (vLLM's registry resolves it with getattr), so the pure functions
    # above import anywhere.
    global _cls
    if name == "DSparkV2DraftModel":
        if _cls is None:
            try:
                require(series=V2_SERIES, what="DSparkV2DraftModel (the sample_sequential hook)")
            except Exception as exc:
                raise ImportError(str(exc)) from None
            _cls = _build_class()
        return _cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
