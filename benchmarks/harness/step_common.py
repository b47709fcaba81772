"""What the step-cost benchmark's two kinds of cell share: the engines' (:mod:`.step_engine`) and the floor's
(:mod:`.step_floor`).

A worker's spec, the loop that runs a cell until it has enough counted steps, the mean over a
cell's typical steps, its random prompts and the profiler's operator classes. Both modules import
this one and it imports neither: the worker process (:mod:`.step_worker`) builds both.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Callable, Sequence


@dataclasses.dataclass
class EngineSpec:
    kind: str  # "pair" (the worker process), or the part it builds: "plain" | "spec" | "floor"
    target: str
    draft: str | None
    dtype: str
    max_num_seqs: int = 32
    max_model_len: int = 2048
    # The order the worker builds its three parts in: the first engine owns the target's weights and
    # the second reads them (PairServer); builds rotate it.
    order: tuple[str, ...] = ("plain", "spec", "floor")


def run_until(step: Callable[[], float], min_seconds: float, min_steps: int, max_steps: int) -> int:
    """Call ``step`` (seconds of a counted step, 0.0 for one not counted) until the counted steps last
    ``min_seconds`` and number ``min_steps``, or ``max_steps`` calls were made; the number of calls."""
    elapsed, counted, calls = 0.0, 0, 0
    while (elapsed < min_seconds or counted < min_steps) and calls < max_steps:
        calls += 1
        dt = step()
        if dt > 0.0:
            elapsed += dt
            counted += 1
    return calls


def typical_mean(per_step: Sequence[dict], times: Sequence[float], slack: float = 1.3) -> dict:
    """Mean of per-step dicts over the typical steps: those no slower than ``slack`` x the median step.

    A step stalled by another process (a descheduled OpenMP thread costs a whole time slice)
    would otherwise move the mean of every phase; the cell's own value is the median step.
    """
    if not per_step:
        return {}
    med = statistics.median(times)
    keep = [p for p, t in zip(per_step, times) if t <= slack * med] or list(per_step)
    keys = sorted({k for p in keep for k in p})
    return {k: statistics.mean(p.get(k, 0.0) for p in keep) for k in keys}


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Distinct random token sequences (token values do not change a step's cost)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


GEMM_OPS = ("onednn_mm", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn",
            "onednn_scaled_mm", "aten::_weight_int8pack_mm", "gemm")
ATTN_OPS = ("attention", "attn", "reshape_and_cache", "scaled_dot_product", "flash")


def classify_op(name: str) -> str:
    """Operator class of a profiler event name: ``gemm``, ``attention``, ``rope`` or ``elementwise``."""
    n = name.lower()
    if any(k in n for k in GEMM_OPS):
        return "gemm"
    if any(k in n for k in ATTN_OPS):
        return "attention"
    if "rotary" in n or "rope" in n:
        return "rope"
    return "elementwise"
