"""Decisions every tensor-parallel rank must take alike: made once, on TP rank 0, and broadcast.

Under tensor parallelism every rank runs the proposer, and the drafter's
forward contains collectives (its sharded projections, the LM head's gather).
A decision that changes what a rank executes therefore has to be the same on
every rank, or one rank waits in a collective that the others never enter:

* whether the start-up profile is loaded or taken (its dummy runs are
  collectives), and which cost model results;
* whether a step runs the drafter's block forward, probes, or only stores
  context K/V (:class:`~vllm_dspark.spec_decode.common.budget.Plan`);
* how many drafts each request sends.

The budget decides these from measured step times, which differ from rank to
rank (and a profile cache may exist on one node and not another). So the
deciding rank (TP rank 0, the one whose drafts vLLM's scheduler receives)
decides, and :meth:`Consensus.decide` hands its answer to every rank over
vLLM's TP group (``GroupCoordinator.broadcast_object``: its shared-memory
message queue on one node, the CPU process group otherwise). With one rank,
nothing is sent.

Everything else the drafter computes is a function of data every rank holds
alike (token ids, positions, sequence lengths, request seeds), which is why
draft seeds are derived from the request and position rather than drawn.

``VLLM_DSPARK_TEST_DIVERGENCE`` (tests only) makes one rank's inputs differ on
purpose: JSON ``{"rank": 1, "draft_time_scale": 1000, "cached_costs": {...}}``
multiplies the drafter's times that rank measures (at start-up and online) and
gives it a profile cache the others lack (``tests/deploy/test_ray_tp.py``). A
JSON list of such objects gives several ranks a share each.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger("vllm_dspark")

T = TypeVar("T")
TEST_DIVERGENCE_ENV = "VLLM_DSPARK_TEST_DIVERGENCE"


class Consensus:
    """The proposer's view of its TP group: who decides, and how the others learn the decision."""

    def __init__(self, group: Any = None):
        self._group = group
        self._resolved = group is not None
        self.broadcasts = 0

    def _tp(self) -> Any:
        if not self._resolved:
            self._resolved = True
            try:
                from vllm.distributed import parallel_state as ps

                group = ps.get_tp_group() if ps.model_parallel_is_initialized() else None
            except (ImportError, AssertionError):
                group = None
            self._group = group
        g = self._group
        return g if g is not None and getattr(g, "world_size", 1) > 1 else None

    @property
    def world_size(self) -> int:
        g = self._tp()
        return 1 if g is None else int(g.world_size)

    @property
    def rank(self) -> int:
        g = self._tp()
        return 0 if g is None else int(g.rank_in_group)

    @property
    def is_decider(self) -> bool:
        return self.rank == 0

    def decide(self, fn: Callable[[], T]) -> T:
        """``fn()`` evaluated on the deciding rank, returned on every rank (``fn`` runs only there).

        The value must be picklable and small; every rank of the group must call
        this at the same point, in the same order.
        """
        g = self._tp()
        if g is None:
            return fn()
        self.broadcasts += 1
        if g.rank_in_group == 0:
            value = fn()
            g.broadcast_object(value, src=0)
            return value
        return g.broadcast_object(None, src=0)

    def report(self) -> dict:
        return {"world_size": self.world_size, "rank": self.rank, "decider": 0, "broadcasts": self.broadcasts}


def divergence_for_rank(rank: int) -> dict:
    """This rank's share of :data:`TEST_DIVERGENCE_ENV` (empty unless the test hook names it)."""
    raw = os.environ.get(TEST_DIVERGENCE_ENV, "")
    if not raw:
        return {}
    try:
        spec = json.loads(raw)
    except ValueError:
        logger.warning("vllm_dspark: ignoring %s (not JSON): %r", TEST_DIVERGENCE_ENV, raw)
        return {}
    specs = spec if isinstance(spec, list) else [spec]
    mine = [s for s in specs if isinstance(s, dict) and int(s.get("rank", -1)) == rank]
    if not mine:
        return {}
    spec = mine[0]
    logger.warning("vllm_dspark: TEST HOOK %s active on TP rank %d: %s", TEST_DIVERGENCE_ENV, rank, spec)
    return spec
