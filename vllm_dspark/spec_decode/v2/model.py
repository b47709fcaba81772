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
* a gated or rnn Markov head's projection (``markov_head.gate_proj`` /
  ``joint_proj``), which upstream's ``DSparkMarkovHead`` has no module for (its
  loader would refuse the names), taken off the checkpoint's tensors before
  upstream's loader sees them and built into :class:`MarkovWeights`;
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

A draft vocabulary (``d2t``, as upstream 0.33.0 handles it)
    Upstream's draft scores ``draft_vocab_size`` Vd ids (``compute_draft_logits``,
    ``markov_w2``), ``markov_w1`` keeps the target's rows (the previous token is
    a target id) and ``draft_id_to_target_id`` holds offsets: target id = draft
    id + d2t[draft id] (``map_draft_to_target``). Greedy: argmax in draft ids,
    then mapped. Probabilistic: the speculator scatters each position's draft
    logits into a target-vocabulary row that is -inf elsewhere (its
    ``_d2t_scatter_index`` = ``arange(Vd) + d2t``, ``_draft_scatter_buf``) and
    the Gumbel sampler caches that whole row in ``draft_logits[state, i]``. The
    acceptance estimator is fed the draft-vocabulary logits, before the
    scatter. The hook writes the same: target ids, the cache row in target ids
    with -inf outside the draft vocabulary, the estimator's features in draft
    ids. A ``d2t`` mapping two draft ids to one target id is declined (checked
    once at load): one cached logit can't hold their summed mass.

