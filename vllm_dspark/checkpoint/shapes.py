"""Every tensor a DSpark drafter's checkpoint holds, by canonical name, derived from its config alone.

One table serves the validator (``io.validate_checkpoint``), the parameter count
(``inspect``) and the memory plan (``plan``), for every backbone and head:

* Qwen3 GQA layers (SpecForge, DeepSpec, speculators): FACTS.md's tensor list;
  for a vanilla full-vocabulary drafter exactly the parameters of the reference
  model (``vllm_dspark.model.reference``; a test holds the two equal);
* Gemma4 layers (DeepSpec's ``Gemma4DSparkModel``): four norms per layer, no
  ``v_proj`` when keys and values share ``k_proj`` (``attention_k_eq_v``),
  global-attention head width, a persistent ``layer_scalar`` buffer;
* MLA layers (``K3DSparkModel``): ``q_a_proj`` / ``q_b_proj``,
  ``kv_a_proj_with_mqa`` / ``kv_b_proj`` and their norms, ``context_proj`` /
  ``context_norm`` / ``final_norm`` in place of ``fc`` / ``hidden_norm`` / ``norm``;
* the Markov head: ``markov_w1`` [V, r] (it embeds the previous token, a TARGET
  id) and ``markov_w2`` [Vd, r]; gated adds ``gate_proj`` [r, H + r] + [r], rnn
  adds ``joint_proj`` [3r, 2r + H] + [3r];
* a draft vocabulary: the drafter's own ``lm_head`` [Vd, H], ``d2t`` int64 [Vd]
  (offsets: target id = draft id + d2t[draft id]), optionally ``t2d`` bool [V];
* full-vocabulary copies of the target's ``embed_tokens`` / ``lm_head``
  (DeepSpec and speculators save them): optional, not the drafter's parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_dspark.config import DSparkConfig


@dataclass(frozen=True)
class TensorSpec:
    """What one checkpoint tensor must look like."""

    shape: tuple[int, ...]
    dtype: str | None = None  # None: a float tensor in the checkpoint's dtype; else exactly this dtype
    required: bool = True
    parameter: bool = True  # counts as one of the drafter's own parameters
    what: str = ""  # what the tensor is, for messages


def _linear(out: int, inp: int, bias: bool, what: str = "") -> dict[str, TensorSpec]:
    specs = {"weight": TensorSpec((out, inp), what=what)}
    if bias:
        specs["bias"] = TensorSpec((out,), what=what)
    return specs


def _add(table: dict[str, TensorSpec], prefix: str, specs: dict[str, TensorSpec]) -> None:
    for name, spec in specs.items():
        table[f"{prefix}.{name}"] = spec


def _mlp(table: dict[str, TensorSpec], prefix: str, hidden: int, inter: int) -> None:
    _add(table, f"{prefix}.mlp.gate_proj", _linear(inter, hidden, False))
    _add(table, f"{prefix}.mlp.up_proj", _linear(inter, hidden, False))
    _add(table, f"{prefix}.mlp.down_proj", _linear(hidden, inter, False))


def _qwen3_layer(cfg: DSparkConfig, i: int) -> dict[str, TensorSpec]:
    h, hd, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    p, t = f"layers.{i}", {}
    t[f"{p}.input_layernorm.weight"] = TensorSpec((h,))
    for name, out, inp in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
        _add(t, f"{p}.self_attn.{name}", _linear(out, inp, b))
    t[f"{p}.self_attn.q_norm.weight"] = TensorSpec((hd,))
    t[f"{p}.self_attn.k_norm.weight"] = TensorSpec((hd,))
    t[f"{p}.post_attention_layernorm.weight"] = TensorSpec((h,))
    _mlp(t, p, h, cfg.intermediate_size)
    return t


def _gemma4_layer(cfg: DSparkConfig, i: int) -> dict[str, TensorSpec]:
    assert cfg.gemma4 is not None
    h, hd, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    p, t = f"layers.{i}", {}  # type: tuple[str, dict[str, TensorSpec]]
    projections = [("q_proj", q, h), ("k_proj", kv, h), ("o_proj", h, q)]
    if not cfg.gemma4.shared_kv_projection:
        projections.insert(2, ("v_proj", kv, h))
    for name, out, inp in projections:
        _add(t, f"{p}.self_attn.{name}", _linear(out, inp, b))
    t[f"{p}.self_attn.q_norm.weight"] = TensorSpec((hd,))
    t[f"{p}.self_attn.k_norm.weight"] = TensorSpec((hd,))  # v_norm has no scale: no tensor
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        t[f"{p}.{norm}.weight"] = TensorSpec((h,))
    wide = 2 if i in cfg.gemma4.double_wide_mlp_layers else 1
    _mlp(t, p, h, cfg.intermediate_size * wide)
    # A persistent buffer (register_buffer), saved with the weights but not a parameter.
    t[f"{p}.layer_scalar"] = TensorSpec((1,), required=False, parameter=False, what="Gemma4's layer scale")
    return t


def _mla_layer(cfg: DSparkConfig, i: int) -> dict[str, TensorSpec]:
    m = cfg.mla
    assert m is not None
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    p, t = f"layers.{i}", {}
    a = f"{p}.self_attn"
    t[f"{p}.input_layernorm.weight"] = TensorSpec((h,))
    if m.q_lora_rank is None:
        t[f"{a}.q_proj.weight"] = TensorSpec((heads * qk, h))
    else:
        t[f"{a}.q_a_proj.weight"] = TensorSpec((m.q_lora_rank, h))
        t[f"{a}.q_a_layernorm.weight"] = TensorSpec((m.q_lora_rank,))
        t[f"{a}.q_b_proj.weight"] = TensorSpec((heads * qk, m.q_lora_rank))
    # The latent the cache stores (kv_lora_rank) and the shared rotary key (qk_rope_head_dim), in one projection.
    t[f"{a}.kv_a_proj_with_mqa.weight"] = TensorSpec((m.kv_lora_rank + m.qk_rope_head_dim, h))
    t[f"{a}.kv_a_layernorm.weight"] = TensorSpec((m.kv_lora_rank,))
    t[f"{a}.kv_b_proj.weight"] = TensorSpec((heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))
    t[f"{a}.o_proj.weight"] = TensorSpec((h, heads * m.v_head_dim))
    if m.output_gate:
        t[f"{a}.g_proj.weight"] = TensorSpec((heads * m.v_head_dim, h))
    t[f"{p}.post_attention_layernorm.weight"] = TensorSpec((h,))
    _mlp(t, p, h, cfg.intermediate_size)
    return t


_LAYERS = {"qwen3": _qwen3_layer, "gemma4": _gemma4_layer, "mla": _mla_layer}


def _context(cfg: DSparkConfig) -> dict[str, TensorSpec]:
    """The projection of the concatenated target hidden states, and its norm."""
    h = cfg.hidden_size
    proj, norm = ("context_proj", "context_norm") if cfg.backbone == "mla" else ("fc", "hidden_norm")
    return {f"{proj}.weight": TensorSpec((h, cfg.aux_hidden_size), what="the target-feature projection"),
            f"{norm}.weight": TensorSpec((h,))}


def markov_tensors(cfg: DSparkConfig) -> dict[str, TensorSpec]:
    """The Markov head's tensors: W1 over target ids, W2 over the drafted vocabulary, the head type's extra."""
    if not cfg.has_markov_head:
        return {}
    r, h, vd = cfg.markov_rank, cfg.hidden_size, cfg.drafted_vocab_size
    t = {"markov_head.markov_w1.weight": TensorSpec((cfg.vocab_size, r), what="W1, the previous token's embedding"),
         "markov_head.markov_w2.weight": TensorSpec((vd, r), what="W2, the projection to a vocabulary bias")}
    if cfg.markov_head_type == "gated":
        what = "the gated head's gate g = sigmoid(Wg [h ; e] + bg), Wg [r, H + r]"
        _add(t, "markov_head.gate_proj", _linear(r, h + r, True, what))
    elif cfg.markov_head_type == "rnn":
        what = "the rnn head's [a ; c ; o] = Wj [s ; e ; h] + bj, Wj [3r, 2r + H]"
        _add(t, "markov_head.joint_proj", _linear(3 * r, 2 * r + h, True, what))
    return t


def _confidence(cfg: DSparkConfig) -> dict[str, TensorSpec]:
    if not cfg.enable_confidence_head:
        return {}
    extra = cfg.markov_rank if cfg.confidence_head_with_markov else 0
    return {"confidence_head.proj.weight": TensorSpec((1, cfg.hidden_size + extra)),
            "confidence_head.proj.bias": TensorSpec((1,))}


def vocab_tensors(cfg: DSparkConfig) -> dict[str, TensorSpec]:
    """Embedding / LM head copies, and a draft vocabulary's own LM head and id maps."""
    v, h = cfg.vocab_size, cfg.hidden_size
    shared = "a copy of the target's (the drafter shares the target's own)"
    t = {"embed_tokens.weight": TensorSpec((v, h), required=False, parameter=False, what=shared)}
    if cfg.draft_vocab_size is None:
        t["lm_head.weight"] = TensorSpec((v, h), required=False, parameter=False, what=shared)
        return t
    vd = cfg.draft_vocab_size
    t["lm_head.weight"] = TensorSpec((vd, h), what="the draft vocabulary's own LM head")
    t["d2t"] = TensorSpec((vd,), dtype="int64", parameter=False,
                          what="draft id -> target id offsets (target id = draft id + d2t[draft id])")
    t["t2d"] = TensorSpec((v,), dtype="bool", required=False, parameter=False,
                          what="which target ids the draft vocabulary holds (training only)")
    return t


def drafter_tensors(cfg: DSparkConfig) -> dict[str, TensorSpec]:
    """Canonical tensor name -> :class:`TensorSpec` for every tensor a checkpoint of ``cfg`` may hold."""
    table = dict(_context(cfg))
    layer = _LAYERS[cfg.backbone]
    for i in range(cfg.num_hidden_layers):
        table.update(layer(cfg, i))
    table["final_norm.weight" if cfg.backbone == "mla" else "norm.weight"] = TensorSpec((cfg.hidden_size,))
    table.update(markov_tensors(cfg))
    table.update(_confidence(cfg))
    table.update(vocab_tensors(cfg))
    return table


def required_shapes(cfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors a checkpoint of ``cfg`` must hold (what a save writes)."""
    return {name: spec.shape for name, spec in drafter_tensors(cfg).items() if spec.required}


def count_parameters(cfg: DSparkConfig) -> int:
    """The drafter's own parameters: no copies of the target's embedding / LM head, no id maps or buffers.

    The Kimi K3 SpecForge shape gives 2,249,289,601 (FACTS.md, the model card's number).
    """
    return sum(math.prod(s.shape) for s in drafter_tensors(cfg).values() if s.parameter)
