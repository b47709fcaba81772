"""Patch of ``vllm.v1.spec_decode.ngram_proposer``: numba's thread pool is sized like the worker's.

vLLM's CPU worker binds its main thread to one core before it builds the n-gram
proposer. Numba, imported with the proposer, sizes its OpenMP pool from that
one-core affinity (one thread), and starting that pool sets the OpenMP thread
count of the thread that runs the target model to the pool's size. From then on
the target decodes on one thread, whatever the worker was given.

Seen here (2 cores, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, so the worker has 2
threads): with n-gram the worker kept one core busy and the engine core spun on
the other; without speculation both cores computed. n-gram's greedy outputs
matched a one-thread engine's. ``NUMBA_NUM_THREADS`` set to the worker's thread
count before numba loads keeps both threads. With one compute thread (vLLM's
default reservation of a core for the engine on this machine) nothing changes.

The patch is lazy (importing this module here would import numba in every vLLM
process, see ``registry``): just before the module loads, ``NUMBA_NUM_THREADS``
is set to torch's thread count in that process, unless the user set it. The
replaced ``__init__`` records the pool size it got, and warns when numba was
loaded earlier with a smaller one.
"""

from __future__ import annotations

import logging
import os
import sys

from vllm_dspark.patch.registry import Patch, register_patch

logger = logging.getLogger("vllm_dspark")
_ENV = "NUMBA_NUM_THREADS"


def size_numba_pool() -> None:
    """Set ``NUMBA_NUM_THREADS`` to torch's thread count if numba is not loaded and the user left it unset."""
    if _ENV in os.environ or "numba" in sys.modules:
        return
    import torch

    os.environ[_ENV] = str(torch.get_num_threads())


def _make(original):
    def __init__(self, *args, **kwargs):
        import torch

        threads = torch.get_num_threads()
        original(self, *args, **kwargs)
        from numba import config

        self.dspark_numba_threads = config.NUMBA_NUM_THREADS
        if threads > config.NUMBA_NUM_THREADS:
            logger.warning("vllm_dspark: numba was loaded with %d thread(s) for a %d-thread worker; after its "
                           "first n-gram proposal the target decodes on %d. Set %s=%d before starting vLLM.",
                           config.NUMBA_NUM_THREADS, threads, config.NUMBA_NUM_THREADS, _ENV, threads)

    return __init__


PATCH = register_patch(Patch(
    name="ngram-proposer-numba-pool",
    module="vllm.v1.spec_decode.ngram_proposer",
    attribute="NgramProposer.__init__",
    what="numba's thread pool is sized to the worker's thread count before the n-gram proposer loads it",
    why="in vLLM's CPU worker numba sizes its pool from the main thread's one-core affinity, and starting it "
        "sets the model thread's OpenMP count to 1: with n-gram the target decoded on one thread of two",
    versions=("0.32",),
    removable_when="numba's pool no longer changes the calling thread's OpenMP thread count, or vLLM sizes it",
    make=_make,
    lazy=True,
    prepare=size_numba_pool,
))
