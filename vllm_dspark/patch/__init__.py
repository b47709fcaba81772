"""Patches to upstream vLLM, one file per patched module; see ``registry``.

Importing a patch module registers it; ``registry.apply_all`` applies them.
"""

from vllm_dspark.patch import config_speculative, worker_gpu_model_runner  # noqa: F401  (registration)
from vllm_dspark.patch import v1_sample_rejection_sampler  # noqa: F401  (registration)
from vllm_dspark.patch.registry import PATCHES, apply_all, describe, restore_all

__all__ = ["PATCHES", "apply_all", "describe", "restore_all"]
