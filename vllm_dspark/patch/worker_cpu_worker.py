"""Patch of ``vllm.v1.worker.cpu_worker``: tell the DSpark proposer when the engine is warm.

Budgeted verification needs the target's step time by batch size, which can
only be measured once the KV cache exists and the model is warm: right after
``CPUWorker.compile_or_warm_up_model``. The proposer then profiles (or loads its
cached profile), see ``vllm_dspark.spec_decode.common.profile``.
"""

from __future__ import annotations

from vllm_dspark.patch.registry import Patch, register_patch


def make_engine_ready_hook(original):
    """``compile_or_warm_up_model`` that then calls the DSpark proposer's ``on_engine_ready``."""
    def compile_or_warm_up_model(self):
        out = original(self)
        drafter = getattr(getattr(self, "model_runner", None), "drafter", None)
        hook = getattr(drafter, "on_engine_ready", None)
        if callable(hook):
            hook()
        return out
    return compile_or_warm_up_model


PATCH = register_patch(Patch(
    name="cpu-worker-dspark-engine-ready",
    module="vllm.v1.worker.cpu_worker",
    attribute="CPUWorker.compile_or_warm_up_model",
    what="after warm-up, a DSpark proposer profiles (or loads) the budget's cost model",
    why="the target's verify cost can only be measured with the KV cache allocated and the model warm",
    versions=("0.32",),
    removable_when="vLLM gives proposers a post-warm-up hook",
    make=make_engine_ready_hook,
))
