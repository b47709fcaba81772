"""Drafter geometries that only some checkpoint families have, and the documented-field helper.

Kept apart from ``config/__init__.py`` so that ``families.py`` (which ``DSparkConfig`` calls) can
name them without importing the package's ``__init__`` back: no import cycle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _desc(text: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    if default is dataclasses.MISSING:
        return field(metadata={"doc": text}, **kw)
    return field(default=default, metadata={"doc": text}, **kw)


@dataclass(frozen=True, kw_only=True)
class MLAShape:
    """Multi-head latent attention geometry of an MLA drafter (K3DSparkModel), as DeepSeek-V2 defines it."""

    q_lora_rank: int | None = _desc("Rank of the query down-projection (q_a_proj); None: a full-rank q_proj.", 1536)
    kv_lora_rank: int = _desc("Width of the compressed KV latent the cache stores per token and layer.", 512)
    qk_nope_head_dim: int = _desc("Per-head query/key width without rotary embedding.", 128)
    qk_rope_head_dim: int = _desc("Per-head query/key width with rotary embedding (also cached per token).", 64)
    v_head_dim: int = _desc("Per-head value width.", 128)
    output_gate: bool = _desc("Whether attention has a sigmoid output gate (g_proj [heads * v_head_dim, H]).", False)


@dataclass(frozen=True, kw_only=True)
class Gemma4Shape:
    """Gemma4 decoder-layer specifics of a Gemma4DSparkModel drafter (DeepSpec)."""

    shared_kv_projection: bool = _desc("attention_k_eq_v: keys and values come from k_proj (no v_proj).", False)
    double_wide_mlp_layers: tuple[int, ...] = _desc(
        "Draft layers whose MLP is 2 x intermediate_size (use_double_wide_mlp on KV-shared layers).", ())
