"""Budgeted verification: which draft tokens are worth verifying at the current load.

Speculation pays when the tokens it gains outweigh what verifying them costs.
At batch 1 on a memory-bound machine a verify step of 8 tokens costs about the
same as a decode step of 1, so every draft token is nearly free. Under load
(or on a compute-bound CPU) each extra token lengthens the step, and drafts
that will probably be rejected make the whole batch slower. This module
decides, every step:

* which (request, position) slots the target verifies. A slot's expected gain
  is its survival probability: the chance that it and every earlier draft of
  its request are accepted, the running product of the (calibrated)
  confidences. Slots are ranked by it across the whole batch, and the
  admitted set is the prefix of that ranking that maximises expected tokens
  per second, ``(R + sum of admitted survivals) / T_verify(R + admitted)``,
  with ``R`` requests each producing one token even with no drafts. A request
  may get zero drafts; when no slot pays the step is a plain decode step;
* whether the drafter should run at all on the next step: the forecast adds
  the drafter's own cost, ``D(R)``, and compares with plain decoding
  ``R / T_verify(R)``. When drafting does not pay, the next step skips the
  drafter's block forward (only its context KV is kept up to date).

Costs come from a start-up profile (:class:`CostModel`, cached on disk) and
are corrected online by the step times actually observed. Confidences come
from the drafter's confidence head through :class:`Calibrator`, which learns
from the acceptances it sees how often a predicted confidence really is
accepted, so a badly calibrated head makes the budget cautious rather than
wrong: after a few hundred verified draft tokens the survival estimates are
the measured acceptance rates.

This follows vLLM 0.33's adaptive verification (V2 runner) in spirit:
survival-ranked global admission under profiled costs. It differs in two
deliberate ways: the admission rule maximises the measured throughput ratio
instead of filling a fixed budget, and the head's confidences are recalibrated
online from observed acceptances.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


# ------------------------------------------------------------------ costs
@dataclass
class CostModel:
    """Step-time curves: target verify time by tokens in the batch, drafter time by requests.

    ``verify`` and ``draft`` are sorted ``(x, seconds)`` points; between points
    the time is interpolated linearly, beyond the last point extrapolated from
    the last two (the machine stays compute-bound). ``scale_verify`` and
    ``scale_draft`` are online corrections (EMAs of observed / predicted).
    """

    verify: list[tuple[int, float]]
    draft: list[tuple[int, float]]
    scale_verify: float = 1.0
    scale_draft: float = 1.0
    ema: float = 0.05
    source: str = "profile"

    def __post_init__(self) -> None:
        if not self.verify or not self.draft:
            raise ValueError("a cost model needs at least one verify and one draft point")
        self.verify = _monotone(sorted((int(n), float(t)) for n, t in self.verify))
        self.draft = _monotone(sorted((int(n), float(t)) for n, t in self.draft))

    def verify_time(self, tokens: int | np.ndarray) -> np.ndarray | float:
        return self.scale_verify * _interp(self.verify, tokens)

    def draft_time(self, requests: int) -> float:
        return float(self.scale_draft * _interp(self.draft, requests))

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.scale_verify = _ema(self.scale_verify, seconds / max(1e-9, float(_interp(self.verify, tokens))),
                                 self.ema)

    def observe_draft(self, requests: int, seconds: float) -> None:
        self.scale_draft = _ema(self.scale_draft, seconds / max(1e-9, float(_interp(self.draft, requests))),
                                self.ema)

    def to_dict(self) -> dict:
        return {"verify": [list(p) for p in self.verify], "draft": [list(p) for p in self.draft],
                "source": self.source}

    @classmethod
    def from_dict(cls, d: dict, source: str | None = None) -> CostModel:
        return cls(verify=[tuple(p) for p in d["verify"]], draft=[tuple(p) for p in d["draft"]],
                   source=source or d.get("source", "given"))


def _ema(old: float, new: float, a: float) -> float:
    # Clamp single observations: a stalled step (GC, another process) must not swing the model.
    new = min(max(new, 0.25 * old), 4.0 * old)
    return (1 - a) * old + a * new


def _monotone(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Non-decreasing times: more tokens never cost less (profiling noise otherwise misleads)."""
    out: list[tuple[int, float]] = []
    for n, t in points:
        if out and n == out[-1][0]:
            out[-1] = (n, max(out[-1][1], t))
            continue
        out.append((n, max(t, out[-1][1] if out else t)))
    return out


