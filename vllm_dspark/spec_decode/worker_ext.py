"""A vLLM worker extension that exposes the DSpark proposer's report.

    llm = LLM(..., worker_extension_cls="vllm_dspark.spec_decode.worker_ext.DSparkWorkerExtension")
    llm.collective_rpc("dspark_report")[0]   # counters, calibration table, cost model, settings

The proposer runs in the worker process; vLLM's ``collective_rpc`` reaches a
method by name only on the worker (or its extension), so this is how the
counters the periodic log line summarises become data.
"""

from __future__ import annotations


class DSparkWorkerExtension:
    def dspark_report(self) -> dict | None:
        drafter = getattr(getattr(self, "model_runner", None), "drafter", None)
        report = getattr(drafter, "report", None)
        return report() if callable(report) else None
