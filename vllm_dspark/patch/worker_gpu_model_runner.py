"""Patch of ``vllm.v1.worker.gpu_model_runner``: use the DSpark proposer for DSpark drafts.

The V1 runner builds a ``DFlashProposer`` for every DFlash-path draft. For a
draft that ``config_speculative`` marked as DSpark, this patch replaces it,
right after the runner is built and before any model is loaded, with
``vllm_dspark.spec_decode.proposer_v1.DSparkProposer`` (a subclass, so every
``isinstance`` check in the runner still holds). The CPU runner inherits it.
"""

from __future__ import annotations

from vllm_dspark.patch.registry import Patch, register_patch


def _is_dspark_draft(vllm_config) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    return bool(draft is not None and getattr(draft.hf_config, "dspark_v1", False))


def _make_init(original):
    def __init__(self, vllm_config, device, *args, **kwargs):
        original(self, vllm_config, device, *args, **kwargs)
        if _is_dspark_draft(vllm_config) and hasattr(self, "drafter"):
            from vllm_dspark.spec_decode.proposer_v1 import DSparkProposer

            self.drafter = DSparkProposer(vllm_config, self.device, self)
    return __init__


PATCH = register_patch(Patch(
    name="v1-runner-dspark-proposer",
    module="vllm.v1.worker.gpu_model_runner",
    attribute="GPUModelRunner.__init__",
    what="after the runner is built, a DSpark-marked draft gets DSparkProposer instead of DFlashProposer",
    why="the V1 runner chooses its proposer class by method and knows no DSpark proposer",
    versions=("0.32",),
    removable_when="vLLM's V1 runner constructs a DSpark proposer itself (or takes a proposer class hook)",
    make=_make_init,
))
