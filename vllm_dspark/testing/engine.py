"""Start and stop vLLM engines for tests and scripts, and read their spec-decode metrics."""

from __future__ import annotations

import contextlib
import gc
import json
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def llm_engine(model: str, *, speculative_config: dict | None = None, env: dict | None = None,
               **kwargs) -> Iterator:
    """An ``LLM`` that is shut down (engine process included) when the block ends."""
    from vllm import LLM

    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    defaults = dict(dtype="float32", max_model_len=1024, enforce_eager=True, disable_log_stats=False,
                    max_num_seqs=32, seed=0, gpu_memory_utilization=0.15)
    defaults.update(kwargs)
    llm = LLM(model=model, speculative_config=speculative_config, **defaults)
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spec_metrics(llm) -> dict:
    """Spec-decode counters from ``llm.get_metrics()`` (cumulative since the engine started)."""
    out: dict = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode"):
            continue
        key = m.name.split("vllm:spec_decode_")[1]
        out[key] = list(m.values) if hasattr(m, "values") else m.value
    return out


def acceptance_summary(metrics: dict) -> dict:
    drafts = metrics.get("num_drafts", 0) or 0
    accepted = metrics.get("num_accepted_tokens", 0) or 0
    per_pos = metrics.get("num_accepted_tokens_per_pos", []) or []
    return {
        "num_drafts": drafts,
        "num_draft_tokens": metrics.get("num_draft_tokens", 0),
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else float("nan"),
        "per_position_acceptance": [a / drafts for a in per_pos] if drafts else [],
    }


def read_trace(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def verified_draft_tokens(trace: list[dict]) -> int:
    """Draft tokens the target verified, from a proposer trace.

    Every request's last proposal is made after its final token and never
    verified, so it is left out.
    """
    last: dict = {}
    total = 0
    for i, rec in enumerate(trace):
        last[rec["req_id"]] = i
        total += rec["kept"]
    return total - sum(trace[i]["kept"] for i in last.values())
