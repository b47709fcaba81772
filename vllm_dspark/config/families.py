"""Which family a DSpark ``config.json`` comes from, and what each of its keys means there.

Four families publish DSpark drafters (FACTS.md, "DSpark checkpoint families in
the wild"). They describe the same drafter with different keys, and some keys
mean different things in different families, so every key is read by family,
never by guessing from its value:

* **specforge** (``architectures`` DSparkDraftModel or DFlashDraftModel): Qwen3
  fields at the top level, the DSpark knobs in ``dflash_config`` (newer exports
  keep the Markov / confidence keys in ``dspark_config``); ``target_layer_ids``
  are layer OUTPUTS, 0-based; ``sample_from_anchor`` absent means
  ``projector_type == "dspark"``; ``draft_vocab_size`` absent means the full
  vocabulary. A ``dflash_config`` block is SpecForge's, so a config holding one
  is read by SpecForge's rules also when ``architectures`` says Qwen3DSparkModel
  (vLLM and SGLang rename SpecForge exports to that runtime name).
* **deepspec** (``architectures`` Qwen3DSparkModel, no ``speculators_model_type``,
  no ``dflash_config`` block): the target's Qwen3 config with flat DSpark keys (``block_size``,
  ``markov_rank``, ``target_layer_ids``, ``mask_token_id``, ...);
  ``sample_from_anchor`` absent means TRUE; ``enable_confidence_head`` and
  ``confidence_head_with_markov`` absent mean false (DeepSpec writes them when on).
* **speculators** (``speculators_model_type: "dspark"``, whatever
  ``architectures`` says): the draft layers in ``transformer_layer_config``
  (serialised as a diff against transformers' ``Qwen3Config``, so an absent key
  is that class's default); ``aux_hidden_state_layer_ids`` are vLLM aux indices,
  i.e. ``target_layer_ids + 1``; ``block_size`` absent means 8;
  ``sample_from_anchor`` absent means FALSE (the 1 + N layout: block - 1 drafts);
  ``draft_vocab_size`` absent means 32,000 (speculators' own default);
  ``speculators_config.proposal_methods[0].speculative_tokens`` must equal the
  number of drafts; markov / confidence keys absent mean off.
* **other_backbone**: ``Gemma4DSparkModel`` (DeepSpec's keys on a Gemma4 text
  config; K and V may share ``k_proj``) and ``K3DSparkModel`` (an MLA drafter;
  there ``num_target_layers`` is the number of TAPPED layers and the target's
  depth is ``target_num_hidden_layers``). Parsed, counted and named; not served
  on the V1 runner.

:func:`parse` returns the :class:`~vllm_dspark.config.DSparkConfig` keyword
arguments and the family's own problems; the dataclass then checks the fields.
:func:`key_name` tells messages where a family spells a field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_dspark.config.shapes import Gemma4Shape, MLAShape

SPECFORGE_ARCHITECTURES = ("DSparkDraftModel", "DFlashDraftModel")
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"
GEMMA4_ARCHITECTURE = "Gemma4DSparkModel"
K3_MLA_ARCHITECTURE = "K3DSparkModel"
OTHER_BACKBONES = {GEMMA4_ARCHITECTURE: "gemma4", K3_MLA_ARCHITECTURE: "mla"}
KNOWN = (f"{' / '.join(SPECFORGE_ARCHITECTURES)} (SpecForge), {DEEPSPEC_ARCHITECTURE} (DeepSpec), "
         f"speculators_model_type 'dspark' (vllm-project/speculators), {GEMMA4_ARCHITECTURE}, {K3_MLA_ARCHITECTURE}")
SPECULATORS_DEFAULT_BLOCK_SIZE = 8  # DSparkSpeculatorConfig.block_size
SPECULATORS_DEFAULT_DRAFT_VOCAB = 32000  # DSparkSpeculatorConfig.draft_vocab_size
# transformers' Qwen3Config defaults (tests/checkpoint/test_families.py checks them against the installed
# class): speculators writes transformer_layer_config with to_diff_dict, which drops keys equal to these.
QWEN3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
}
BACKBONE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "hidden_act",
                 "attention_bias", "sliding_window")
# SpecForge's knobs in dflash_config, as its messages must name them.
DFLASH_KEYS = ("target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type", "attention_mode",
               "projector_type", "confidence_head_alpha", "enable_confidence_head", "confidence_head_with_markov",
               "sample_from_anchor")
# Keys of SpecForge's MLA / KDA draft variants: a DSparkDraftModel export carrying them is not Qwen3 GQA.
MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "draft_layer_types", "linear_attn_config")
K3_MASK_KEYS = ("mask_token_id", "dspark_noise_token_id", "ptd_token_id")  # vLLM's K3DSparkConfig spellings


@dataclass
class Parsed:
    """What :func:`parse` read: the family (None when unrecognised), the fields, the family's problems."""

    family: str | None
    architecture: str
    fields: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


