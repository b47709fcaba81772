"""One validated configuration object for a DSpark drafter.

``DSparkConfig.from_dict`` reads a ``config.json`` of any published DSpark
checkpoint family (SpecForge, DeepSpec, vllm-project/speculators, and the other
backbones Gemma4DSparkModel / K3DSparkModel): :mod:`vllm_dspark.config.families`
detects the family and maps its keys to the fields below, so this module holds
one dataclass whatever the file looked like. Every field has a default and a
one-line description; invalid combinations fail at construction with a message
that names the field (as the family's config.json spells it), the value it got,
what was expected, and how to fix it. ``DSparkConfig.problems`` lists every
problem at once, which is what ``vllm-dspark inspect`` prints.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vllm_dspark.config.shapes import Gemma4Shape, MLAShape, _desc

MarkovHeadType = Literal["vanilla", "gated", "rnn"]
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
Family = Literal["specforge", "deepspec", "speculators", "other_backbone"]
FAMILIES = ("specforge", "deepspec", "speculators", "other_backbone")
Backbone = Literal["qwen3", "gemma4", "mla"]
# attention_mode each backbone's layers use (SpecForge writes it; the other families imply it).
ATTENTION_MODE_OF = {"qwen3": "gqa", "gemma4": "gqa", "mla": "mla"}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# YaRN keys Hugging Face's _compute_yarn_parameters reads; rope.py applies each of them the same way.
YARN_KEYS = ("rope_type", "type", "factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate", "partial_rotary_factor")


class DSparkConfigError(ValueError):
    """A DSpark config that cannot be served; ``problems`` lists each reason."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        where = f" in {source}" if source else ""
        lines = "\n  - ".join(self.problems)
        super().__init__(f"invalid DSpark draft config{where}:\n  - {lines}")


