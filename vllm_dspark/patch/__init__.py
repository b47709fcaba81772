"""Patches to upstream vLLM 0.32, one file per patched module; see ``registry``.

Importing a patch module registers it; ``registry.apply_all`` applies them. ``handoff`` is
the one value two of them pass between each other.
"""

from vllm_dspark.patch import (  # noqa: F401  (registration)
    config_speculative,
    engine_arg_utils,
    platforms_cpu,
    triton_utils_dispatcher,
    v1_sample_rejection_sampler,
    v1_spec_decode_ngram_proposer,
    worker_cpu_worker,
    worker_gpu_model_runner,
    worker_gpu_worker,
)
from vllm_dspark.patch.registry import PATCHES, apply_all, describe, restore_all

__all__ = ["PATCHES", "apply_all", "describe", "restore_all"]
