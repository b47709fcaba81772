"""CPU memory for vLLM's KV cache: a default that starts, and one-line errors when it cannot.

vLLM's CPU backend reads ``--gpu-memory-utilization`` (default 0.92) as the share
of the NUMA node's *total* memory each worker reserves, and refuses to start when
the node has less than that *available* ("Available memory on node 0 ... is less
than desired CPU memory utilization"). On any machine that runs anything else,
the default therefore fails. ``VLLM_CPU_KVCACHE_SPACE`` (GiB) or
``--kv-cache-memory-bytes`` fixes the KV cache's size instead.

What the plugin does on the CPU platform (``vllm_dspark.patch.platforms_cpu``,
right after vLLM's own ``CpuPlatform.check_and_update_config``, in the process
that builds the config, before any engine process exists):

* No KV size chosen (``VLLM_CPU_KVCACHE_SPACE`` unset, no ``--kv-cache-memory-bytes``,
  ``--gpu-memory-utilization`` left at vLLM's default): each worker's KV cache gets
  ``min(4 GiB, a quarter of the node's available memory / workers)``, logged in one
  line that says how to choose another size. The size travels to the engine and
  worker processes inside vLLM's config.
* A size that cannot fit (a KV cache larger than the available memory, or a
  ``--gpu-memory-utilization`` share the node does not have): :class:`DSparkMemoryError`,
  one line naming the setting to change and a value that fits, raised before any
  engine process starts (``vllm serve`` and ``scripts/batch_generate.py`` print it
  without a traceback). Checked only while ``EngineArgs.create_engine_config`` builds
  the config from the user's arguments: the engine core re-runs the hook after it
  allocated the cache, when that memory is no longer free.

A size that fits now can still fail later, in the worker, when the weights take the
rest (vLLM's "on kv cache allocation" error): ``batch_generate.py`` then ends with one
line naming ``--kv-cache-gib`` under the engine's own log.

The decisions are pure functions of numbers (:func:`plan_kv_cache`), tested without vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 1 << 30
ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_CAP = 4 * GiB  # what vLLM's own docs call the CPU KV cache's default size
DEFAULT_SHARE = 0.25  # of the node's available memory, split over the node's workers
MIN_DEFAULT = 256 << 20  # below this the default would not hold a useful cache: say so instead
VLLM_DEFAULT_UTILIZATION = 0.92  # vLLM's CacheConfig.gpu_memory_utilization default


class DSparkMemoryError(ValueError):
    """vLLM cannot start for memory; the message names the one setting to change."""


@dataclass(frozen=True)
class KVPlan:
    """What to do with the config: ``kv_bytes`` to set (None: leave it), and a line to log."""

    kv_bytes: int | None
    message: str | None


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _fits_gib(available: int, workers: int) -> int:
    """The largest whole VLLM_CPU_KVCACHE_SPACE (GiB) that leaves room: half the available memory."""
    return max(1, int(available * 0.5 / max(1, workers) // GiB))


def plan_kv_cache(*, env_value: str | None, explicit_bytes: int | None, kv_bytes_after: int | None,
                  utilization: float, total: int, available: int, workers: int = 1,
                  node: int = 0, check: bool = True) -> KVPlan:
    """Decide the CPU KV cache size, or raise :class:`DSparkMemoryError` naming the fix.

    ``env_value``: ``VLLM_CPU_KVCACHE_SPACE`` as set ('' or None: unset);
    ``explicit_bytes``: ``kv_cache_memory_bytes`` before vLLM read the environment
    (``--kv-cache-memory-bytes``); ``kv_bytes_after``: after it; ``utilization``:
    ``gpu_memory_utilization``; ``total``/``available``: the NUMA node's memory
    (as vLLM's worker reads it); ``workers``: processes that each allocate a KV cache;
    ``check``: refuse what cannot fit (False: only decide the default).
    """
    workers = max(1, workers)
    where = f"NUMA node {node} has {gib(available)} available of {gib(total)}"
    if env_value not in (None, ""):
        if check and kv_bytes_after is not None and kv_bytes_after > available:
            raise DSparkMemoryError(
                f"{ENV}={env_value} asks for a {gib(kv_bytes_after)} KV cache, but {where}; "
                f"lower it, e.g. {ENV}={_fits_gib(available, workers)}")
        return KVPlan(None, None)
    if explicit_bytes is not None:
        if check and explicit_bytes > available:
            raise DSparkMemoryError(
                f"--kv-cache-memory-bytes {explicit_bytes} asks for a {gib(explicit_bytes)} KV cache, but "
                f"{where}; lower it, e.g. --kv-cache-memory-bytes "
                f"{_fits_gib(available, workers) * GiB} (or set {ENV}=<GiB>)")
        return KVPlan(None, None)
    if not math.isclose(utilization, VLLM_DEFAULT_UTILIZATION):
        # The user chose vLLM's share-of-node rule; check it the way vLLM's CPU worker will.
        requested = math.ceil(total * utilization)
        if check and requested > available:
            share = math.floor(available / total * 0.9 * 100) / 100
            raise DSparkMemoryError(
                f"--gpu-memory-utilization {utilization} reserves {gib(requested)} of CPU memory per worker "
                f"(vLLM's CPU backend reads it as a share of the node's memory), but {where}; lower it "
                f"(e.g. --gpu-memory-utilization {max(share, 0.01):.2f}) or set {ENV}=<GiB> to size the "
                "KV cache instead")
        return KVPlan(None, None)
    kv = int(min(DEFAULT_CAP, available * DEFAULT_SHARE / workers))
    if check and kv < MIN_DEFAULT:
        raise DSparkMemoryError(
            f"{where}: too little for a KV cache (a quarter of it is {gib(kv)} per worker); free memory, or set "
            f"{ENV}=<GiB> (or --kv-cache-memory-bytes) to the size you want")
    per = f" per worker ({workers} workers)" if workers > 1 else ""
    msg = (f"CPU KV cache: {gib(kv)}{per} ({ENV} is unset, so vllm_dspark uses the smaller of 4 GiB and a "
           f"quarter of the {gib(available)} available on NUMA node {node}); to choose, set {ENV}=<GiB> or "
           "--kv-cache-memory-bytes, or pass --gpu-memory-utilization for vLLM's share-of-node rule")
    return KVPlan(kv, msg)


def node_memory() -> tuple[int, int, int]:
    """``(node, total, available)`` of the NUMA node vLLM's CPU worker will use, as it reads them."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info, get_visible_memory_node

    nodes = get_visible_memory_node()
    try:
        node = get_allowed_cpu_list()[0].numa_node
    except (IndexError, AttributeError):
        node = nodes[0] if nodes else 0
    if nodes and node not in nodes:
        node = nodes[0]
    info = get_memory_node_info(node)
    return node, int(info.total_memory), int(info.available_memory)


def is_memory_error(exc: BaseException) -> bool:
    """vLLM's own start-up refusal for memory (raised in the worker, or ours)."""
    text = str(exc)
    return isinstance(exc, DSparkMemoryError) or ("Available memory on node" in text and "GiB" in text)
