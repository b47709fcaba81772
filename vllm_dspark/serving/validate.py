"""Can this draft be served with this target? Checked before vLLM builds anything.

A bad draft fails at start-up with ONE message listing every problem (missing
files, shapes, vocabulary, layer ids, settings), instead of a traceback from
deep inside vLLM or, worse, a drafter that loads and proposes garbage.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dspark.config import DSparkConfig, DSparkConfigError
from vllm_dspark.serving.compat import check_target_compat, ensure_k3_aux_attn_res_stream
from vllm_dspark.serving.settings import DSparkSettings, DSparkSettingsError, resolve_settings


class DSparkDraftError(ValueError):
    """The DSpark draft cannot be served; the message lists every reason and the fix."""


@dataclass(frozen=True)
class DraftFiles:
    """A SpecForge DSpark export's directory and its ``config.json``, read once for the whole start-up."""

    path: Path
    raw: dict


def read_dspark_draft(model_path: Any) -> DraftFiles | None:
    """The draft's directory and config.json if it is a SpecForge DSpark export (Qwen3 GQA backbone), else None."""
    if not model_path:
        return None
    path = Path(str(model_path))
    try:
        d = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if isinstance(d, dict) and "DSparkDraftModel" in (d.get("architectures") or []) and d.get("model_type") == "qwen3":
        return DraftFiles(path, d)
    return None


def validate_draft_for_serving(draft: DraftFiles, target_hf_config: Any, *, num_speculative_tokens: int | None,
                               served_context: int, spec_options: Mapping[str, Any] | None = None,
                               environ: Mapping[str, str] | None = None
                               ) -> tuple[DSparkConfig, DSparkSettings]:
    """Validate a draft against its target and resolve its settings.

    Returns the draft's :class:`DSparkConfig` and the :class:`DSparkSettings`
    to serve it with. Raises :class:`DSparkDraftError` listing every problem.
    """
    from vllm_dspark.checkpoint.io import validate_checkpoint

    path = draft.path
    problems: list[str] = []
    cfg: DSparkConfig | None = None
    try:
        cfg = DSparkConfig.from_dict(draft.raw, source=str(path / "config.json"))
    except DSparkConfigError as exc:
        problems += exc.problems
    settings = None
    if cfg is not None:
        problems += validate_checkpoint(path, scan_values=False, config=cfg).problems
        if target_hf_config is not None:
            problems += check_target_compat(cfg, target_hf_config).problems
        try:
            settings = resolve_settings(cfg, draft=str(path), dflash_config=draft.raw.get("dflash_config"),
                                        spec_options=spec_options, num_speculative_tokens=num_speculative_tokens,
                                        served_context=served_context, environ=environ)
        except DSparkSettingsError as exc:
            problems += exc.problems
    if problems:
        lines = "\n  - ".join(problems)
        raise DSparkDraftError(f"DSpark draft {path} cannot be served with this target:\n  - {lines}")
    assert cfg is not None and settings is not None
    if target_hf_config is not None:
        ensure_k3_aux_attn_res_stream(target_hf_config, cfg)
    return cfg, settings
