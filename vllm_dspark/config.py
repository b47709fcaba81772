"""One validated configuration object for a DSpark drafter.

``DSparkConfig.from_dict`` reads a ``config.json`` exactly as SpecForge exports
it (top-level Qwen3 fields plus a ``dflash_config`` block). Every field has a
default and a one-line description; invalid combinations fail at construction
with a message that names the field, the value it got, what was expected, and
how to fix it. ``DSparkConfig.problems`` lists every problem at once, which is
what ``vllm-dspark inspect`` prints.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

MarkovHeadType = Literal["vanilla"]
MARKOV_HEAD_TYPES = ("vanilla",)
SUPPORTED_ATTENTION_MODES = ("gqa",)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class DSparkConfigError(ValueError):
    """A DSpark config that cannot be served; ``problems`` lists each reason."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        where = f" in {source}" if source else ""
        lines = "\n  - ".join(self.problems)
        super().__init__(f"invalid DSpark draft config{where}:\n  - {lines}")


def _desc(text: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    if default is dataclasses.MISSING:
        return field(metadata={"doc": text}, **kw)
    return field(default=default, metadata={"doc": text}, **kw)


@dataclass(frozen=True, kw_only=True)
class DSparkConfig:
    """Shape and behaviour of one DSpark drafter (see FACTS.md for the method)."""

    # --- backbone (Qwen3-style GQA decoder layers) ---
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
    markov_head_type: str = _desc("Markov head variant; only 'vanilla' (w2 @ w1[prev]) exists.", "vanilla")
    enable_confidence_head: bool = _desc(
        "Whether the checkpoint has a per-position confidence head (absent from an export: "
        "confidence_head_alpha > 0, as SpecForge's trainers decide).", True)
    confidence_head_with_markov: bool = _desc(
        "Confidence head also reads the Markov embedding of the previous token (absent: markov_rank > 0).", True)
    confidence_head_alpha: float = _desc("Training-time weight of the confidence loss.", 1.0)
    attention_mode: str = _desc("Draft attention kind; only 'gqa' is supported.", "gqa")
    projector_type: str = _desc("SpecForge projector type ('dspark' for this drafter).", "dspark")
    sample_from_anchor: bool = _desc(
        "True (anchor-first): queries [anchor, mask x (B-1)], every row predicts a draft, B drafts per block. "
        "False: the older DFlash layout [anchor, mask x N], only the masks predict, B - 1 drafts.", True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        problems = self.problems()
        if problems:
            raise DSparkConfigError(problems)

    # ------------------------------------------------------------------ checks
    def problems(self) -> list[str]:
        """Every reason this config cannot be served (empty when valid)."""
        p: list[str] = []

        def positive(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                p.append(f"{name}: got {v!r}, expected a positive integer; fix {name} in config.json")

        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", "block_size"):
            positive(name)
        if self.num_target_layers is not None:
            positive("num_target_layers")
        if p:
            return p  # later checks divide by these
        if self.num_attention_heads % self.num_key_value_heads:
            p.append(
                f"num_key_value_heads: got {self.num_key_value_heads}, which does not divide "
                f"num_attention_heads={self.num_attention_heads}; GQA needs heads % kv_heads == 0 "
                f"(e.g. num_key_value_heads={math.gcd(self.num_attention_heads, self.num_key_value_heads)})")
        if self.hidden_act != "silu":
            p.append(f"hidden_act: got {self.hidden_act!r}, expected 'silu' (Qwen3 SwiGLU MLP)")
        if self.attention_mode not in SUPPORTED_ATTENTION_MODES:
            p.append(f"dflash_config.attention_mode: got {self.attention_mode!r}, expected one of "
                     f"{SUPPORTED_ATTENTION_MODES}")
        if not self.target_layer_ids:
            p.append("dflash_config.target_layer_ids: empty; the drafter needs at least one target layer")
        for i in self.target_layer_ids:
            if i < 0:
                p.append(f"dflash_config.target_layer_ids: layer {i} is negative; ids are 0-based layer indices")
            elif self.num_target_layers is not None and i >= self.num_target_layers:
                p.append(
                    f"dflash_config.target_layer_ids: layer {i} is outside the target's "
                    f"{self.num_target_layers} layers (valid 0..{self.num_target_layers - 1}); "
                    f"check target_layer_ids against num_target_layers")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            p.append(f"dflash_config.target_layer_ids: duplicates in {list(self.target_layer_ids)}")
        if list(self.target_layer_ids) != sorted(self.target_layer_ids):
            p.append(f"dflash_config.target_layer_ids: {list(self.target_layer_ids)} is not ascending; "
                     "the fc weight's column blocks follow ascending layer order")
        if not 0 <= self.mask_token_id < self.vocab_size:
            p.append(f"dflash_config.mask_token_id: got {self.mask_token_id}, expected 0 <= id < "
                     f"vocab_size={self.vocab_size}")
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            p.append(f"dflash_config.markov_rank: got {self.markov_rank!r}, expected an integer >= 0")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            p.append(f"dflash_config.markov_head_type: got {self.markov_head_type!r}, expected one of "
                     f"{MARKOV_HEAD_TYPES}")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            p.append("dflash_config.confidence_head_with_markov: true but markov_rank is 0, so there is no "
                     "Markov embedding to read; set markov_rank > 0 or confidence_head_with_markov: false")
        if self.target_hidden_size is not None and self.target_hidden_size <= 0:
            p.append(f"target_hidden_size: got {self.target_hidden_size}, expected a positive integer")
        if self.dtype not in DTYPE_BYTES:
            p.append(f"dtype: got {self.dtype!r}, expected one of {sorted(DTYPE_BYTES)}")
        if self.rope_scaling is not None:
            rtype = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rtype not in ("yarn", "default", "linear", None):
                p.append(f"rope_parameters.rope_type: got {rtype!r}, supported: 'default', 'linear', 'yarn'")
            if rtype in ("yarn", "linear") and float(self.rope_scaling.get("factor", 0)) <= 0:
                p.append(f"rope_parameters.factor: got {self.rope_scaling.get('factor')!r}, expected > 0")
        if not self.sample_from_anchor and self.block_size < 2:
            p.append("block_size: sample_from_anchor false (the 1 + N layout) needs block_size >= 2 "
                     "(anchor + at least one mask)")
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

    def kv_cache_bytes_per_token(self, dtype: str | None = None) -> int:
        """Draft KV cache per context token: layers x kv_heads x head_dim x (K and V) x bytes."""
        nbytes = DTYPE_BYTES[dtype or self.dtype]
        return self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2 * nbytes

    # ------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str | None = None) -> DSparkConfig:
        """Parse a SpecForge-style DSpark ``config.json`` dict.

        A key absent from the export takes the field's default (the one default
        set, on the dataclass), except where SpecForge derives it from another
        key: ``num_key_value_heads`` (= heads), ``head_dim`` (= hidden / heads),
        ``enable_confidence_head`` (= ``confidence_head_alpha > 0``, as the
        trainers decide), ``confidence_head_with_markov`` (= ``markov_rank > 0``)
        and ``sample_from_anchor`` (true for DSpark projectors; this project's
        older exports wrote ``query_layout: "one_plus_n"`` instead, still read).
        Three keys mean "not there" when absent: ``markov_rank`` (0: no Markov
        head), ``num_target_layers`` (unknown) and ``target_layer_ids`` (an error).
        """
        dc = dict(d.get("dflash_config") or {})
        problems: list[str] = []
        archs = d.get("architectures") or []
        if archs and not any("DSpark" in a or "DFlash" in a for a in archs):
            problems.append(f"architectures: got {archs}, expected ['DSparkDraftModel'] (a DSpark export)")
        defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(cls)}

        def pick(key: str, default: Any = dataclasses.MISSING) -> Any:
            if key in dc:
                return dc[key]
            return d.get(key, defaults[key] if default is dataclasses.MISSING else default)

        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        rp = d.get("rope_parameters")
        if isinstance(rp, dict):
            rp = dict(rp)
            rope_theta = rp.pop("rope_theta", rope_theta)
            if rp.get("rope_type", rp.get("type", "default")) != "default":
                rope_scaling = rp
        heads = pick("num_attention_heads")
        hidden = pick("hidden_size")
        rank = pick("markov_rank", 0)
        alpha = float(pick("confidence_head_alpha"))
        if "sample_from_anchor" in dc or "sample_from_anchor" in d:
            from_anchor = bool(pick("sample_from_anchor"))
        elif dc.get("query_layout") is not None:
            from_anchor = dc["query_layout"] == "anchor_first"
            if dc["query_layout"] not in ("anchor_first", "one_plus_n"):
                problems.append(f"dflash_config.query_layout: got {dc['query_layout']!r}, expected "
                                "'anchor_first' or 'one_plus_n' (or use sample_from_anchor)")
        else:
            from_anchor = pick("projector_type") == "dspark"
        kwargs = dict(
            hidden_size=hidden, num_hidden_layers=pick("num_hidden_layers"), num_attention_heads=heads,
            num_key_value_heads=pick("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or (hidden // max(1, heads) if isinstance(hidden, int) and
                                           isinstance(heads, int) else defaults["head_dim"]),
            intermediate_size=pick("intermediate_size"), rms_norm_eps=float(pick("rms_norm_eps")),
            hidden_act=pick("hidden_act"), attention_bias=bool(pick("attention_bias")),
            vocab_size=pick("vocab_size"), max_position_embeddings=pick("max_position_embeddings"),
            rope_theta=float(rope_theta if rope_theta is not None else defaults["rope_theta"]),
            rope_scaling=rope_scaling, dtype=str(d.get("dtype", d.get("torch_dtype", defaults["dtype"]))),
            block_size=pick("block_size"), target_layer_ids=tuple(pick("target_layer_ids", ()) or ()),
            num_target_layers=pick("num_target_layers", None), target_hidden_size=pick("target_hidden_size"),
            mask_token_id=pick("mask_token_id", 0), markov_rank=rank, markov_head_type=pick("markov_head_type"),
            enable_confidence_head=bool(pick("enable_confidence_head", alpha > 0)),
            confidence_head_with_markov=bool(pick("confidence_head_with_markov", bool(rank))),
            confidence_head_alpha=alpha, attention_mode=pick("attention_mode"),
            projector_type=pick("projector_type"), sample_from_anchor=from_anchor,
        )
        if "mask_token_id" not in dc and "mask_token_id" not in d:
            problems.append("dflash_config.mask_token_id: missing; the drafter cannot build its query block")
        try:
            cfg = cls(**kwargs)
        except DSparkConfigError as exc:
            raise DSparkConfigError(problems + exc.problems, source) from None
        except TypeError as exc:
            raise DSparkConfigError(problems + [f"config.json: {exc}"], source) from None
        if problems:
            raise DSparkConfigError(problems, source)
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
        """The SpecForge-style ``config.json`` dict for this config."""
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
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "qwen3",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            **({"num_target_layers": self.num_target_layers} if self.num_target_layers is not None else {}),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope_parameters,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
        }
        if self.target_hidden_size is not None:
            d["target_hidden_size"] = self.target_hidden_size
        return d

    def replace(self, **changes: Any) -> DSparkConfig:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def field_docs() -> dict[str, str]:
        return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(DSparkConfig)}