def _interp(points: list[tuple[int, float]], x):
    xs = np.array([p[0] for p in points], dtype=np.float64)
    ys = np.array([p[1] for p in points], dtype=np.float64)
    xa = np.asarray(x, dtype=np.float64)
    y = np.interp(xa, xs, ys)
    if len(xs) >= 2:
        slope = max(0.0, (ys[-1] - ys[-2]) / max(1e-9, xs[-1] - xs[-2]))
        y = np.where(xa > xs[-1], ys[-1] + slope * (xa - xs[-1]), y)
    return y if y.ndim else float(y)


def profile_sizes(max_tokens: int) -> list[int]:
    sizes, n = [], 1
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    sizes.append(max_tokens)
    return sorted(set(sizes))


def load_cached(path: Path) -> CostModel | None:
    try:
        return CostModel.from_dict(json.loads(path.read_text()), source=f"cache {path}")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_cached(path: Path, model: CostModel) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(model.to_dict(), indent=1))
    os.replace(tmp, path)


# ------------------------------------------------------------------ calibration
@dataclass
class Calibrator:
    """Predicted confidence -> measured acceptance, learnt online per (mode, position, bin).

    ``calibrate(c, pos)`` shrinks the bin's measured rate towards the head's own
    prediction with ``prior`` pseudo-observations, so an empty bin trusts the
    head and a full one trusts the data.
    """

    num_positions: int
    bins: int = 10
    prior: float = 20.0
    hits: np.ndarray = field(init=False)
    counts: np.ndarray = field(init=False)
    pred_sum: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        shape = (2, self.num_positions, self.bins)  # mode 0 greedy, 1 sampled
        self.hits = np.zeros(shape)
        self.counts = np.zeros(shape)
        self.pred_sum = np.zeros(shape)

    def _bin(self, c: np.ndarray) -> np.ndarray:
        return np.clip((np.asarray(c) * self.bins).astype(np.int64), 0, self.bins - 1)

    def calibrate(self, conf: np.ndarray, sampled: np.ndarray) -> np.ndarray:
        """[R, N] predicted conditional acceptance -> calibrated, same shape."""
        conf = np.asarray(conf, dtype=np.float64)
        r, n = conf.shape
        mode = np.broadcast_to(np.asarray(sampled, dtype=np.int64)[:, None], (r, n))
        pos = np.broadcast_to(np.arange(n)[None, :], (r, n))
        b = self._bin(conf)
        h = self.hits[mode, pos, b]
        c = self.counts[mode, pos, b]
        return (h + self.prior * conf) / (c + self.prior)

    def observe(self, conf: Sequence[float], verified: int, accepted: int, sampled: bool) -> None:
        """One request's verified drafts: positions < accepted were accepted, position ``accepted`` was not."""
        last = min(accepted, verified - 1)
        for j in range(last + 1):
            c = float(conf[j])
            b = int(min(self.bins - 1, max(0, int(c * self.bins))))
            m = int(sampled)
            self.counts[m, j, b] += 1
            self.pred_sum[m, j, b] += c
            if j < accepted:
                self.hits[m, j, b] += 1

    def table(self) -> dict:
        """The head's calibration: predicted vs measured conditional acceptance per position and per
        confidence bin (both modes pooled), and the expected calibration error over the bins."""
        cnt = self.counts.sum(axis=(0, 2))
        bcnt = self.counts.sum(axis=(0, 1))
        bpred = self.pred_sum.sum(axis=(0, 1)) / np.maximum(bcnt, 1)
        bmeas = self.hits.sum(axis=(0, 1)) / np.maximum(bcnt, 1)
        total = float(bcnt.sum())
        ece = float((bcnt * np.abs(bpred - bmeas)).sum() / total) if total else float("nan")
        return {"count": cnt.tolist(),
                "predicted": (self.pred_sum.sum(axis=(0, 2)) / np.maximum(cnt, 1)).tolist(),
                "measured": (self.hits.sum(axis=(0, 2)) / np.maximum(cnt, 1)).tolist(),
                "bins": {"count": bcnt.tolist(), "predicted": bpred.tolist(), "measured": bmeas.tolist()},
                "ece": ece}