class _Keys:
    """Read a key from ordered (prefix, mapping) sources: the first source holding it wins."""

    def __init__(self, *sources: tuple[str, Mapping[str, Any]]):
        self.sources = [(prefix, dict(src or {})) for prefix, src in sources]

    def has(self, key: str) -> bool:
        return any(key in src for _, src in self.sources)

    def get(self, key: str, default: Any = None) -> Any:
        for _, src in self.sources:
            if key in src:
                return src[key]
        return default

    def where(self, key: str) -> str:
        """The spelling of ``key`` in the first source holding it (the first source's when none does)."""
        for prefix, src in self.sources:
            if key in src:
                return prefix + key
        return self.sources[0][0] + key


# --------------------------------------------------------------------------- detection
def detect(d: Mapping[str, Any]) -> tuple[str | None, str, str | None]:
    """(family, architecture, problem) of a config.json dict; family None (with the problem) when unknown.

    ``speculators_model_type`` decides first: RedHat's speculators exports may
    say ``Qwen3DSparkModel`` in ``architectures`` while their keys are
    speculators'. A config without ``architectures`` is read as SpecForge's
    (this project's own older exports wrote none).
    """
    archs = [str(a) for a in (d.get("architectures") or [])]
    arch = archs[0] if archs else ""
    smt = d.get("speculators_model_type")
    if smt is not None:
        if smt == "dspark":
            return "speculators", arch or "DSparkDraftModel", None
        return None, arch, (f"speculators_model_type: got {smt!r}, expected 'dspark'; this is a speculators "
                            f"{smt} checkpoint, not a DSpark drafter")
    for a in archs:
        if a in OTHER_BACKBONES:
            return "other_backbone", a, None
        if a == DEEPSPEC_ARCHITECTURE:
            # A dflash_config block is SpecForge's: vLLM / SGLang rename its exports to this runtime name.
            return ("specforge" if isinstance(d.get("dflash_config"), Mapping) else "deepspec"), a, None
        if a in SPECFORGE_ARCHITECTURES:
            return "specforge", a, None
    if not archs:
        return "specforge", "DSparkDraftModel", None
    return None, arch, (f"architectures: got {archs}, which is no DSpark checkpoint family this project reads "
                        f"(known: {KNOWN}); a SpecForge MLA / KDA variant or another trainer's drafter "
                        "has other layers and cannot be read as any of them")


def is_dspark_config(d: Any) -> bool:
    """True when ``d`` claims to be a DSpark drafter (of a known family or not), so start-up validates it."""
    if not isinstance(d, Mapping):
        return False
    if d.get("speculators_model_type") == "dspark":
        return True
    if any("DSpark" in str(a) for a in (d.get("architectures") or [])):
        return True
    dc = d.get("dflash_config")
    return isinstance(dc, Mapping) and dc.get("projector_type") == "dspark"


def key_name(family: str, name: str, architecture: str = "") -> str:
    """Where ``family`` spells field ``name`` in config.json (messages name the key the user can edit)."""
    if family == "specforge" and name in DFLASH_KEYS:
        return f"dflash_config.{name}"
    if family == "speculators":
        if name == "target_layer_ids":
            return "aux_hidden_state_layer_ids (read as target_layer_ids + 1)"
        if name in BACKBONE_KEYS:
            return f"transformer_layer_config.{name}"
    if architecture == K3_MLA_ARCHITECTURE and name == "num_target_layers":
        return "target_num_hidden_layers"
    if architecture == GEMMA4_ARCHITECTURE and name == "head_dim":
        return "global_head_dim"
    return name


