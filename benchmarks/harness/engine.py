"""Start and stop vLLM engines (benchmarks, scripts and tests), and read their spec-decode metrics."""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def llm_engine(model: str, *, speculative_config: dict | None = None, env: dict | None = None,
               **kwargs) -> Iterator:
    """An ``LLM`` that is shut down (engine process included) when the block ends."""
    from vllm import LLM

    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    defaults = dict(dtype="float32", max_model_len=1024, enforce_eager=True, disable_log_stats=False,
                    max_num_seqs=32, seed=0, gpu_memory_utilization=0.15,
                    worker_extension_cls="vllm_dspark.spec_decode.v1.worker_ext.DSparkWorkerExtension")
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
    """Spec-decode counters from ``llm.get_metrics()`` (cumulative since the engine started).

    vLLM keeps its metrics in one Prometheus registry per process, so engines living in the
    same process share it; only the samples labelled with this engine's served model name are
    read (engines alive together need distinct ``served_model_name`` s, as ``run_interleaved``
    gives them).
    """
    own = getattr(getattr(llm.llm_engine, "model_config", None), "served_model_name", None)
    out: dict = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode"):
            continue
        if own is not None and m.labels.get("model_name", own) != own:
            continue
        key = m.name.split("vllm:spec_decode_")[1]
        out[key] = list(m.values) if hasattr(m, "values") else m.value
    return out


def source_metrics(llm) -> dict[str, dict[str, int]]:
    """The DSpark proposer's per-source counters on ``/metrics`` (``serving/metrics.py``), from
    ``llm.get_metrics()``: {source: {drafts, verified, accepted}} for this engine's model name."""
    from vllm_dspark.serving.metrics import FIELDS, NAMES

    field_of = {NAMES[f][0]: f for f in FIELDS}
    own = getattr(getattr(llm.llm_engine, "model_config", None), "served_model_name", None)
    out: dict[str, dict[str, int]] = {}
    for m in llm.get_metrics():
        field = field_of.get(m.name)
        if field is None or (own is not None and m.labels.get("model_name") != str(own)):
            continue
        out.setdefault(m.labels["source"], dict.fromkeys(FIELDS, 0))[field] = int(m.value)
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


def read_trace(path: str | Path, kind: str = "draft") -> list[dict]:
    """Records of a proposer trace: ``draft`` (one per request and draft step: drafts, confidences,
    kept length) or ``acceptance`` (one per request and verify step: verified, accepted)."""
    p = Path(path)
    if not p.exists():
        return []
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    key = "draft" if kind == "draft" else "verified"
    return [r for r in rows if key in r]


def dspark_report(llm) -> dict | None:
    """The DSpark proposer's counters, calibration table and cost model, from the engine's worker."""
    out = llm.collective_rpc("dspark_report")  # DSparkWorkerExtension (llm_engine installs it)
    return out[0] if out else None


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


def draft_kv_blocks(llm) -> dict:
    """KV blocks each request holds in the drafter's and in the target's cache group (in-process engines).

    Needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the scheduler lives in this
    process). Blocks the sliding-window manager freed (null blocks) are not
    counted. Returns ``{"draft": {req_id: n}, "target": {req_id: n},
    "block_size": int, "draft_group_spec": name}``.
    """
    import re

    core = llm.llm_engine.engine_core
    sched = getattr(core, "engine_core", None)
    if sched is None:
        raise RuntimeError("draft_kv_blocks needs an in-process engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
    sched = sched.scheduler
    mgr = sched.kv_cache_manager
    groups = sched.kv_cache_config.kv_cache_groups
    target_layers = llm.llm_engine.vllm_config.model_config.get_total_num_hidden_layers()

    def layer_index(name: str) -> int:
        m = re.search(r"layers\.(\d+)\.", name)
        return int(m.group(1)) if m else -1

    def group_of(pred) -> int:
        for i, g in enumerate(groups):
            if any(pred(layer_index(n)) for n in g.layer_names):
                return i
        raise RuntimeError("no KV cache group holds the requested layers")

    managers = mgr.coordinator.single_type_managers
    null = mgr.block_pool.null_block

    def held(i: int) -> dict:
        return {rid: sum(1 for b in blocks if b is not null)
                for rid, blocks in managers[i].req_to_blocks.items()}

    d, t = group_of(lambda i: i >= target_layers), group_of(lambda i: 0 <= i < target_layers)
    decoding = {rid: r.num_computed_tokens >= r.num_prompt_tokens for rid, r in sched.requests.items()}
    return {"draft": held(d), "target": held(t), "block_size": groups[d].kv_cache_spec.block_size,
            "draft_group_spec": type(groups[d].kv_cache_spec).__name__, "decoding": decoding}
