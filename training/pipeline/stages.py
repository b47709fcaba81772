"""Run a training pipeline's stages in order, timing each (wall and CPU) into ``timings.json``.

Both pipelines (``training/train_default.py``, ``training/train_tiny.py``) are a list
of resumable stages over one work directory. A stage's times are added to what
earlier runs of it took, so a stage resumed after a kill reports its whole cost.
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def parse_stages(requested: str, order: Sequence[str]) -> list[str]:
    """The requested stages (comma-separated) in pipeline order; ValueError names unknown ones."""
    asked = [s.strip() for s in requested.split(",") if s.strip()]
    unknown = sorted(set(asked) - set(order))
    if unknown:
        raise ValueError(f"unknown stages {unknown}; expected a subset of {list(order)}")
    return [s for s in order if s in asked]


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_stages(stages: Sequence[str], run: Callable[[str], None], work: Path,
               log: Callable[[str], None] = print, before: Callable[[], None] | None = None) -> dict:
    """Run each stage with ``run(stage)``; ``before()`` runs ahead of every stage (e.g. to reset
    torch's thread count, which a vLLM engine start-up lowers). Returns the timings written."""
    path = work / "timings.json"
    timings = json.loads(path.read_text()) if path.exists() else {}
    for stage in stages:
        if before is not None:
            before()
        t0, c0 = time.time(), _cpu_seconds()
        log(f"=== stage {stage}")
        run(stage)
        wall, cpu = time.time() - t0, _cpu_seconds() - c0
        prev = timings.get(stage)
        if not isinstance(prev, dict):  # older records held the wall seconds alone
            prev = {"wall_s": float(prev or 0.0), "cpu_s": 0.0}
        timings[stage] = {"wall_s": round(prev["wall_s"] + wall, 1), "cpu_s": round(prev["cpu_s"] + cpu, 1)}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(timings, indent=1))
        tmp.replace(path)
        log(f"=== stage {stage} done in {wall / 60:.1f} min (CPU {cpu / 60:.1f} min)")
    return timings
