"""Can this draft be served with this target? Checked before vLLM builds anything.

A bad draft fails at start-up with ONE message listing every problem (missing
files, shapes, vocabulary, layer ids, settings), instead of a traceback from
deep inside vLLM or, worse, a drafter that loads and proposes garbage.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_dspark.config import DSparkConfig
from vllm_dspark.serving.compat import check_target_compat, ensure_k3_aux_attn_res_stream
from vllm_dspark.serving.settings import DSparkSettings, DSparkSettingsError, resolve_settings


class DSparkDraftError(ValueError):
    """The DSpark draft cannot be served; the message lists every reason and the fix."""


def specforge_dspark_config(model_path: Any) -> dict | None:
    """The draft's config.json if it is a SpecForge DSpark export (Qwen3 GQA backbone), else None."""
    if not model_path:
        return None
    cfg = Path(str(model_path)) / "config.json"
    if not cfg.is_file():
        return None
    try:
        d = json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if "DSparkDraftModel" in (d.get("architectures") or []) and d.get("model_type") == "qwen3":
        return d
    return None


def validate_draft_for_serving(model_path: str, target_hf_config: Any, *, num_speculative_tokens: int | None,
                               served_context: int, spec_options: Mapping[str, Any] | None = None,
                               environ: Mapping[str, str] | None = None
                               ) -> tuple[DSparkConfig, DSparkSettings]:
    """Validate a draft directory against its target and resolve its settings.

    Returns the draft's :class:`DSparkConfig` and the :class:`DSparkSettings`
    to serve it with. Raises :class:`DSparkDraftError` listing every problem.
    """
    from vllm_dspark.checkpoint.io import validate_checkpoint

    path = Path(model_path)
    if not path.is_dir():
        raise DSparkDraftError(f"DSpark draft {model_path!r} is not a directory; pass the directory holding "
                               "the SpecForge export (config.json + model.safetensors)")
    report = validate_checkpoint(path, scan_values=False)
    problems = list(report.problems)
    cfg = report.config
    settings = None
    if cfg is not None:
        if target_hf_config is not None:
            problems += check_target_compat(cfg, target_hf_config).problems
        raw = json.loads((path / "config.json").read_text())
        try:
            settings = resolve_settings(cfg, draft=str(path), dflash_config=raw.get("dflash_config"),
                                        spec_options=spec_options, num_speculative_tokens=num_speculative_tokens,
                                        served_context=served_context, environ=environ)
        except DSparkSettingsError as exc:
            problems += str(exc).split("\n  - ")[1:] or [str(exc)]
    if problems:
        lines = "\n  - ".join(problems)
        raise DSparkDraftError(f"DSpark draft {model_path} cannot be served with this target:\n  - {lines}")
    assert cfg is not None and settings is not None
    if target_hf_config is not None:
        ensure_k3_aux_attn_res_stream(target_hf_config, cfg)
    return cfg, settings
