"""Can this draft be served with this target? Checked before vLLM builds anything.

A bad draft fails at start-up with ONE message listing every problem (missing
files, shapes, vocabulary, layer ids, settings), instead of a traceback from
deep inside vLLM or, worse, a drafter that loads and proposes garbage.

Every DSpark checkpoint family is recognised here (not only SpecForge's), so a
drafter this runner cannot serve is refused by name with what does serve it,
instead of reaching vLLM's "Model Runner V1 does not support: dspark":

* :func:`v1_runner_refusal`: drafters whose layers the V1 path does not run
  (Gemma4DSparkModel, K3DSparkModel) or whose name would route them to vLLM's
  plain DFlash model; one line, before anything else is checked;
* :func:`in_progress_refusals`: what parses and validates but is not served
  yet, kept in one function so it is lifted in one place (empty today: the
  DeepSpec and speculators layouts, checkpoint draft vocabularies and gated /
  rnn Markov heads are all served on V1).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dspark.config import DSparkConfig, DSparkConfigError
from vllm_dspark.config.families import is_dspark_config
from vllm_dspark.serving.compat import check_target_compat, ensure_k3_aux_attn_res_stream
from vllm_dspark.serving.settings import DSparkSettings, DSparkSettingsError, resolve_settings


class DSparkDraftError(ValueError):
    """The DSpark draft cannot be served; the message lists every reason and the fix."""


V2_RUNNER = "vLLM 0.33's V2 model runner (method 'dspark' on a CUDA GPU)"


def v1_runner_refusal(cfg: DSparkConfig) -> str | None:
    """One line when the V1 runner's DSpark path cannot run this drafter at all, else None.

    The V1 path runs Qwen3 GQA draft layers, reached through vLLM's DFlash
    model registry under ``"DFlash" + architectures[0]``: other layers have no
    model there, and a SpecForge export named ``DFlashDraftModel`` would load as
    vLLM's own DFlash drafter, whose Markov head is never applied.
    """
    if cfg.backbone != "qwen3":
        kind = {"mla": "MLA (multi-head latent attention)", "gemma4": "Gemma4"}[cfg.backbone]
        return (f"{cfg.architecture} ({kind} draft layers) is not served on vLLM 0.32's V1 runner, which runs Qwen3 "
                f"GQA DSpark drafters only; serve it with {V2_RUNNER}, which loads {cfg.architecture} drafters")
    if cfg.family == "specforge" and cfg.architecture != "DSparkDraftModel":
        dropped = (", vLLM's plain DFlash drafter, which drops the Markov head"
                   if cfg.architecture == "DFlashDraftModel" else "")
        return (f"architectures: {cfg.architecture} (a SpecForge export, projector_type {cfg.projector_type!r}); the "
                f"V1 runner's DSpark model is registered for the name DSparkDraftModel only, and vLLM resolves this "
                f"one to another model{dropped}: set \"architectures\": [\"DSparkDraftModel\"] in config.json "
                "(the tensors are the same)")
    return None


def in_progress_refusals(cfg: DSparkConfig) -> list[str]:
    """What parses and validates but is not served yet, one line each (issue 30; remove a check when it lands).

    Empty today for every Qwen3-layer drafter: the DeepSpec and speculators layouts are presented to
    vLLM as SpecForge exports (``patch/config_speculative.py``) and their tensors loaded by name,
    checkpoint draft vocabularies (own ``lm_head`` [Vd, H], ``d2t``) are drafted through the Markov
    stage's ``DraftVocab``, gated and rnn heads in Python (``spec_decode/common/heads.py``). Kept as
    the one place a future not-yet-served variant is refused by name.
    """
    del cfg
    return []


def draft_vocab_problems(settings: DSparkSettings, target_vocab: int) -> list[str]:
    """Why the ``draft_vocab`` setting cannot be served with its table (empty when it can)."""
    from vllm_dspark.checkpoint.token_frequency import FrequencyTableError, load_frequency_table

    n, path = settings.draft_vocab, settings.draft_vocab_table
    src = settings.source("draft_vocab_table")
    try:
        table = load_frequency_table(str(path))
    except FrequencyTableError as exc:
        return [f"draft_vocab {n} needs a token frequency table, and draft_vocab_table ({src}) cannot be used: "
                f"{exc}, or set draft_vocab_table to one (or draft_vocab to 'off')"]
    if table.vocab_size != target_vocab:
        return [f"draft_vocab_table ({src}): {path} counts a vocabulary of {table.vocab_size} tokens, but the "
                f"target's has {target_vocab}; build the table with the target's tokenizer (vllm-dspark "
                "vocab-table --tokenizer TARGET_DIR ...)"]
    return []


@dataclass(frozen=True)
class DraftFiles:
    """A DSpark draft's directory and its ``config.json`` (any family), read once for the whole start-up."""

    path: Path
    raw: dict


def read_dspark_draft(model_path: Any) -> DraftFiles | None:
    """The draft's directory and config.json if it claims to be a DSpark drafter (any family), else None.

    Every family is taken, also those this runner refuses: the refusal then
    names the drafter and what serves it.
    """
    if not model_path:
        return None
    path = Path(str(model_path))
    try:
        d = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if is_dspark_config(d):
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
        refusal = v1_runner_refusal(cfg)
        if refusal is not None:
            raise DSparkDraftError(f"DSpark draft {path}: {refusal}")
        problems += in_progress_refusals(cfg)
        problems += validate_checkpoint(path, scan_values=False, config=cfg).problems
        target_vocab = cfg.vocab_size
        if target_hf_config is not None:
            compat = check_target_compat(cfg, target_hf_config)
            problems += compat.problems
            target_vocab = compat.target_vocab_size or target_vocab
        try:
            settings = resolve_settings(cfg, draft=str(path), dflash_config=draft.raw.get("dflash_config"),
                                        spec_options=spec_options, num_speculative_tokens=num_speculative_tokens,
                                        served_context=served_context, environ=environ)
        except DSparkSettingsError as exc:
            problems += exc.problems
        if settings is not None and settings.draft_vocab is not None:
            problems += draft_vocab_problems(settings, target_vocab)
    if problems:
        lines = "\n  - ".join(problems)
        raise DSparkDraftError(f"DSpark draft {path} cannot be served with this target:\n  - {lines}")
    assert cfg is not None and settings is not None
    if target_hf_config is not None:
        ensure_k3_aux_attn_res_stream(target_hf_config, cfg)
    return cfg, settings