Gated and rnn heads
    Upstream applies a vanilla head only. The hook hands the op the head's
    arguments from the block's hidden rows (``head_hidden`` gathered at
    ``sample_indices``, ``heads.py``: ``op_args``), greedy and sampled rows
    alike. Since upstream's loop would draft such a head as vanilla, the hook
    never declines one: each reason below is a ``ValueError`` instead, at
    construction (top-k gathered drafting, ``check_v2_head``; a watermarker or a
    non-fp32 probabilistic cache, from the engine's config: ``why_not_config``),
    at load (``build_markov``), or at the hook's first call (``hook_reason``).

When the op declines (upstream's loop runs, reason logged once; vanilla heads)
    no compiled kernel; top-k gathered drafting (upstream does not even call
    the hook then); a ``d2t`` with two draft ids on one target id; quantized or
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

Checked by ``tests/spec_decode/test_model_v2.py`` and
``tests/spec_decode/test_model_v2_families.py`` (draft vocabulary, gated and
rnn heads, refusals, loading with a stand-in model) on CPU (the pure functions
below, against ``markov_draft_reference`` and a restatement of upstream's
loop, with a fake speculator). Nothing here has run on a GPU or against a real
vLLM 0.33 install: see ``docs/vllm-0.33.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from vllm_dspark.model.markov_weights import MarkovWeights
from vllm_dspark.ops.markov_reference import d2t_target_ids
from vllm_dspark.spec_decode.common.drafts import DraftVocab, MarkovStage
from vllm_dspark.spec_decode.common.heads import PROJECTION_TENSORS, projection_args
from vllm_dspark.versions import V2_SERIES, require

logger = logging.getLogger("vllm_dspark")

__all__ = [  # noqa: F822 (DSparkV2DraftModel is built on first access, see __getattr__)
    "DSparkV2DraftModel",
    "MarkovWeights",
    "build_markov",
    "check_k3_worker",
    "derive_draft_seeds",
    "hook_reason",
    "refuse_hidden_head",
    "request_sampling_params",
    "run_markov_stage",
    "split_head_projection",
    "why_not_config",
    "why_not_speculator",
    "why_not_vocab_map",
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
def why_not_weights(markov_w1: Any, markov_w2: Any, vocab: int, target_vocab: int | None = None) -> str | None:
    """Whether the op can read these Markov weights as they are, or the reason it can't.

    ``vocab`` is the vocabulary the head scores (``markov_w2``'s rows); ``target_vocab``, with a
    draft vocabulary, the ids ``markov_w1`` is indexed by (target ids; ``vocab`` otherwise)."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    rows = {"markov_w1": target_vocab or vocab, "markov_w2": vocab}
    for name, w in (("markov_w1", markov_w1), ("markov_w2", markov_w2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            return f"{name} is not a plain [vocab, rank] tensor (quantized checkpoint?)"
        if w.dtype not in floats:
            return f"{name} has dtype {w.dtype} (quantized?); the op reads fp32/bf16/fp16"
        if w.shape[0] < rows[name]:
            return f"{name} has {w.shape[0]} rows, fewer than the vocabulary it is indexed by ({rows[name]})"
    if markov_w1.dtype != markov_w2.dtype:
        return f"markov_w1 ({markov_w1.dtype}) and markov_w2 ({markov_w2.dtype}) differ in dtype"
    if markov_w1.shape[1] != markov_w2.shape[1]:
        return f"markov ranks differ: {markov_w1.shape[1]} vs {markov_w2.shape[1]}"
    if markov_w1.device != markov_w2.device:
        return "markov_w1 and markov_w2 are on different devices"
    return None


def why_not_vocab_map(weights: MarkovWeights) -> str | None:
    """Load time only (reads ``d2t``'s values: a host sync): whether the op's outputs can stand for
    upstream's with this draft vocabulary. Upstream scatters the draft logits into the target
    vocabulary by ``index_copy_``, one logit per target id; two draft ids on one target id have no
    exact logit there (their summed mass depends on the temperature)."""
    if weights.d2t is None:
        return None
    tgt = d2t_target_ids(weights.d2t)
    if int(torch.unique(tgt).numel()) != int(tgt.numel()):
        return "d2t maps two draft ids to one target id"
    return None


def _cache_dtype_reason(dtype: torch.dtype) -> str | None:
    if dtype == torch.float32:
        return None
    return (f"probabilistic drafting caches the proposal in {dtype}; the op samples from fp32 "
            "logits, so verification would test a slightly different q (set the target's "
            "head_dtype to float32 to use the op)")


def _why_not_vocab_layout(speculator: Any, weights: MarkovWeights | None) -> str | None:
    """Whether the speculator's view of the draft vocabulary agrees with the weights' (shapes only)."""
    scatter = getattr(speculator, "_d2t_scatter_index", None)
    d2t = None if weights is None else weights.d2t
    if scatter is not None and (d2t is None or scatter.numel() != d2t.numel()):
        return "the speculator's draft-to-target map (_d2t_scatter_index) does not match the draft's d2t"
    cache = getattr(speculator, "draft_logits", None)
    if weights is not None and d2t is not None and cache is not None and cache.shape[-1] < weights.target_vocab:
        return (f"the draft-logits cache has {cache.shape[-1]} columns, fewer than the target vocabulary "
                f"{weights.target_vocab} the draft ids map into")
    return None


def why_not_speculator(speculator: Any, device: torch.device, weights: MarkovWeights | None = None) -> str | None:
    """Static reasons (no tensor values read) the op can't serve this speculator's calls."""
    from vllm_dspark.ops import is_compiled_available

    if getattr(speculator, "_draft_topk", None) is not None:
        return "dspark_draft_topk (top-k gathered drafting) is set"
    reason = _why_not_vocab_layout(speculator, weights)
    if reason is not None:
        return reason
    if getattr(speculator, "draft_watermarker", None) is not None:
        return "a draft watermarker is configured"
    cache = getattr(speculator, "draft_logits", None)
    reason = None if cache is None else _cache_dtype_reason(cache.dtype)
    if reason is not None:
        return reason
    if not is_compiled_available(device.type):
        return f"no compiled markov_draft kernel for {device.type!r}"
    return None


def why_not_config(vllm_config: Any) -> str | None:
    """The speculator-side reasons the engine's config already tells, before the speculator exists
    (read as vLLM 0.33's ``DraftModelSpeculator.__init__`` reads them)."""
    if getattr(vllm_config, "watermark_config", None) is not None:
        return "a draft watermarker is configured (watermark_config)"
    spec = getattr(vllm_config, "speculative_config", None)
    if getattr(spec, "draft_sample_method", None) == "probabilistic":
        model_config = getattr(vllm_config, "model_config", None)
        return _cache_dtype_reason(getattr(model_config, "head_dtype", torch.float32))
    return None


def refuse_hidden_head(head_type: str, reason: str | None) -> None:
    """A gated or rnn head has no fallback on V2: where the op can't serve it, raise (naming why).

    Upstream's loop, which runs when the hook declines, applies a vanilla head: declining would
    draft such a drafter with the wrong bias, silently. A vanilla head just declines."""
    if reason is None or head_type == "vanilla":
        return
    raise ValueError(f"vllm_dspark: markov_head_type {head_type!r}: the Markov draft op can't serve this drafter on "
                     f"vLLM 0.33's V2 path ({reason}), and upstream's DSpark loop, which would run instead, "
                     f"applies a vanilla head, not a {head_type} one; remove the cause, or serve this drafter "
                     "with vLLM 0.32's V1 runner")


def hook_reason(weights: MarkovWeights | None, load_reason: str | None, speculator: Any) -> str | None:
    """Why the hook leaves this speculator's calls to upstream's loop (None: the op runs them).

    Decided once per speculator from shapes and flags only (its answer must not depend on tensor
    values: CUDA-graph replays run what capture recorded). Raises for a gated or rnn head."""
    if load_reason is not None:
        return load_reason
    assert weights is not None  # built whenever the load found no reason
    reason = why_not_speculator(speculator, weights.markov_w2.device, weights)
    if reason is None and getattr(speculator, "use_confidence_head", False) and not weights.has_confidence_head:
        reason = "the speculator wants confidences but the draft has no confidence head"
    refuse_hidden_head(weights.head_type, reason)
    return reason


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


def _write_target_logits_cache(cache: torch.Tensor, state: torch.Tensor, logits: torch.Tensor,
                               target_ids: torch.Tensor) -> None:
    """A draft vocabulary's logits [R, N, Vd] into the target-vocabulary cache: ``cache[state[r], i]``
    gets row r's logit of draft id j at column ``target_ids[j]`` and -inf at every other column
    (q is zero outside the draft vocabulary), the whole row, as upstream's reduced-vocabulary
    scatter writes it. Position by position through one [R, width] scratch (-inf once; each
    ``index_copy_`` rewrites the same draft columns), so the extra memory is upstream's own
    ``_draft_scatter_buf``'s, not [R, N, width]."""
    buf = torch.full((logits.shape[0], cache.shape[-1]), float("-inf"), dtype=cache.dtype, device=cache.device)
    for i in range(logits.shape[1]):
        buf.index_copy_(1, target_ids, logits[:, i].to(cache.dtype))
        _write_logits_cache(cache[:, i:i + 1], state, buf.unsqueeze(1))


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
    compute_draft_logits : [rows, H] -> [rows, V] base logits (the LM head; Vd columns with a draft vocabulary)
    op : ``torch.ops.vllm_dspark.markov_draft`` (default) or a stand-in with its schema

    Writes ``draft_tokens[:num_reqs]`` [R, N] int64 (target ids), the confidences
    (``use_confidence_head``), the draft-logits cache (target vocabulary; -inf outside a
    draft vocabulary) and the acceptance estimator's features (draft-vocabulary logits); see
    the module docstring. A gated or rnn head gets the block's hidden rows. No host sync; the
    op's outputs go straight into the speculator's persistent buffers.
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

    hidden = sample_hidden.view(num_reqs, n, -1) if stage.head.needs_hidden else None  # [R, N, H]
    stage.draft_into(base, anchors, conf_base, temperature, seeds, out_tokens, out_conf, out_logits,
                     hidden=hidden, op=op)

    if out_logits is not None:
        idx_map = speculator.sample_idx_mapping[:num_sample].view(num_reqs, n)
        if estimator is not None:
            # Upstream's estimator reads the draft-vocabulary logits, before any scatter.
            for i in range(n):
                speculator._maybe_predict_acceptance(out_logits[:, i], idx_map[:, i], speculator._step_cols[i])
        if cache is not None and isinstance(stage.vocab, DraftVocab):
            _write_target_logits_cache(cache, idx_map[:, 0], out_logits, stage.vocab.target_ids)
        elif cache is not None:
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


# ---------------------------------------------------------------------------- loading
def split_head_projection(weights: Iterable[tuple[str, torch.Tensor]], sink: dict[str, torch.Tensor]):
    """The checkpoint's tensors under their canonical names, less a gated or rnn head's projection
    (``markov_head.gate_proj`` / ``joint_proj``), which goes to ``sink``: upstream's head has no
    such module, so its loader would refuse the name."""
    from vllm_dspark.checkpoint.io import canonical_name

    for name, w in weights:
        c = canonical_name(name)
        if c in PROJECTION_TENSORS:
            sink[c] = w
            continue
        yield c, w


def head_type_of(hf_config: Any) -> str:
    return str(getattr(hf_config, "markov_head_type", None) or "vanilla")


def _target_vocab(model: Any) -> int:
    """The ids ``markov_w1`` is indexed by with a draft vocabulary: the target's vocabulary."""
    return int(getattr(model, "target_vocab_size", None) or model.config.vocab_size)


def _why_not_model(model: Any) -> str | None:
    """Load-time reasons, from the built model, the op can't stand for upstream's Markov steps."""
    head = model.model.markov_head
    lp = model.logits_processor
    method = type(head.markov_w2.quant_method).__name__
    if method not in _PLAIN_METHODS:
        return f"markov_w2 is quantized ({method})"
    if lp.scale != 1.0 or lp.soft_cap is not None:
        return "the draft's logits processor applies logit_scale/soft_cap to the Markov bias"
    if hasattr(model, "apply_output_logit_transform"):
        return "the model defines apply_output_logit_transform"
    d2t = getattr(model, "draft_id_to_target_id", None)
    return why_not_weights(getattr(head.markov_w1, "weight", None), getattr(head.markov_w2, "weight", None),
                           lp.org_vocab_size, None if d2t is None else _target_vocab(model))


def _markov_weights(model: Any, head_proj: dict[str, torch.Tensor]) -> MarkovWeights:
    head, conf = model.model.markov_head, model.model.confidence_head
    w1 = head.markov_w1.weight.data
    d2t = getattr(model, "draft_id_to_target_id", None)
    bias = getattr(conf.proj, "bias", None) if conf is not None else None
    return MarkovWeights.build(
        vocab=model.logits_processor.org_vocab_size if d2t is None else _target_vocab(model),
        markov_w1=w1, markov_w2=head.markov_w2.weight.data,
        d2t=None if d2t is None else d2t.data.to(torch.int64),
        conf_weight=conf.proj.weight.data if conf is not None else None,
        conf_bias=bias.data if bias is not None else None, hidden_size=model.config.hidden_size,
        conf_with_markov=bool(conf is not None and conf.with_markov),
        **projection_args(head_type_of(model.config), head_proj, w1.device))


def build_markov(model: Any, head_proj: dict[str, torch.Tensor]) -> tuple[MarkovWeights | None, str | None]:
    """After loading: the draft's :class:`MarkovWeights` and None, or None and the reason the op
    can't serve it (upstream's loop then runs). Raises for a gated or rnn head the op can't serve,
    and for a head projection the config's head type does not have.

    ``model`` is upstream's ``Qwen3DSparkForCausalLM`` as loaded (or an object with its attributes);
    ``head_proj`` the projection tensors :func:`split_head_projection` took off the checkpoint."""
    from vllm_dspark.ops import is_compiled_available

    head_type = head_type_of(model.config)
    if head_type == "vanilla" and head_proj:
        raise ValueError(f"vllm_dspark: the checkpoint holds {', '.join(sorted(head_proj))} but markov_head_type is "
                         "'vanilla'; check markov_head_type against how the drafter was trained")
    reason = _why_not_model(model)
    weights = _markov_weights(model, head_proj) if reason is None else None
    if weights is not None:
        device = weights.markov_w2.device.type
        reason = why_not_vocab_map(weights) or (
            None if is_compiled_available(device) else f"no compiled markov_draft kernel for {device!r}")
    refuse_hidden_head(head_type, reason)
    return (weights, None) if reason is None else (None, reason)


# ---------------------------------------------------------------------------- the vLLM class
def _build_class():
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    from vllm_dspark.serving.settings import ATTR, not_applied_on_v2, settings_of
    from vllm_dspark.spec_decode.common.draft_keys import check_v2_head, expose_dspark_keys

    class DSparkV2DraftModel(Qwen3DSparkForCausalLM):
        """Upstream's Qwen3 DSpark draft whose sequential stage runs on the Markov draft op."""

        def __init__(self, *, vllm_config, prefix: str = ""):
            hf_config = vllm_config.speculative_config.draft_model_config.hf_config
            expose_dspark_keys(hf_config, allow_no_markov=False)
            check_v2_head(hf_config)
            refuse_hidden_head(head_type_of(hf_config), why_not_config(vllm_config))
            check_k3_worker(vllm_config)
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self._markov: MarkovWeights | None = None
            self._markov_reason: str | None = "weights not loaded yet"
            self._decision: tuple[int, bool] | None = None
            raw = getattr(hf_config, ATTR, None)
            ignored = not_applied_on_v2(copy=None if raw is None else settings_of(hf_config).copy)
            if ignored:
                logger.warning("vllm_dspark: %s", ignored)

        def load_weights(self, weights):
            head_proj: dict[str, torch.Tensor] = {}
            loaded = super().load_weights(split_head_projection(weights, head_proj))
            self._prepare_markov(head_proj)
            return loaded

        def _prepare_markov(self, head_proj: dict[str, torch.Tensor] | None = None) -> None:
            self._decision = None
            self._markov, self._markov_reason = build_markov(self, head_proj or {})

        def sample_sequential(self, speculator, num_reqs: int, head_hidden: torch.Tensor) -> bool:
            """vLLM 0.33 hook: run the Markov stage on the op (True) or leave it to upstream (False)."""
            if self._decision is None or self._decision[0] != id(speculator):
                reason = hook_reason(self._markov, self._markov_reason, speculator)
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