# --------------------------------------------------------------------------- shared readers
def rope_fields(bd: Mapping[str, Any], *, layer_type: str | None = None) -> tuple[Any, dict | None]:
    """(rope_theta, rope_scaling) of a backbone dict, in transformers 5 or 4.x spelling.

    transformers 5 nests everything in ``rope_parameters`` (per layer type for
    Gemma4: pass ``layer_type``); 4.x writes ``rope_theta`` and ``rope_scaling``.
    A top-level ``original_max_position_embeddings`` overrides the rope dict's,
    as ``PreTrainedConfig.standardize_rope_params`` does.
    """
    theta = bd.get("rope_theta")
    scaling = bd.get("rope_scaling")
    rp = bd.get("rope_parameters")
    if isinstance(rp, Mapping) and layer_type is not None and isinstance(rp.get(layer_type), Mapping):
        rp = rp[layer_type]
    if isinstance(rp, Mapping):
        rp = dict(rp)
        theta = rp.pop("rope_theta", theta)
        if rp.get("rope_type", rp.get("type", "default")) != "default":
            scaling = rp
    if isinstance(scaling, Mapping):
        scaling = dict(scaling)
        if scaling.get("rope_type", scaling.get("type")) == "yarn" and bd.get("original_max_position_embeddings"):
            scaling["original_max_position_embeddings"] = bd["original_max_position_embeddings"]
    return theta, scaling


def sliding_window(bd: Mapping[str, Any], num_layers: Any) -> tuple[int | None, str | None]:
    """(window, problem) of the draft layers, with Qwen3's rule for which layers slide.

    Explicit ``layer_types`` decide; without them a layer slides when
    ``use_sliding_window`` and its index >= ``max_window_layers``. All layers
    must agree: one window for the whole drafter.
    """
    sw = bd.get("sliding_window")
    types = bd.get("layer_types")
    if not isinstance(types, list):
        n = num_layers if isinstance(num_layers, int) else 0
        slide = bool(bd.get("use_sliding_window")) and sw is not None
        first = bd.get("max_window_layers", QWEN3_DEFAULTS["max_window_layers"])
        types = ["sliding_attention" if slide and i >= first else "full_attention" for i in range(n)]
    kinds = set(types)
    if kinds <= {"full_attention"}:
        return None, None
    if kinds == {"sliding_attention"}:
        return sw, None
    return None, (f"layer_types: {types} mixes sliding and full attention across draft layers; the drafter "
                  "serves one attention window for all layers")


def _head_dim(bd: Mapping[str, Any], defaults: Mapping[str, Any]) -> Any:
    hidden, heads = bd.get("hidden_size"), bd.get("num_attention_heads")
    if bd.get("head_dim"):
        return bd["head_dim"]
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return defaults["head_dim"]


def draft_vocab(raw: Any, vocab_size: Any) -> Any:
    """``draft_vocab_size`` as a field: one as large as the target's vocabulary is the full vocabulary (None).

    (vLLM maps such a drafter's ids identically and needs no ``d2t``; anything
    else, including a size above the target's, is left for the field check.)
    """
    if isinstance(raw, int) and not isinstance(raw, bool) and isinstance(vocab_size, int) and raw == vocab_size:
        return None
    return raw


