"""Patch of ``vllm.platforms.cpu``: a CPU KV-cache size that starts, one-line memory errors, and a
warning when speculation runs in emulated bf16 (``serving.cpu_flags.emulated_bf16_note``).

vLLM's CPU platform sizes the KV cache from ``VLLM_CPU_KVCACHE_SPACE`` when it is
set (in ``CpuPlatform.check_and_update_config``, while ``VllmConfig`` is built);
otherwise each CPU worker reserves ``--gpu-memory-utilization`` (0.92) of the NUMA
node's memory and refuses to start when less is available, which is the case on
any machine running something else. This patch runs right after the original, in
the process that builds the config (before any engine or worker process exists),
and applies ``vllm_dspark.serving.memory.plan_kv_cache``: a default KV size when
none was chosen (it travels to every process inside the config), or a
:class:`~vllm_dspark.serving.memory.DSparkMemoryError` naming the setting to change.
"""

from __future__ import annotations

import logging
import os
import threading

from vllm_dspark.patch.registry import Patch, register_patch

logger = logging.getLogger("vllm_dspark")

# Set while EngineArgs.create_engine_config builds a config from the user's arguments. vLLM
# re-runs VllmConfig.__post_init__ (so this platform hook) in the engine-core process after the
# KV cache is allocated; the memory there is then no longer free, and a check would refuse the
# very cache it allocated. So the fit checks run only while a config is built from arguments.
_building = threading.local()


def _from_arguments() -> bool:
    return getattr(_building, "depth", 0) > 0


def _make(original):
    func = original.__func__  # a classmethod in the class __dict__

    def check_and_update_config(cls, vllm_config):
        from vllm_dspark.serving import memory

        cache_config = vllm_config.cache_config
        explicit = cache_config.kv_cache_memory_bytes
        func(cls, vllm_config)
        if explicit is not None and not _from_arguments():
            return  # a config already planned (the engine core's re-run): nothing to decide
        node, total, available = memory.node_memory()
        parallel = getattr(vllm_config, "parallel_config", None)
        plan = memory.plan_kv_cache(env_value=os.environ.get(memory.ENV), explicit_bytes=explicit,
                                    kv_bytes_after=cache_config.kv_cache_memory_bytes,
                                    utilization=cache_config.gpu_memory_utilization, total=total,
                                    available=available, workers=getattr(parallel, "world_size", 1) or 1,
                                    node=node, check=_from_arguments())
        from vllm_dspark.log import share_vllm_logging
        from vllm_dspark.serving.cpu_flags import emulated_bf16_note

        note = emulated_bf16_note(str(getattr(vllm_config.model_config, "dtype", "")),
                                  getattr(vllm_config, "speculative_config", None) is not None)
        if plan.kv_bytes is not None or note:
            share_vllm_logging()  # vLLM configures its handlers after the plugin loaded in this process
        if plan.kv_bytes is not None:
            cache_config.kv_cache_memory_bytes = plan.kv_bytes
            logger.info("vllm_dspark: %s", plan.message)
        if note:
            logger.warning("vllm_dspark: %s", note)

    return classmethod(check_and_update_config)


def _make_marker(original):
    def create_engine_config(self, *args, **kwargs):
        _building.depth = getattr(_building, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _building.depth -= 1

    return create_engine_config


PATCH = register_patch(Patch(
    name="cpu-platform-kv-cache-default",
    module="vllm.platforms.cpu",
    attribute="CpuPlatform.check_and_update_config",
    what="with no KV size chosen, the CPU KV cache gets min(4 GiB, a quarter of the available memory); "
         "speculation in emulated bf16 is warned about; "
         "a size that cannot fit fails with one line naming the setting",
    why="vLLM's CPU default (--gpu-memory-utilization 0.92 of the NUMA node) refuses to start on any machine "
        "that runs anything else, with a traceback from the worker process",
    versions=("0.32",),
    removable_when="vLLM's CPU backend sizes its KV cache from the available memory",
    make=_make,
))

MARKER = register_patch(Patch(
    name="engine-args-config-from-arguments",
    module="vllm.engine.arg_utils",
    attribute="EngineArgs.create_engine_config",
    what="marks the config being built from the user's arguments, for the CPU memory checks",
    why="vLLM re-runs the platform's config hook in the engine core after allocating the KV cache; the "
        "memory fit can only be judged before (cpu-platform-kv-cache-default)",
    versions=("0.32",),
    removable_when="cpu-platform-kv-cache-default goes",
    make=_make_marker,
))