# ------------------------------------------------------------------ allocation
@dataclass(frozen=True)
class Allocation:
    kept: list[int]  # draft tokens to verify per request
    expected_tokens: float  # R + sum of admitted survivals
    step_seconds: float  # predicted verify time
    plain_rate: float  # tokens/s of a plain decode step
    rate: float  # tokens/s of the chosen allocation (verify only)
    draft_rate: float  # tokens/s forecast when the drafter's cost is included
    draft_pays: bool  # whether drafting next step is forecast to pay


def survival(conf: np.ndarray) -> np.ndarray:
    """[R, N] conditional acceptance -> [R, N] probability that drafts 0..k are all accepted."""
    return np.cumprod(np.clip(np.asarray(conf, dtype=np.float64), 0.0, 1.0), axis=1)


def allocate(surv: np.ndarray, caps: Sequence[int], costs: CostModel, *, extra_tokens: int = 0,
             margin: float = 0.02) -> Allocation:
    """Admit the survival-ranked prefix of slots that maximises expected tokens per second.

    Parameters
    ----------
    surv : [R, N] survival probabilities (non-increasing along each row)
    caps : [R] the most drafts each request may verify (0 = none)
    costs : the cost model
    extra_tokens : tokens in the next step besides the R decode tokens and the drafts
        (e.g. prefill chunks scheduled alongside), which the verify cost also pays for
    margin : drafting must beat plain decoding by this fraction to be forecast to pay
    """
    surv = np.minimum.accumulate(np.asarray(surv, dtype=np.float64), axis=1) if surv.size else surv
    r = surv.shape[0]
    base_tokens = r + extra_tokens
    values, rows = [], []
    for i in range(r):
        k = int(max(0, min(caps[i], surv.shape[1])))
        values.extend(surv[i, :k].tolist())
        rows.extend([i] * k)
    t_plain = float(costs.verify_time(base_tokens))
    plain_rate = r / t_plain if t_plain > 0 else 0.0
    d = costs.draft_time(r)
    if not values:
        return Allocation([0] * r, float(r), t_plain, plain_rate, plain_rate, 0.0, False)
    order = np.argsort(-np.asarray(values), kind="stable")  # ties: lower position first
    v = np.asarray(values)[order]
    m = np.arange(len(v) + 1)
    gain = np.concatenate([[0.0], np.cumsum(v)])
    t = np.asarray(costs.verify_time(base_tokens + m), dtype=np.float64)
    rate = (r + gain) / t
    best = int(np.argmax(rate))
    draft_rate = float(np.max((r + gain) / (t + d)))
    kept = [0] * r
    for idx in order[:best]:
        kept[rows[idx]] += 1
    return Allocation(kept, float(r + gain[best]), float(t[best]), plain_rate, float(rate[best]),
                      draft_rate, draft_rate > plain_rate * (1.0 + margin))


def forecast_pays(mean_surv: Sequence[float], requests: int, cap: int, costs: CostModel,
                  margin: float = 0.02) -> bool:
    """Whether drafting pays for ``requests`` requests with a typical survival profile."""
    if requests <= 0 or cap <= 0:
        return False
    s = np.tile(np.asarray(mean_surv, dtype=np.float64)[None, :cap], (requests, 1))
    return allocate(s, [cap] * requests, costs, margin=margin).draft_pays


class SurvivalProfile:
    """EMA of the calibrated survival per position, for forecasts on steps without fresh drafts."""

    def __init__(self, num_positions: int, init: float = 0.5, ema: float = 0.1):
        self.value = np.array([init ** (k + 1) for k in range(num_positions)])
        self.ema = ema

    def update(self, surv: np.ndarray) -> None:
        if surv.size:
            self.value = (1 - self.ema) * self.value + self.ema * surv.mean(axis=0)


