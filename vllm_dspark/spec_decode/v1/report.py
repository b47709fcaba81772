"""What the V1 proposer tells: the counters it logs and publishes, its report, and a stale cost profile.

A mixin of ``DSparkProposer``: it reads the proposer's planner, costs, state and timings.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_dspark.serving.metrics import Publisher
    from vllm_dspark.serving.settings import DSparkSettings
    from vllm_dspark.spec_decode.common.budget import BudgetPolicy
    from vllm_dspark.spec_decode.common.calibration import Calibrator
    from vllm_dspark.spec_decode.common.consensus import Consensus
    from vllm_dspark.spec_decode.common.copy_policy import CopyPolicy
    from vllm_dspark.spec_decode.common.copy_source import CopySource
    from vllm_dspark.spec_decode.common.costs import CostModel
    from vllm_dspark.spec_decode.common.planner import StepPlanner
    from vllm_dspark.spec_decode.common.verify import VerifyStats
    from vllm_dspark.spec_decode.v1.context_kv import PendingContext
    from vllm_dspark.spec_decode.v1.step_state import StepState

logger = logging.getLogger("vllm_dspark")


class ProposerReport:
    """``report``, the periodic stats line and /metrics, and the stale profile's warning."""

    # What it reads of the proposer it is mixed into.
    settings: DSparkSettings
    planner: StepPlanner
    stats: VerifyStats
    policy: BudgetPolicy
    calibrator: Calibrator
    copy_policy: CopyPolicy | None
    copy_source: CopySource | None
    costs: CostModel | None
    consensus: Consensus
    metrics: Publisher
    pending: PendingContext
    state: StepState
    timings: dict[str, float]
    profile_info: dict | None
    _last_log: float

    def _check_stale(self) -> None:
        """A profile the online corrections keep disowning: drop its cache entry, fold the corrections in."""
        costs = self.costs
        if costs is None or not costs.stale or not self.consensus.is_decider:
            return
        from vllm_dspark.spec_decode.common.profile import drop_cached

        dropped = drop_cached(costs.cache_path)
        logger.warning(
            "vllm_dspark: the budget's cost profile (%s) no longer matches this machine: measured steps took "
            "%.2fx (verify) and %.2fx (draft) its times for %d steps in a row. %s; the measured corrections are "
            "folded into the cost model.", costs.source, costs.scale_verify, costs.scale_draft,
            max(costs.far_verify, costs.far_draft),
            f"Dropped the cached profile {costs.cache_path}, so the next start profiles again" if dropped
            else "Nothing cached to drop")
        costs.cache_path = None
        costs.rebase()

    def _maybe_log(self) -> None:
        if self.consensus.rank == 0:  # every rank counts the same acceptances; one publishes them
            self.metrics.maybe_publish(lambda: self.stats.as_dict()["by_source"])
        interval = self.settings.stats_interval_s
        if interval <= 0:
            return
        now = time.monotonic()
        if now - self._last_log >= interval:
            self._last_log = now
            logger.info(self.stats.line(self.settings.verification))

    def report(self) -> dict:
        """Counters, calibration and the cost model (for tests, benchmarks and ``collective_rpc``)."""
        c = self.costs
        stats = self.stats.as_dict()
        if self.consensus.rank == 0:
            self.metrics.maybe_publish(lambda: stats["by_source"], force=True)
        return {"stats": stats, "calibration": self.calibrator.table(),
                "timings_s": dict(self.timings),
                "costs": None if c is None else {**c.to_dict(), "scale_verify": c.scale_verify,
                                                 "scale_draft": c.scale_draft, "rebased": c.rebased,
                                                 "cache_path": c.cache_path, "source_draft": c.source_draft,
                                                 "shape_verify": [round(x, 3) for x in c.shape_verify]},
                "held_context": {**self.pending.counts, "enabled": self.state.hold_ok,
                                 "before_glue_steps": self.state.before_glue_steps,
                                 "copy_steps_held": self.state.copy_steps_held,
                                 "verify_steps_held": self.state.verify_steps_held,
                                 "copy_steps_before_glue": self.state.copy_steps_before_glue,
                                 "copy_only_steps": self.state.copy_only_steps,
                                 "copy_only_s": self.state.copy_only_s},
                "layout": {"rejected_rows_dropped": self.state.rejected_rows_dropped,
                           "probe_blocks_cut": self.state.probe_blocks_cut},
                "step_clock": {"marks": self.state.step_marks,
                               "from": "execute_model" if self.state.step_marks else "previous propose"},
                "policy": self.policy.report(), "consensus": self.consensus.report(),
                "copy": None if self.copy_policy is None or self.copy_source is None
                else {**self.copy_policy.report(), "source": self.copy_source.report()},
                "profile": self.profile_info, "settings": self.settings.to_dict()}