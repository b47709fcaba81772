"""A vLLM worker extension that exposes the DSpark proposer's report and per-request state.

    llm = LLM(..., worker_extension_cls="vllm_dspark.spec_decode.v1.worker_ext.DSparkWorkerExtension")
    llm.collective_rpc("dspark_report")[0]   # counters, calibration table, cost model, settings
    llm.collective_rpc("dspark_state")[0]    # which requests the runner and the proposer still hold

    vllm serve ... --worker-extension-cls vllm_dspark.spec_decode.v1.worker_ext.DSparkWorkerExtension
    (VLLM_SERVER_DEV_MODE=1: POST /collective_rpc {"method": "dspark_state"})

The proposer runs in the worker process; vLLM's ``collective_rpc`` reaches a
method by name only on the worker (or its extension), so this is how the
counters the periodic log line summarises become data.
"""

from __future__ import annotations

from typing import Any


class DSparkWorkerExtension:
    def dspark_report(self) -> dict | None:
        drafter = getattr(getattr(self, "model_runner", None), "drafter", None)
        report = getattr(drafter, "report", None)
        if not callable(report):
            return None
        out = report()
        # Steps the rejection-sampler patch served as plain samples (no draft in the batch).
        sampler = getattr(self.model_runner, "rejection_sampler", None)  # type: ignore[attr-defined]
        out["no_draft_sampler_steps"] = getattr(sampler, "dspark_no_draft_steps", 0)
        # Greedy verify steps it served on CPU without float32 copies of the draft rows' logits.
        out["greedy_verify_sampler_steps"] = getattr(sampler, "dspark_greedy_verify_steps", 0)
        # Steps whose bonus tokens it took with the compiled argmax instead of vLLM's sampler.
        out["argmax_bonus_sampler_steps"] = getattr(sampler, "dspark_argmax_bonus_steps", 0)
        from vllm_dspark.ops import argmax

        out["greedy_verify_argmax"] = argmax.last_path  # "compiled" (the op) or "torch"
        return out

    def dspark_state(self) -> dict:
        """Request ids the model runner tracks, the ones in its persistent batch, the ones the
        proposer keeps feedback state for (``prev``: whose drafts the next verify step reports
        on) and the proposer's counters. A cancelled or finished request must leave all three
        once the runner has run a step after it ended (the scheduler tells the runner which
        requests ended at the next step)."""
        runner = getattr(self, "model_runner", None)
        drafter = getattr(runner, "drafter", None)
        batch = getattr(runner, "input_batch", None)
        num = getattr(batch, "num_reqs", 0) if batch is not None else 0
        prev = getattr(getattr(drafter, "state", None), "sent", None)
        stats: Any = getattr(drafter, "stats", None)
        return {
            "runner_requests": sorted(getattr(runner, "requests", {}) or {}),
            "batch_requests": [r for r in (list(batch.req_ids[:num]) if batch is not None else []) if r],
            "drafter": type(drafter).__name__ if drafter is not None else None,
            "prev": sorted(prev) if isinstance(prev, dict) else None,
            "stats": stats.as_dict() if hasattr(stats, "as_dict") else None,
        }