def _backbone_fields(bd: Mapping[str, Any], defaults: Mapping[str, Any], window_key: str = "") -> tuple[dict, list]:
    """The Qwen3-layer fields of a backbone dict (SpecForge top level, DeepSpec, speculators' nested one)."""
    problems: list[str] = []
    heads = bd.get("num_attention_heads", defaults["num_attention_heads"])
    theta, scaling = rope_fields(bd)
    layers = bd.get("num_hidden_layers", defaults["num_hidden_layers"])
    window, problem = sliding_window(bd, layers)
    if problem:
        problems.append(window_key + problem)
    fields = dict(
        hidden_size=bd.get("hidden_size", defaults["hidden_size"]), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=bd.get("num_key_value_heads", heads),
        head_dim=_head_dim(bd, defaults), intermediate_size=bd.get("intermediate_size", defaults["intermediate_size"]),
        rms_norm_eps=float(bd.get("rms_norm_eps", defaults["rms_norm_eps"])),
        hidden_act=bd.get("hidden_act", defaults["hidden_act"]),
        attention_bias=bool(bd.get("attention_bias", defaults["attention_bias"])),
        vocab_size=bd.get("vocab_size", defaults["vocab_size"]),
        max_position_embeddings=bd.get("max_position_embeddings", defaults["max_position_embeddings"]),
        rope_theta=float(theta if theta is not None else defaults["rope_theta"]), rope_scaling=scaling,
        sliding_window=window,
    )
    return fields, problems


def _dtype(*sources: Mapping[str, Any], default: str) -> str:
    for src in sources:
        for key in ("dtype", "torch_dtype"):
            if src.get(key):
                return str(src[key])
    return default


def _causal_problem(d: Mapping[str, Any]) -> list[str]:
    # SpecForge's "causal" ablations (qwen3-8b-dspark-causal-noconf-b16) mask the query block causally; every
    # path here attends non-causally inside the block, so such a drafter would run on inputs it never saw.
    if d.get("is_causal"):
        return ["is_causal: true (a drafter trained with a causal query block); DSpark's block attention is "
                "non-causal in the reference and on both runners; use a non-causal export"]
    return []


# --------------------------------------------------------------------------- the families
def _specforge(d: Mapping[str, Any], defaults: Mapping[str, Any]) -> tuple[dict, list[str]]:
    dc = dict(d.get("dflash_config") or {})
    # Newer SpecForge exports (GLM-5.2, Qwen3.6-27B) keep the Markov / confidence keys in dspark_config.
    keys = _Keys(("dflash_config.", dc), ("dspark_config.", d.get("dspark_config") or {}), ("", d))
    problems = _causal_problem(d)
    if d.get("model_type") not in (None, "qwen3"):
        problems.append(f"model_type: got {d['model_type']!r} for a SpecForge export; only its Qwen3-layer "
                        "drafters (model_type 'qwen3') are read; vLLM 0.33's V2 runner serves DeepSeek-V4 "
                        "DSpark drafters")
    mla = [k for k in MLA_KEYS if k in d]
    if mla:
        problems.append(f"{mla[0]}: a SpecForge drafter with MLA / KDA layers ({', '.join(mla)}); only its "
                        "Qwen3 GQA drafters are read")

    def pick(key: str, default: Any = None) -> Any:
        return keys.get(key, defaults[key] if default is None else default)

    fields, more = _backbone_fields(d, defaults)
    problems += more
    rank = keys.get("markov_rank", 0)
    alpha = float(pick("confidence_head_alpha"))
    if keys.has("sample_from_anchor"):
        from_anchor = bool(keys.get("sample_from_anchor"))
    elif dc.get("query_layout") is not None:
        from_anchor = dc["query_layout"] == "anchor_first"
        if dc["query_layout"] not in ("anchor_first", "one_plus_n"):
            problems.append(f"dflash_config.query_layout: got {dc['query_layout']!r}, expected "
                            "'anchor_first' or 'one_plus_n' (or use sample_from_anchor)")
    else:
        from_anchor = pick("projector_type") == "dspark"
    if not keys.has("mask_token_id"):
        problems.append("dflash_config.mask_token_id: missing; the drafter cannot build its query block")
    dv = draft_vocab(keys.get("draft_vocab_size"), fields["vocab_size"])
    fields.update(
        dtype=_dtype(d, default=defaults["dtype"]), block_size=pick("block_size"),
        target_layer_ids=tuple(keys.get("target_layer_ids", ()) or ()),
        num_target_layers=keys.get("num_target_layers"), target_hidden_size=pick("target_hidden_size"),
        mask_token_id=keys.get("mask_token_id", 0), markov_rank=rank, markov_head_type=pick("markov_head_type"),
        enable_confidence_head=bool(keys.get("enable_confidence_head", alpha > 0)),
        confidence_head_with_markov=bool(keys.get("confidence_head_with_markov", bool(rank))),
        confidence_head_alpha=alpha, attention_mode=pick("attention_mode"),
        projector_type=pick("projector_type"), sample_from_anchor=from_anchor, draft_vocab_size=dv,
    )
    return fields, problems



