"""The DSpark draft model for vLLM's V1 runner (registered as ``DFlashDSparkDraftModel``).

On V1 a DSpark draft takes the DFlash path, where vLLM names the draft
architecture ``"DFlash" + <architecture>``; the plugin registers this class
under that name. It is upstream's Qwen3 DSpark draft (DFlash Qwen3 backbone
with Markov and confidence heads) plus what the V1 proposer needs:

* :attr:`markov` — the sequential stage's weights as one
  :class:`~vllm_dspark.model.markov_weights.MarkovWeights` (trimmed to the real
  vocabulary, confidence head split into its parallel and Markov parts);
* drafters without a Markov head (the DFlash-style ablation) load: the head
  upstream always builds is left unused and the op adds no bias;
* exact rotary angles at every position. vLLM builds the draft's cos/sin table
  with ``max_position_embeddings`` rows (the trained context) and indexes it
  with positions up to the target's ``max_model_len`` without a bounds check;
  here the cos/sin rows of just the positions in the batch are computed in fp64
  (``rope_cos_sin``), so the drafter reads nothing out of range and stays exact
  to fp32 rounding at position 1,048,575;
* vLLM 0.32's CPU ``rms_norm`` ignores the per-layer weight rows of the
  context keys' grouped norm; when a probe sees that, keys are normalised per
  layer in PyTorch (otherwise every layer after the first reads wrongly
  normalised keys: no error, lower acceptance);
* older exports' ``logit_head.`` tensor names load;
* a gated or rnn Markov head's projection (``markov_head.gate_proj`` /
  ``joint_proj``), which upstream's head does not have, goes straight to
  :class:`MarkovWeights`; the stage drafts such heads' greedy rows on the op
  with their arguments (``spec_decode/common/heads.py``: ``op_args``);
* a serve-time draft vocabulary (the ``draft_vocab`` setting): the Markov
  weights get the N most frequent tokens' ``markov_w2`` rows and their ``d2t``,
  and :meth:`DSparkV1DraftModel.draft_logits` scores those N rows of the LM head
  only (one sliced copy of its weight, made once);
* every family's tensors (DeepSpec's and speculators' checkpoints come here
  presented as SpecForge exports: ``patch/config_speculative.py``). Names map
  through :func:`loader_name`. A checkpoint's own draft vocabulary (``lm_head``
  [Vd, H], ``d2t`` offsets) loads into upstream's reduced-vocabulary head and
  map, and :class:`MarkovWeights` gets that ``d2t``: the stage drafts in draft
  ids and hands target ids and target-vocabulary q on. A full-vocabulary
  ``embed_tokens`` / ``lm_head`` copy is loaded, and the DFlash proposer's
  ``load_model`` compares it with the target's (``torch.equal``): equal, it is
  dropped and the target's shared; different, it is the drafter's own and
  used. :func:`vocab_tensor_notes` says which happened, in one log line when
  the Markov stage is built.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import types
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

from vllm_dspark.checkpoint.io import canonical_name
from vllm_dspark.checkpoint.token_frequency import draft_vocab_ids, load_frequency_table
from vllm_dspark.model.markov_weights import MarkovWeights
from vllm_dspark.model.rope import rope_cos_sin, rope_inv_freq_and_scale
from vllm_dspark.ops.markov_reference import d2t_of_target_ids
from vllm_dspark.serving.settings import DSparkSettingsError, settings_of
from vllm_dspark.spec_decode.common.draft_keys import expose_dspark_keys
from vllm_dspark.spec_decode.common.heads import PROJECTION_TENSORS, projection_args

logger = logging.getLogger("vllm_dspark")

@functools.lru_cache(maxsize=1)
def _grouped_rms_norm_broken() -> str | None:
    """Why vLLM's grouped RMSNorm (one weight row per draft layer) can't be used here, or None."""
    from vllm import _custom_ops as ops

    x = torch.linspace(-1.0, 1.0, 2 * 64).view(2, 1, 1, 64)
    w = torch.stack([torch.ones(64), torch.full((64,), 2.0)])
    out = torch.empty_like(x)
    try:
        ops.rms_norm(out, x, w, 1e-6)
    except Exception as exc:  # pragma: no cover - depends on the platform's kernels
        return f"vllm ops.rms_norm rejects a per-layer weight ({exc})"
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[:, None, None, :]
    if not torch.allclose(out, want, atol=1e-4):
        return "vLLM's rms_norm on this platform ignores the per-layer weight rows of the draft's key norms"
    return None


def _normalize_context_k_per_layer(self, all_k: torch.Tensor) -> torch.Tensor:
    """Per-layer RMSNorm of context keys [L, num_ctx, kv_heads, head_dim] with weights [L, head_dim]."""
    xf = all_k.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self._rms_norm_eps)
    return (xf * self._k_norm_weights.float()[:, None, None, :]).to(all_k.dtype)


class ExactRotary(torch.nn.Module):
    """Drop-in for a draft layer's ``rotary_emb``: cos/sin of the batch's positions, in fp64.

    Calls vLLM's own rotary kernel with a per-call table of just the rows it
    needs (``positions`` become indices into it), so the rotation itself is
    upstream's.
    """

    inv_freq64: torch.Tensor  # a buffer (register_buffer in __init__)

    def __init__(self, original: torch.nn.Module, inv_freq64: torch.Tensor, mscale: float):
        super().__init__()
        self.head_size = original.head_size
        self.rotary_dim = getattr(original, "rotary_dim", original.head_size)
        self.is_neox_style = original.is_neox_style
        # Upstream's fused context-KV setup reads it once; every call replaces it with exact rows.
        self.cos_sin_cache = original.cos_sin_cache
        self.register_buffer("inv_freq64", inv_freq64, persistent=False)
        self.mscale = mscale

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-call cos/sin table [N, rot_dim], indices [N]) for ``positions`` [N]."""
        flat = positions.reshape(-1)
        cache = rope_cos_sin(flat, self.inv_freq64, self.mscale, dtype)
        idx = torch.arange(flat.numel(), device=flat.device, dtype=positions.dtype)
        return cache, idx

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        from vllm import _custom_ops as ops

        cache, idx = self.table(positions, query.dtype)
        ops.rotary_embedding(idx, query, key, self.head_size, cache, self.is_neox_style)
        return query, key