@dataclass(frozen=True, kw_only=True)
class DSparkConfig:
    """Shape and behaviour of one DSpark drafter (see FACTS.md for the method)."""

    # --- where the checkpoint comes from ---
    family: Family = _desc(
        "Checkpoint family of the config.json: 'specforge', 'deepspec', 'speculators' or 'other_backbone' "
        "(Gemma4DSparkModel, K3DSparkModel); it decides what each key means.", "specforge")
    architecture: str = _desc("architectures[0] as the config.json names it (for messages).", "DSparkDraftModel")

    # --- backbone (Qwen3-style GQA decoder layers unless mla / gemma4 say otherwise) ---
    hidden_size: int = _desc("Draft hidden size; must equal the target's (shared embedding and LM head).", 4096)
    num_hidden_layers: int = _desc("Number of draft decoder layers.", 5)
    num_attention_heads: int = _desc("Query heads per draft layer.", 32)
    num_key_value_heads: int = _desc("KV heads per draft layer (GQA); must divide num_attention_heads.", 8)
    head_dim: int = _desc("Per-head dimension.", 128)
    intermediate_size: int = _desc("SwiGLU MLP width.", 12288)
    rms_norm_eps: float = _desc("RMSNorm epsilon.", 1e-6)
    hidden_act: str = _desc("MLP activation (only 'silu' is supported).", "silu")
    attention_bias: bool = _desc("Whether q/k/v/o projections carry a bias.", False)
    vocab_size: int = _desc("Vocabulary size (the target's).", 151936)
    max_position_embeddings: int = _desc("Context length the drafter was trained for.", 40960)
    rope_theta: float = _desc("RoPE base frequency.", 1_000_000.0)
    rope_scaling: dict | None = _desc("RoPE scaling parameters (e.g. YaRN), or None for plain RoPE.", None)
    dtype: str = _desc("Checkpoint dtype.", "bfloat16")
    sliding_window: int | None = _desc(
        "Attention window (tokens) the draft layers were trained with; None: full attention.", None)
    mla: MLAShape | None = _desc("MLA geometry of a K3DSparkModel drafter; None for GQA layers.", None)
    gemma4: Gemma4Shape | None = _desc("Gemma4 layer specifics of a Gemma4DSparkModel drafter; None otherwise.", None)

    # --- DFlash / DSpark specifics ---
    block_size: int = _desc("Query positions per draft block (= draft tokens per step for anchor-first).", 7)
    target_layer_ids: tuple[int, ...] = _desc(
        "Target layers whose OUTPUT feeds the drafter (0-based; vLLM's aux index is id + 1).",
        (1, 9, 17, 25, 33))
    num_target_layers: int | None = _desc(
        "Decoder layer count of the target the drafter was trained on (None: not recorded in the export).", 36)
    target_hidden_size: int | None = _desc("Target hidden size if different from hidden_size.", None)
    mask_token_id: int = _desc("Token id fed at the masked query positions.", 151669)
    markov_rank: int = _desc("Rank of the Markov logit-bias head (0 = no Markov head: a DFlash-style drafter).", 256)
    markov_head_type: MarkovHeadType = _desc(
        "Markov head: 'vanilla' (W2 W1[prev]), 'gated' (+ gate_proj [r, H + r]) or 'rnn' (+ joint_proj "
        "[3r, 2r + H], a state carried across the block).", "vanilla")
    draft_vocab_size: int | None = _desc(
        "Draft vocabulary (lm_head [Vd, H], markov_w2 [Vd, r], d2t [Vd]: target id = draft id + d2t[draft id]); "
        "None: the target's full vocabulary.", None)
    enable_confidence_head: bool = _desc(
        "Whether the checkpoint has a per-position confidence head (absent from an export: "
        "confidence_head_alpha > 0, as SpecForge's trainers decide).", True)
    confidence_head_with_markov: bool = _desc(
        "Confidence head also reads the Markov embedding of the previous token (absent: markov_rank > 0).", True)
    confidence_head_alpha: float = _desc("Training-time weight of the confidence loss.", 1.0)
    attention_mode: str = _desc("Draft attention kind: 'gqa' (Qwen3 / Gemma4 layers) or 'mla' (K3DSparkModel).", "gqa")
    projector_type: str = _desc("SpecForge projector type ('dspark' for this drafter).", "dspark")
    sample_from_anchor: bool = _desc(
        "True (anchor-first): queries [anchor, mask x (B-1)], every row predicts a draft, B drafts per block. "
        "False: the older DFlash layout [anchor, mask x N], only the masks predict, B - 1 drafts.", True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        object.__setattr__(self, "rope_scaling", _with_original_context(self.rope_scaling,
                                                                        self.max_position_embeddings))
        problems = self.problems()
        if problems:
            raise DSparkConfigError(problems)

    # ------------------------------------------------------------------ checks
    def key(self, name: str) -> str:
        """Where this config's family spells field ``name`` in config.json (for messages)."""
        from vllm_dspark.config.families import key_name

        return key_name(self.family, name, self.architecture)

    def problems(self) -> list[str]:
        """Every reason this config cannot be served (empty when valid)."""
        p = self._shape_problems()
        if p:
            return p  # later checks divide by these
        # The rope is checked for the layers the runners rotate: Gemma4's proportional rope and the MLA
        # drafter's are counted, never applied.
        rope = self._rope_problems() if self.backbone == "qwen3" else []
        return (self._backbone_problems() + self._layer_id_problems() + self._head_problems()
                + self._vocab_problems() + rope)

    def _shape_problems(self) -> list[str]:
        p: list[str] = []

        def positive(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                p.append(f"{self.key(name)}: got {v!r}, expected a positive integer; fix {self.key(name)} "
                         "in config.json")

        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", "block_size"):
            positive(name)
        if self.num_target_layers is not None:
            positive("num_target_layers")
        if self.family not in FAMILIES:
            p.append(f"family: got {self.family!r}, expected one of {FAMILIES}")
        if self.mla is not None:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                v = getattr(self.mla, name)
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    p.append(f"{name}: got {v!r}, expected a positive integer (MLA geometry of "
                             f"{self.architecture}); fix {name} in config.json")
            q = self.mla.q_lora_rank
            if q is not None and (not isinstance(q, int) or isinstance(q, bool) or q <= 0):
                p.append(f"q_lora_rank: got {q!r}, expected a positive integer or null (a full-rank q_proj)")
        return p

    def _backbone_problems(self) -> list[str]:
        p: list[str] = []
        if self.num_attention_heads % self.num_key_value_heads:
            p.append(
                f"{self.key('num_key_value_heads')}: got {self.num_key_value_heads}, which does not divide "
                f"num_attention_heads={self.num_attention_heads}; GQA needs heads % kv_heads == 0 "
                f"(e.g. num_key_value_heads={math.gcd(self.num_attention_heads, self.num_key_value_heads)})")
        # Gemma4 layers use gelu; they are counted, never run, so only the served Qwen3 layers are held to SwiGLU.
        if self.backbone == "qwen3" and self.hidden_act != "silu":
            p.append(f"{self.key('hidden_act')}: got {self.hidden_act!r}, expected 'silu' (Qwen3 SwiGLU MLP)")
        want = ATTENTION_MODE_OF[self.backbone]
        if self.attention_mode != want:
            p.append(f"{self.key('attention_mode')}: got {self.attention_mode!r}, expected {want!r} for "
                     f"{self.backbone} layers ({self.architecture})")
        if self.target_hidden_size is not None and self.target_hidden_size <= 0:
            p.append(f"{self.key('target_hidden_size')}: got {self.target_hidden_size}, expected a positive integer")
        if self.dtype not in DTYPE_BYTES:
            p.append(f"dtype: got {self.dtype!r}, expected one of {sorted(DTYPE_BYTES)}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            p.append(f"{self.key('sliding_window')}: got {self.sliding_window!r}, expected a positive token count "
                     "(or use_sliding_window: false)")
        if not self.sample_from_anchor and self.block_size < 2:
            p.append(f"{self.key('block_size')}: sample_from_anchor false (the 1 + N layout) needs block_size >= 2 "
                     "(anchor + at least one mask)")
        return p

    def _layer_id_problems(self) -> list[str]:
        p: list[str] = []
        key = self.key("target_layer_ids")
        if not self.target_layer_ids:
            p.append(f"{key}: empty; the drafter needs at least one target layer")
        for i in self.target_layer_ids:
            if i < 0:
                p.append(f"{key}: layer {i} is negative; ids are 0-based layer indices")
            elif self.num_target_layers is not None and i >= self.num_target_layers:
                p.append(
                    f"{key}: layer {i} is outside the target's "
                    f"{self.num_target_layers} layers (valid 0..{self.num_target_layers - 1}); "
                    f"check target_layer_ids against {self.key('num_target_layers')}")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            p.append(f"{key}: duplicates in {list(self.target_layer_ids)}")
        if list(self.target_layer_ids) != sorted(self.target_layer_ids):
            p.append(f"{key}: {list(self.target_layer_ids)} is not ascending; "
                     "the fc weight's column blocks follow ascending layer order")
        return p

    def _head_problems(self) -> list[str]:
        p: list[str] = []
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            p.append(f"{self.key('markov_rank')}: got {self.markov_rank!r}, expected an integer >= 0")
            return p
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            p.append(f"{self.key('markov_head_type')}: got {self.markov_head_type!r}, expected one of "
                     f"{MARKOV_HEAD_TYPES}")
        elif self.markov_head_type != "vanilla" and self.markov_rank == 0:
            p.append(f"{self.key('markov_head_type')}: {self.markov_head_type!r} but markov_rank is 0, so there is "
                     f"no Markov head to gate; set markov_rank > 0 or markov_head_type: 'vanilla'")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            p.append(f"{self.key('confidence_head_with_markov')}: true but markov_rank is 0, so there is no "
                     "Markov embedding to read; set markov_rank > 0 or confidence_head_with_markov: false")
        return p

    def _vocab_problems(self) -> list[str]:
        p: list[str] = []
        if not 0 <= self.mask_token_id < self.vocab_size:
            p.append(f"{self.key('mask_token_id')}: got {self.mask_token_id}, expected 0 <= id < "
                     f"vocab_size={self.vocab_size}")
        dv = self.draft_vocab_size
        if dv is not None and (not isinstance(dv, int) or isinstance(dv, bool) or not 0 < dv < self.vocab_size):
            p.append(f"{self.key('draft_vocab_size')}: got {dv!r}, expected 0 < draft_vocab_size < vocab_size="
                     f"{self.vocab_size} (a draft vocabulary is a subset of the target's); leave it out (or "
                     "null) for a full-vocabulary drafter")
        return p

    def _rope_problems(self) -> list[str]:
        if self.rope_scaling is None:
            return []
        p: list[str] = []
        rs = self.rope_scaling
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype not in ("yarn", "default", "linear", None):
            p.append(f"rope_parameters.rope_type: got {rtype!r}, supported: 'default', 'linear', 'yarn'")
        if rtype in ("yarn", "linear") and not _positive_number(rs.get("factor")):
            p.append(f"rope_parameters.factor: got {rs.get('factor')!r}, expected a number > 0")
        if rtype != "yarn":
            return p
        unknown = sorted(k for k in rs if k not in YARN_KEYS and k != "rope_theta")
        if unknown:
            p.append(f"rope_parameters: {unknown} are not YaRN keys Hugging Face reads; the drafter's rotary "
                     f"embedding would ignore them; remove them or use a config whose rope is {list(YARN_KEYS)}")
        if rs.get("partial_rotary_factor", 1.0) != 1.0:
            p.append(f"rope_parameters.partial_rotary_factor: got {rs['partial_rotary_factor']!r}, but the drafter "
                     "rotates the whole head (1.0); a partial rotary embedding is not supported")
        if not isinstance(rs.get("truncate", True), bool):
            p.append(f"rope_parameters.truncate: got {rs['truncate']!r}, expected true or false")
        for name in ("mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
            if rs.get(name) is not None and not _non_negative_number(rs[name]):
                p.append(f"rope_parameters.{name}: got {rs[name]!r}, expected a number >= 0")
        if rs.get("attention_factor") is not None and not _positive_number(rs["attention_factor"]):
            p.append(f"rope_parameters.attention_factor: got {rs['attention_factor']!r}, expected a number > 0")
        if not _positive_number(rs.get("original_max_position_embeddings")):
            p.append(f"rope_parameters.original_max_position_embeddings: got "
                     f"{rs.get('original_max_position_embeddings')!r}, expected a positive integer")
        return p

    # ------------------------------------------------------------ derived
    @property
    def query_layout(self) -> str:
        """'anchor_first' (``sample_from_anchor``) or 'one_plus_n' (the older DFlash layout)."""
        return "anchor_first" if self.sample_from_anchor else "one_plus_n"

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens one block proposes (anchor-first: B; 1+N: B - 1)."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def aux_hidden_size(self) -> int:
        return len(self.target_layer_ids) * (self.target_hidden_size or self.hidden_size)

    @property
    def vllm_aux_layer_ids(self) -> tuple[int, ...]:
        """vLLM's aux index is the stream ENTERING a layer: output of layer i = index i + 1."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def has_markov_head(self) -> bool:
        return self.markov_rank > 0

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def backbone(self) -> Backbone:
        """Decoder-layer kind: 'qwen3' (GQA, what the runners serve), 'gemma4' or 'mla'."""
        if self.mla is not None:
            return "mla"
        return "gemma4" if self.gemma4 is not None else "qwen3"

    @property
    def drafted_vocab_size(self) -> int:
        """Rows of the drafter's logits: the draft vocabulary, or the target's when there is none."""
        return self.draft_vocab_size or self.vocab_size

    def kv_cache_bytes_per_token(self, dtype: str | None = None) -> int:
        """Draft KV cache per context token, over all draft layers.

        GQA: layers x kv_heads x head_dim x (K and V) x bytes (the K3 GQA drafter:
        5 x 16 x 64 x 2 x 2 = 20,480 B). MLA caches one latent per token and layer
        that every head shares: layers x (kv_lora_rank + qk_rope_head_dim) x bytes
        (K3DSparkModel: 5 x (512 + 64) x 2 = 5,760 B).
        """
        nbytes = DTYPE_BYTES[dtype or self.dtype]
        if self.mla is not None:
            return self.num_hidden_layers * (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim) * nbytes
        return self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2 * nbytes

    # ------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str | None = None) -> DSparkConfig:
        """Parse a DSpark ``config.json`` dict of any known checkpoint family.

        :func:`vllm_dspark.config.families.parse` detects the family and
        maps its keys to this class's fields with that family's own defaults
        (its module docstring lists where the families differ). A key absent
        from a SpecForge export takes the field's default, except where
        SpecForge derives it from another key: ``num_key_value_heads`` (= heads),
        ``head_dim`` (= hidden / heads), ``enable_confidence_head``
        (= ``confidence_head_alpha > 0``, as the trainers decide),
        ``confidence_head_with_markov`` (= ``markov_rank > 0``) and
        ``sample_from_anchor`` (true for DSpark projectors; this project's older
        exports wrote ``query_layout: "one_plus_n"`` instead, still read).
        Three keys mean "not there" when absent: ``markov_rank`` (0: no Markov
        head), ``num_target_layers`` (unknown) and ``target_layer_ids`` (an error).

        Raises
        ------
        DSparkConfigError
            Listing every problem: the family's own (an unknown architecture, a
            speculators ``speculative_tokens`` that disagrees with its block and
            layout, ...) and every field check of :meth:`problems`.
        """
        from vllm_dspark.config.families import parse

        defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(cls)}
        parsed = parse(d, defaults)
        if parsed.family is None:
            raise DSparkConfigError(parsed.problems, source)
        try:
            cfg = cls(**parsed.fields)
        except DSparkConfigError as exc:
            raise DSparkConfigError(parsed.problems + exc.problems, source) from None
        except (TypeError, ValueError) as exc:
            raise DSparkConfigError(parsed.problems + [f"config.json: {exc}"], source) from None
        if parsed.problems:
            raise DSparkConfigError(parsed.problems, source)
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> DSparkConfig:
        """Read ``config.json`` (or a checkpoint directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise DSparkConfigError([f"config.json: not found at {path}; pass a DSpark checkpoint directory "
                                     "or its config.json"])
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DSparkConfigError([f"config.json: not valid JSON ({exc})"], str(path)) from None
        return cls.from_dict(d, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """The SpecForge-style ``config.json`` dict for this config (any family's Qwen3-layer drafter).

        Raises ``ValueError`` for the other backbones: SpecForge has no export
        format for Gemma4 or MLA draft layers.
        """
        if self.backbone != "qwen3":
            raise ValueError(f"to_hf_dict: {self.architecture} has {self.backbone} layers, which SpecForge's "
                             "export format cannot describe; keep its own config.json")
        rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        dc = {
            "attention_mode": self.attention_mode,
            "confidence_head_alpha": self.confidence_head_alpha,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "enable_confidence_head": self.enable_confidence_head,
            "markov_head_type": self.markov_head_type,
            "markov_rank": self.markov_rank,
            "mask_token_id": self.mask_token_id,
            "projector_type": self.projector_type,
            "target_layer_ids": list(self.target_layer_ids),
        }
        window: dict[str, Any] = {"layer_types": ["full_attention"] * self.num_hidden_layers, "sliding_window": None,
                  "use_sliding_window": False}
        if self.sliding_window is not None:
            window = {"layer_types": ["sliding_attention"] * self.num_hidden_layers,
                      "sliding_window": self.sliding_window, "use_sliding_window": True}
        if self.sample_from_anchor != (self.projector_type == "dspark"):
            # Written only where it differs from what the projector type implies: vLLM 0.33's
            # DFlash speculator (which its DSpark speculator builds on) refuses any config that
            # carries sample_from_anchor=True, and SpecForge's DSpark exports leave it out.
            dc["sample_from_anchor"] = self.sample_from_anchor
        d = {
            "architectures": ["DSparkDraftModel"],
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "dflash_config": dc,
            "dtype": self.dtype,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            **window,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "qwen3",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            **({"num_target_layers": self.num_target_layers} if self.num_target_layers is not None else {}),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": self.vocab_size,
        }
        if self.draft_vocab_size is not None:
            d["draft_vocab_size"] = self.draft_vocab_size  # top level, as SpecForge's draft-vocabulary exports
        if self.target_hidden_size is not None:
            d["target_hidden_size"] = self.target_hidden_size
        return d

    def replace(self, **changes: Any) -> DSparkConfig:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def field_docs() -> dict[str, str]:
        return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(DSparkConfig)}


def _positive_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _non_negative_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def _with_original_context(scaling: dict | None, max_position_embeddings: Any) -> dict | None:
    """YaRN's pre-scaling context as Hugging Face sets it: absent, it is ``max_position_embeddings``.

    (``PreTrainedConfig.standardize_rope_params``; vLLM reads the draft's HF
    config, which holds the same value, so the reference and the served
    drafter rotate alike.)
    """
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return scaling
    if scaling.get("original_max_position_embeddings") is not None:
        return scaling
    return {**scaling, "original_max_position_embeddings": max_position_embeddings}