def _dspark_knobs(keys: _Keys, *, anchor_default: bool) -> dict[str, Any]:
    """DeepSpec's flat DSpark keys (also K3DSparkModel's and Gemma4DSparkModel's): off when absent."""
    rank = keys.get("markov_rank", 0)
    conf = bool(keys.get("enable_confidence_head", False))
    return dict(
        markov_rank=rank, markov_head_type=keys.get("markov_head_type", "vanilla"),
        enable_confidence_head=conf,
        confidence_head_with_markov=bool(keys.get("confidence_head_with_markov", False)) if conf else False,
        confidence_head_alpha=1.0 if conf else 0.0,
        sample_from_anchor=bool(keys.get("sample_from_anchor", anchor_default)),
        target_layer_ids=tuple(keys.get("target_layer_ids", ()) or ()),
        mask_token_id=keys.get("mask_token_id", 0),
    )


def _deepspec(d: Mapping[str, Any], defaults: Mapping[str, Any]) -> tuple[dict, list[str]]:
    keys = _Keys(("", d))
    problems = _causal_problem(d)
    fields, more = _backbone_fields(d, defaults)
    problems += more
    if not keys.has("mask_token_id"):
        problems.append("mask_token_id: missing; the drafter cannot build its query block")
    fields.update(_dspark_knobs(keys, anchor_default=True))
    dv = draft_vocab(keys.get("draft_vocab_size"), fields["vocab_size"])
    fields.update(
        dtype=_dtype(d, default=defaults["dtype"]), block_size=keys.get("block_size", defaults["block_size"]),
        num_target_layers=keys.get("num_target_layers"), target_hidden_size=keys.get("target_hidden_size"),
        draft_vocab_size=dv,
    )
    return fields, problems


def speculative_tokens(d: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """(``speculators_config.proposal_methods[0].speculative_tokens``, problem); None when not declared."""
    sc = d.get("speculators_config")
    methods = sc.get("proposal_methods") if isinstance(sc, Mapping) else None
    if not methods:
        return None, None
    tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], Mapping) else None
    if tokens is None:
        return None, None
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        return None, (f"speculators_config.proposal_methods[0].speculative_tokens: got {tokens!r}, expected a "
                      "positive integer")
    return tokens, None


def _speculators(d: Mapping[str, Any], defaults: Mapping[str, Any]) -> tuple[dict, list[str]]:
    problems = _causal_problem(d)
    tl = d.get("transformer_layer_config")
    if not isinstance(tl, Mapping):
        return {}, problems + ["transformer_layer_config: missing; a speculators checkpoint describes its draft "
                               "layers there (hidden_size, num_hidden_layers, ...)"]
    model_type = tl.get("model_type", "qwen3")
    if model_type == "qwen3":
        bd = {**QWEN3_DEFAULTS, **tl}  # to_diff_dict left out what equals Qwen3Config's defaults
    else:
        bd = dict(tl)
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in bd]
        if missing:
            problems.append(f"transformer_layer_config: model_type {model_type!r} without {missing}; their defaults "
                            f"are {model_type}'s config class's, which this parser does not assume: write them out")
    fields, more = _backbone_fields(bd, defaults, "transformer_layer_config.")
    problems += more
    aux = d.get("aux_hidden_state_layer_ids")
    if not aux:
        problems.append("aux_hidden_state_layer_ids: missing; the drafter reads the target's hidden states at "
                        "these vLLM aux indices (target_layer_ids + 1)")
    if d.get("mask_token_id") is None:
        problems.append("mask_token_id: missing; the drafter cannot build its query block")
    keys = _Keys(("", d))
    fields.update(_dspark_knobs(keys, anchor_default=False))
    # aux index i is the stream ENTERING layer i, i.e. the output of layer i - 1 (vLLM's update_dflash).
    fields["target_layer_ids"] = tuple(int(i) - 1 for i in aux or ())
    block = d.get("block_size", SPECULATORS_DEFAULT_BLOCK_SIZE)
    fields["block_size"] = block
    tokens, problem = speculative_tokens(d)
    if problem:
        problems.append(problem)
    if tokens is not None and isinstance(block, int):
        drafts = block if fields["sample_from_anchor"] else block - 1
        if tokens != drafts:
            layout = ("sample_from_anchor true: anchor-first, block drafts" if fields["sample_from_anchor"]
                      else "sample_from_anchor false or absent: the 1 + N layout, block - 1 drafts")
            problems.append(
                f"speculators_config.proposal_methods[0].speculative_tokens: got {tokens}, but block_size {block} "
                f"with {layout} proposes {drafts}; set speculative_tokens to {drafts}, or set sample_from_anchor "
                "to how the drafter was trained")
    dv = draft_vocab(d.get("draft_vocab_size", SPECULATORS_DEFAULT_DRAFT_VOCAB), fields["vocab_size"])
    fields.update(dtype=_dtype(d, tl, default=defaults["dtype"]), num_target_layers=None,
                  target_hidden_size=d.get("target_hidden_size"), draft_vocab_size=dv)
    return fields, problems


