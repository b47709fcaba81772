"""Patch of ``vllm.config.speculative``: route ``method: "dspark"`` to the V1 runner.

vLLM 0.32 implements DSpark only in its V2 GPU model runner and refuses it on V1
(the CPU backend, and GPU users on V1). On V1, the DFlash proposer path already
does what DSpark's parallel backbone needs (aux hidden states, context-KV
precompute, non-causal block attention), so for a SpecForge DSpark export this
patch lets ``SpeculativeConfig`` resolve the draft as a DFlash draft and marks
it as DSpark; ``worker_gpu_model_runner`` then swaps in the DSpark proposer and
the model registry supplies the DSpark draft model (``DFlashDSparkDraftModel``).

Before anything is built it validates the draft directory and its fit to the
target, so a bad draft fails at start-up with one message.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from vllm_dspark.patch.registry import Patch, register_patch

logger = logging.getLogger("vllm_dspark")

DSPARK_V1_ARCH = "DFlashDSparkDraftModel"


class DSparkDraftError(ValueError):
    """The DSpark draft cannot be served; the message lists every reason and the fix."""


def _uses_v1_runner() -> bool:
    import vllm.envs as envs
    from vllm.platforms import current_platform

    if envs.VLLM_USE_V2_MODEL_RUNNER is False:
        return True
    return bool(current_platform.is_cpu())


def _specforge_dspark_config(model_path) -> dict | None:
    """The draft's config.json if it is a SpecForge DSpark export (Qwen3 GQA backbone)."""
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


def validate_draft_for_serving(model_path: str, target_hf_config, num_speculative_tokens: int | None):
    """Validate a DSpark draft directory against its target. Returns (DSparkConfig, N)."""
    from vllm_dspark.checkpoint.io import validate_checkpoint
    from vllm_dspark.deploy.compat import check_target_compat, ensure_k3_aux_attn_res_stream

    path = Path(model_path)
    problems: list[str] = []
    if not path.is_dir():
        raise DSparkDraftError(f"DSpark draft {model_path!r} is not a directory; pass the directory holding "
                               "the SpecForge export (config.json + model.safetensors)")
    report = validate_checkpoint(path, scan_values=False)
    problems += report.problems
    cfg = report.config
    n = num_speculative_tokens
    if cfg is not None:
        if target_hf_config is not None:
            problems += check_target_compat(cfg, target_hf_config).problems
        if n is None:
            n = cfg.num_draft_tokens
        elif n > cfg.num_draft_tokens:
            problems.append(
                f"num_speculative_tokens: got {n}, but this drafter proposes at most {cfg.num_draft_tokens} "
                f"tokens per step (block_size {cfg.block_size}, {cfg.query_layout} layout); set "
                f"num_speculative_tokens <= {cfg.num_draft_tokens}")
        elif n < 1:
            problems.append(f"num_speculative_tokens: got {n}, expected 1..{cfg.num_draft_tokens}")
    if problems:
        lines = "\n  - ".join(problems)
        raise DSparkDraftError(f"DSpark draft {model_path} cannot be served with this target:\n  - {lines}")
    if target_hf_config is not None:
        ensure_k3_aux_attn_res_stream(target_hf_config, cfg)
    return cfg, n


def _make_post_init(original):
    def __post_init__(self):
        spec_cfg = _specforge_dspark_config(self.model) if self.method == "dspark" else None
        if spec_cfg is None or not _uses_v1_runner():
            return original(self)
        from vllm_dspark.spec_decode.settings import resolve_threshold

        target_hf = getattr(self.target_model_config, "hf_config", None)
        cfg, n_user = validate_draft_for_serving(self.model, target_hf, self.num_speculative_tokens)
        threshold, source = resolve_threshold(spec_cfg.get("dflash_config"))
        # vLLM sizes lookahead slots and per-position metrics from num_speculative_tokens:
        # the drafter always runs its full trained block, and the proposer keeps
        # the first n_user tokens (and cuts further on low confidence).
        self.method = "dflash"
        self.num_speculative_tokens = cfg.num_draft_tokens
        original(self)
        hf = self.draft_model_config.hf_config
        hf.dspark_num_draft_tokens = n_user
        hf.dspark_confidence_threshold = threshold
        hf.dspark_threshold_source = source
        hf.dspark_v1 = True
        logger.info("vllm_dspark: serving DSpark draft %s on the V1 runner: block %d, %d drafts kept per "
                    "step, early-stop threshold %g (%s)", self.model, cfg.block_size, n_user, threshold, source)
    return __post_init__


PATCH = register_patch(Patch(
    name="speculative-config-dspark-v1",
    module="vllm.config.speculative",
    attribute="SpeculativeConfig.__post_init__",
    what="method 'dspark' with a SpecForge DSpark export resolves as a DFlash-path draft marked DSpark, "
         "after validating the draft against the target",
    why="vLLM 0.32 refuses 'dspark' on the V1 model runner (its only DSpark path is the V2 GPU runner)",
    versions=("0.32",),
    removable_when="vLLM's V1 runner accepts method 'dspark', or the CPU backend runs the V2 runner",
    make=_make_post_init,
))