class DSparkV1DraftModel(Qwen3DSparkForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        hf_config = vllm_config.speculative_config.draft_model_config.hf_config
        expose_dspark_keys(hf_config, allow_no_markov=True)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.markov: MarkovWeights | None = None
        # A serve-time draft vocabulary: its target ids [N] ascending (None: the whole vocabulary), the
        # target's end-of-sequence ids it always holds, and the LM head rows it scores (made once).
        self.draft_ids: torch.Tensor | None = None
        self._end_ids = target_end_ids(vllm_config.model_config)
        # (the source weight's address, [N, H] rows, their GEMM): made again if the head's weight moves
        self._head_rows: tuple[int, torch.Tensor, Callable] | None = None
        self._install_exact_rotary(hf_config)
        reason = _grouped_rms_norm_broken()
        if reason is not None:
            # Expected on vLLM's CPU backend: a workaround the user cannot act on, so not a warning.
            logger.info("vllm_dspark: %s; normalising the context keys of each draft layer in PyTorch", reason)
            self.model._normalize_context_k = types.MethodType(_normalize_context_k_per_layer, self.model)

    def _install_exact_rotary(self, hf_config) -> None:
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        theta = float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        attn0 = self.model.layers[0].self_attn
        rot_dim = attn0.rotary_emb.rotary_dim if hasattr(attn0.rotary_emb, "rotary_dim") else attn0.head_dim
        inv_freq64, mscale = rope_inv_freq_and_scale(rot_dim, theta, scaling, torch.float64)
        self.exact_rotary = ExactRotary(attn0.rotary_emb, inv_freq64, mscale)
        for layer in self.model.layers:
            layer.self_attn.rotary_emb = self.exact_rotary

    def precompute_and_store_context_kv(self, context_states, context_positions, context_slot_mapping=None):
        """Upstream's context-KV precompute with the batch's own exact cos/sin rows.

        Upstream reads ``cos_sin_cache[positions]`` from a table of the trained
        context's length; here the table is built for the positions at hand and
        the positions become indices into it.
        """
        m = self.model
        if not hasattr(m, "_num_attn_layers"):
            m._build_fused_kv_buffers()
        cache, idx = self.exact_rotary.table(context_positions, context_states.dtype)
        m._rope_cos_sin_cache = cache
        m.precompute_and_store_context_kv(context_states, idx, context_slot_mapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        names_seen: set[str] = set()
        head_proj: dict[str, torch.Tensor] = {}  # a gated / rnn head's projection: upstream's head has none

        def canon():
            for name, w in weights:
                c = loader_name(name)
                if c is None:
                    continue
                names_seen.add(c)
                if c in PROJECTION_TENSORS:
                    head_proj[c] = w
                    continue
                yield c, w

        loaded = super().load_weights(canon())
        # The modules that took the checkpoint's embedding / LM head (weak: a copy the proposer drops is freed).
        self._vocab_copies = {name: weakref.ref(module) for name, module in self._vocab_modules().items()
                              if f"{name}.weight" in names_seen}
        self._vocab_noted = False
        no_markov = bool(getattr(self.config, "dspark_no_markov_head", False))
        head, conf = self.model.markov_head, self.model.confidence_head
        w2 = None if no_markov else head.markov_w2.weight.data
        d2t = None
        own_map = getattr(self, "draft_id_to_target_id", None)
        if own_map is not None:
            # The checkpoint's draft vocabulary: its lm_head and markov_w2 have Vd rows; d2t [Vd] offsets.
            d2t = own_map.data.to(torch.int64)
        self.draft_ids = self._choose_draft_vocab()
        if self.draft_ids is not None:
            ids = self.draft_ids
            d2t = d2t_of_target_ids(ids)
            if w2 is not None:
                w2 = w2[ids.to(w2.device)]
        # Raw tensors: vLLM's CPU backend may repack linear weights and leave .weight empty.
        self.markov = MarkovWeights.build(
            vocab=self.vocab_size,
            markov_w1=None if no_markov else head.markov_w1.weight.data,
            markov_w2=w2, d2t=d2t,
            conf_weight=conf.proj.weight.data if conf is not None else None,
            conf_bias=conf.proj.bias.data if conf is not None and conf.proj.bias is not None else None,
            hidden_size=self.config.hidden_size,
            conf_with_markov=bool(conf is not None and conf.with_markov),
            device=self.lm_head.weight.device if hasattr(self.lm_head, "weight") else None,
            **self._head_projection(head_proj, no_markov, head.markov_w1.weight.device))
        return loaded

    def _vocab_modules(self) -> dict[str, torch.nn.Module]:
        """The modules holding the embedding and the LM head now (the proposer may swap in the target's)."""
        return {"embed_tokens": self.model.embed_tokens, "lm_head": self.lm_head}

    def _head_projection(self, tensors: dict[str, torch.Tensor], no_markov: bool, device) -> dict:
        """``MarkovWeights.build``'s head arguments: the type from the config and every projection tensor
        loaded (``heads.projection_args``, as V2's loader: ``build`` refuses a missing, stray or misshapen
        one by name)."""
        if no_markov:
            return {}
        return projection_args(str(getattr(self.config, "markov_head_type", None) or "vanilla"), tensors, device)

    # ------------------------------------------------------------------ the serve-time draft vocabulary
    def _choose_draft_vocab(self) -> torch.Tensor | None:
        """[N] int64 target ids, ascending, when the ``draft_vocab`` setting is on; else None."""
        try:
            s = settings_of(self.config)
        except DSparkSettingsError:
            return None  # built outside the config patch (a test's stand-in): the whole vocabulary
        if s.draft_vocab is None:
            return None
        lp = self.logits_processor
        soft_capped = lp.soft_cap is not None or getattr(lp, "logits_as_input", False)
        if s.draft_vocab_auto and (soft_capped or getattr(self.lm_head, "tp_size", 1) > 1):
            logger.info("vllm_dspark: draft_vocab auto: off (this drafter's LM head is soft-capped or split "
                        "across tensor-parallel ranks, which the sliced head does not reproduce)")
            return None
        if soft_capped:
            raise DSparkSettingsError(
                f"draft_vocab {s.draft_vocab}: this drafter's logits are soft-capped (or taken as input), which "
                "the draft vocabulary's sliced LM head does not reproduce; set draft_vocab to 'off'")
        table = load_frequency_table(str(s.draft_vocab_table))
        if table.vocab_size != self.vocab_size:
            raise DSparkSettingsError(
                f"draft_vocab_table: {s.draft_vocab_table} counts {table.vocab_size} tokens, the target has "
                f"{self.vocab_size}; rebuild it with the target's tokenizer")
        ids = draft_vocab_ids(table, s.draft_vocab, required=self._end_ids)
        logger.info("vllm_dspark: draft vocabulary: %d of %d tokens (covering %.1f%% of the table's tokens)",
                    len(ids), self.vocab_size, 100.0 * table.coverage(ids))
        return torch.tensor(ids, dtype=torch.int64)

    def draft_logits(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The base logits the Markov stage drafts from: :meth:`compute_logits` over the whole vocabulary;
        with the checkpoint's own draft vocabulary, its LM head's [T, Vd] logits in draft ids
        (``compute_draft_logits``); with a serve-time draft vocabulary, ``hidden @ W[ids].T`` (times the
        logits processor's scale) over its N rows in draft ids, from one sliced copy of the LM head's
        weight (the target's, once shared)."""
        if not getattr(self, "_vocab_noted", True):
            self._vocab_noted = True
            logger.info("vllm_dspark: %s", "; ".join(vocab_tensor_notes(self)))
        if self.draft_ids is None:
            if getattr(self, "draft_id_to_target_id", None) is not None:
                # The checkpoint's own draft vocabulary: compute_logits would scatter the head's [T, Vd]
                # logits to target ids (-inf elsewhere); the stage drafts in draft ids and maps them itself.
                return self.compute_draft_logits
            return self.compute_logits
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        head, lp = self.lm_head, self.logits_processor
        if getattr(head, "tp_size", 1) > 1 or not isinstance(head.quant_method, UnquantizedEmbeddingMethod):
            raise DSparkSettingsError(
                "draft_vocab: the LM head is split across tensor-parallel ranks or quantized, and the draft "
                "vocabulary slices a plain one; set draft_vocab to 'off'")
        weight = head.weight.data
        if self._head_rows is None or self._head_rows[0] != weight.data_ptr():
            dtype = getattr(lp, "head_dtype", None) or weight.dtype
            rows = weight[self.draft_ids.to(weight.device)].to(dtype).contiguous()  # [N, H]
            self._head_rows = (weight.data_ptr(), rows, row_linear(rows))
        rows, linear = self._head_rows[1], self._head_rows[2]
        scale = float(lp.scale)

        def logits(hidden: torch.Tensor) -> torch.Tensor:
            out = linear(hidden.to(rows.dtype))  # [T, N]
            return out * scale if scale != 1.0 else out

        return logits


def row_linear(rows: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``hidden -> hidden @ rows.T`` through the GEMM vLLM's own linear layers take on this platform: on
    its CPU backend a oneDNN handle made once (vLLM's ``dispatch_cpu_unquantized_gemm``), 3-4x faster
    than ``torch.nn.functional.linear`` at a draft step's shapes (7 rows x 576 x 8,192: 2.2 ms against
    7.2 on the 2-core EPYC); elsewhere ``linear`` itself."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or rows.device.type != "cpu":
        return lambda hidden: torch.nn.functional.linear(hidden, rows)
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(rows, requires_grad=False)
    dispatch_cpu_unquantized_gemm(holder, remove_weight=False)
    gemm: Callable[..., torch.Tensor] = getattr(holder, "cpu_linear")  # noqa: B009 (set by the dispatch)
    return lambda hidden: gemm(hidden, rows, None)


def loader_name(name: str) -> str | None:
    """The name a checkpoint tensor of any family is loaded under (upstream's loader adds ``model.``), or None.

    SpecForge's, DeepSpec's and speculators' names, with or without a ``model.`` prefix, and older
    exports' ``logit_head.`` ones, map to one canonical set (:func:`canonical_name`); ``t2d`` (which
    target ids the draft vocabulary holds: training only, ``d2t`` says the same) is not loaded.
    """
    c = canonical_name(name)
    return None if c == "t2d" else c


def vocab_tensor_notes(model) -> list[str]:
    """What became of the checkpoint's ``embed_tokens`` and ``lm_head``, one phrase each, once the
    proposer has loaded the model (it drops a full-vocabulary copy equal to the target's, by
    ``torch.equal``, and shares the target's; a copy that differs is kept).

    ``model`` holds ``_vocab_copies`` (name -> weak reference to the module the checkpoint's tensor
    was loaded into), ``_vocab_modules()`` (the modules in use now) and ``vocab_size`` (the target's).
    """
    copies = getattr(model, "_vocab_copies", {}) or {}
    out = []
    for name, module in model._vocab_modules().items():
        ref = copies.get(name)
        if ref is None:
            out.append(f"{name}: not in the checkpoint, the target's is shared")
            continue
        if ref() is not module:
            out.append(f"{name}: the checkpoint's copy equals the target's (compared at load), dropped; the "
                       "target's is shared")
            continue
        weight = getattr(module, "weight", None)
        rows = int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
        draft_vocab = getattr(getattr(model, "config", None), "draft_vocab_size", None)
        if name == "lm_head" and draft_vocab and draft_vocab < model.vocab_size:
            out.append(f"lm_head: the drafter's own over its draft vocabulary ({draft_vocab} of "
                       f"{model.vocab_size} tokens), used")
        else:
            shape = f" [{rows} rows]" if rows is not None else ""
            out.append(f"{name}: the checkpoint's{shape} differs from the target's, so it is the drafter's own "
                       "and is used")
    return out


def target_end_ids(model_config) -> list[int]:
    """The target's end-of-sequence / end-of-turn ids: its config's ``eos_token_id`` and those of its
    ``generation_config.json`` (a draft vocabulary always holds them)."""
    found: list = []
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    found.append(getattr(hf, "eos_token_id", None))
    path = Path(str(getattr(model_config, "model", ""))) / "generation_config.json"
    with contextlib.suppress(OSError, ValueError, AttributeError):
        found.append(json.loads(path.read_text()).get("eos_token_id"))
    out: list[int] = []
    for v in found:
        for i in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(i, int) and not isinstance(i, bool) and i >= 0 and i not in out:
                out.append(i)
    return out