def _gemma4(d: Mapping[str, Any], defaults: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """DeepSpec's Gemma4DSparkModel: every draft layer is a Gemma4 full-attention layer."""
    problems = _causal_problem(d)
    keys = _Keys(("", d))
    k_eq_v = bool(d.get("attention_k_eq_v", False))
    heads = d.get("num_attention_heads", defaults["num_attention_heads"])
    kv_heads = d.get("num_global_key_value_heads") if k_eq_v else d.get("num_key_value_heads")
    layers = d.get("num_hidden_layers", defaults["num_hidden_layers"])
    shared = int(d.get("num_kv_shared_layers") or 0)
    first_shared = layers - shared if isinstance(layers, int) else 0
    # transformers' Gemma4TextMLP: double width on KV-shared layers, and only when some layers are not shared.
    wide = tuple(i for i in range(layers if isinstance(layers, int) else 0)
                 if d.get("use_double_wide_mlp") and i >= first_shared > 0)
    theta, scaling = rope_fields(d, layer_type="full_attention")
    if not keys.has("mask_token_id"):
        problems.append("mask_token_id: missing; the drafter cannot build its query block")
    fields = dict(
        hidden_size=d.get("hidden_size", defaults["hidden_size"]), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads if kv_heads is not None else heads,
        head_dim=d.get("global_head_dim") or d.get("head_dim") or defaults["head_dim"],
        intermediate_size=d.get("intermediate_size", defaults["intermediate_size"]),
        rms_norm_eps=float(d.get("rms_norm_eps", defaults["rms_norm_eps"])),
        hidden_act=d.get("hidden_activation", d.get("hidden_act", "gelu_pytorch_tanh")),
        attention_bias=bool(d.get("attention_bias", False)), vocab_size=d.get("vocab_size", defaults["vocab_size"]),
        max_position_embeddings=d.get("max_position_embeddings", defaults["max_position_embeddings"]),
        rope_theta=float(theta if theta is not None else defaults["rope_theta"]), rope_scaling=scaling,
        dtype=_dtype(d, default=defaults["dtype"]), block_size=d.get("block_size", defaults["block_size"]),
        num_target_layers=d.get("num_target_layers"), target_hidden_size=d.get("target_hidden_size"),
        gemma4=Gemma4Shape(shared_kv_projection=k_eq_v, double_wide_mlp_layers=wide),
    )
    fields.update(_dspark_knobs(keys, anchor_default=True))
    return fields, problems


def _k3_mla(d: Mapping[str, Any], defaults: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """K3DSparkModel (an MLA drafter for Kimi K3), keys as vLLM's K3DSparkConfig reads them."""
    problems = _causal_problem(d)
    keys = _Keys(("", d))
    missing = [k for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if k not in d]
    if missing:
        problems.append(f"{missing[0]}: missing; a {K3_MLA_ARCHITECTURE} config gives its MLA geometry "
                        f"({', '.join(missing)} absent)")
    mla = MLAShape(q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d.get("kv_lora_rank", 0),
                   qk_nope_head_dim=d.get("qk_nope_head_dim", 0), qk_rope_head_dim=d.get("qk_rope_head_dim", 0),
                   v_head_dim=d.get("v_head_dim", 0), output_gate=bool(d.get("mla_use_output_gate", False)))
    taps = tuple(d.get("target_layer_ids") or ())
    # Here num_target_layers counts the TAPPED layers (context_proj reads that many); the depth has its own key.
    if d.get("num_target_layers") is not None and d["num_target_layers"] != len(taps):
        problems.append(f"num_target_layers: got {d['num_target_layers']}, but {K3_MLA_ARCHITECTURE} reads it as "
                        f"the number of tapped layers and target_layer_ids has {len(taps)}; fix one of them")
    mask_key = next((k for k in K3_MASK_KEYS if d.get(k) is not None), None)
    if mask_key is None:
        problems.append(f"mask_token_id: missing (also looked for {K3_MASK_KEYS[1:]}); the drafter cannot build "
                        "its query block")
    theta, scaling = rope_fields(d)
    heads = d.get("num_attention_heads", defaults["num_attention_heads"])
    nope_rope = (mla.qk_nope_head_dim or 0) + (mla.qk_rope_head_dim or 0)
    fields = dict(
        hidden_size=d.get("hidden_size", defaults["hidden_size"]),
        num_hidden_layers=d.get("num_hidden_layers", defaults["num_hidden_layers"]),
        num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads", heads),
        head_dim=nope_rope or defaults["head_dim"],
        intermediate_size=d.get("intermediate_size", defaults["intermediate_size"]),
        rms_norm_eps=float(d.get("rms_norm_eps", defaults["rms_norm_eps"])),
        hidden_act=d.get("hidden_act", "silu"), attention_bias=False,
        vocab_size=d.get("vocab_size", defaults["vocab_size"]),
        max_position_embeddings=d.get("max_position_embeddings", defaults["max_position_embeddings"]),
        rope_theta=float(theta if theta is not None else defaults["rope_theta"]), rope_scaling=scaling,
        dtype=_dtype(d, default=defaults["dtype"]), block_size=d.get("block_size", defaults["block_size"]),
        num_target_layers=d.get("target_num_hidden_layers"), target_hidden_size=d.get("target_hidden_size"),
        attention_mode="mla", mla=mla,
    )
    fields.update(_dspark_knobs(keys, anchor_default=True))
    fields["mask_token_id"] = d.get(mask_key, 0) if mask_key else 0
    return fields, problems


_PARSERS = {"specforge": _specforge, "deepspec": _deepspec, "speculators": _speculators}
_OTHER_PARSERS = {"gemma4": _gemma4, "mla": _k3_mla}


def parse(d: Mapping[str, Any], defaults: Mapping[str, Any]) -> Parsed:
    """Detect the family of config.json dict ``d`` and map its keys to ``DSparkConfig`` fields.

    Parameters
    ----------
    d : the config.json dict
    defaults : ``DSparkConfig``'s field defaults (the one place defaults are set)

    Returns
    -------
    :class:`Parsed` with ``family`` None when no family matches (``problems``
    then says why); otherwise the keyword arguments for ``DSparkConfig`` and
    the family's own problems (the dataclass checks the fields themselves).
    """
    if not isinstance(d, Mapping):
        return Parsed(None, "", problems=[f"config.json: a JSON {type(d).__name__}, expected an object"])
    family, arch, problem = detect(d)
    if family is None:
        return Parsed(None, arch, problems=[problem or "config.json: not a DSpark drafter"])
    parser = _OTHER_PARSERS[OTHER_BACKBONES[arch]] if family == "other_backbone" else _PARSERS[family]
    fields, problems = parser(d, defaults)
    if not fields:
        return Parsed(None, arch, problems=problems)
    fields.update(family=family, architecture=arch)
    return Parsed(family, arch, fields, problems)
