"""The budget's cost model: verify time per token count and drafter time per request count.

From a start-up profile (``profile.py``, cached on disk as JSON), corrected online
by the step times actually observed; a profile the corrections keep disowning is
stale (:attr:`CostModel.stale`).
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vllm_dspark.spec_decode.common.sources import MODEL_SOURCE

# Steps a source is observed on before its cost is learnt (see CostModel.observe_source).
SOURCE_COLD_STEPS = 1


@dataclass
class CostModel:
    """Step-time curves: target verify time by tokens in the batch, drafter time by requests.

    ``verify`` and ``draft`` are sorted ``(x, seconds)`` points; between points
    the time is interpolated linearly, beyond the last point extrapolated from
    the last two (the machine stays compute-bound). The drafter's curve never
    falls; the verify curve keeps the dips it was measured with (:func:`_merged`).
    ``scale_verify`` and ``scale_draft`` are online corrections (EMAs of observed /
    predicted).
    ``shape_verify`` corrects each verify point on its own, from the steps observed
    between it and its neighbours: one scale cannot mend a profile whose points are
    off by different factors (on the 2-core EPYC the 16-token point of a batch-8
    profile came out 1.5x too slow beside its neighbours, so the first draft token
    of each request was priced at three times its cost and short copies were declined).

    A correction that stays outside ``[1/drift, drift]`` for ``patience``
    observations in a row means the curves no longer describe this machine (a
    profile taken while the machine was busy, or cached from another state of
    it): :attr:`stale` turns true. The proposer then drops the cached profile,
    so the next start profiles again, and :meth:`rebase` folds the corrections
    into the curves.
    """

    verify: list[tuple[int, float]]
    draft: list[tuple[int, float]]
    scale_verify: float = 1.0
    scale_draft: float = 1.0
    ema: float = 0.05
    source: str = "profile"
    drift: float = 2.0
    patience: int = 100
    far_verify: int = 0  # consecutive observations with scale_verify outside [1/drift, drift]
    far_draft: int = 0
    rebased: int = 0  # how many times rebase() folded the corrections in
    cache_path: str | None = None  # where this model is cached (None: nowhere)
    source_draft: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # other sources' costs
    # Whether other sources' costs are learnt from the steps observed (a given table fixes them: 0 where it
    # names none, so a test that pins its costs decides alike under any load).
    learn_sources: bool = True
    # Per-point corrections of the verify curve, learnt where the steps observed fall (a given table keeps
    # its shape, as it keeps its sources' costs).
    shape_verify: list[float] = field(default_factory=list)
    learn_shape: bool = True
    sources_seen: dict[str, int] = field(default_factory=dict)  # steps each source was observed on

    def __post_init__(self) -> None:
        if not self.verify or not self.draft:
            raise ValueError("a cost model needs at least one verify and one draft point")
        self.verify = _merged(sorted((int(n), float(t)) for n, t in self.verify))
        self.draft = _monotone(sorted((int(n), float(t)) for n, t in self.draft))
        if len(self.shape_verify) != len(self.verify):
            self.shape_verify = [1.0] * len(self.verify)
        self._shaped = self._shape()

    def _shape(self) -> list[tuple[int, float]]:
        self._shaped_xy: tuple[np.ndarray, np.ndarray] | None = None  # built when an array is priced
        self._prefixes: dict[tuple[int, int], list[float]] = {}  # verify_prefixes', for one scale
        self._prefixes_scale: float | None = None
        return [(n, t * f) for (n, t), f in zip(self.verify, self.shape_verify, strict=True)]

    def verify_time(self, tokens: int | np.ndarray) -> np.ndarray | float:
        if isinstance(tokens, np.ndarray):
            if self._shaped_xy is None:
                # The allocation prices every prefix of the ranked slots at once: the curve's arrays are
                # built once per change of the curve (every observed step changes it), and only when priced.
                self._shaped_xy = (np.array([n for n, _ in self._shaped], dtype=np.float64),
                                   np.array([t for _, t in self._shaped], dtype=np.float64))
            return self.scale_verify * _interp_xy(*self._shaped_xy, tokens)
        return self.scale_verify * _interp(self._shaped, tokens)

    def verify_prefixes(self, base: int, slots: int) -> list[float]:
        """``verify_time(base + arange(slots + 1))`` as floats (read-only): a step may allocate two or
        three times over the same slots (the drafter's check, the copy's allocation, both sources priced
        together), and each priced the curve anew. Kept until the curve or its scale changes."""
        if self._prefixes_scale != self.scale_verify:
            self._prefixes, self._prefixes_scale = {}, self.scale_verify
        got = self._prefixes.get((base, slots))
        if got is None:
            # In plain floats, the arrays' arithmetic to the bit (_interp_point): every observed step moves
            # the scale and the shape, so a batch-1 step priced these anew, and numpy's calls ran cold there.
            scale, shaped = self.scale_verify, self._shaped
            got = self._prefixes[(base, slots)] = [scale * _interp_point(shaped, float(base + k))
                                                   for k in range(slots + 1)]
        return got

    def draft_time(self, requests: int, source: str = MODEL_SOURCE) -> float:
        """Seconds ``source`` takes to draft for ``requests`` requests (the drafter's profiled curve;
        another source's from ``source_draft``, uncorrected: only the drafter's step is observed)."""
        if source == MODEL_SOURCE:
            return float(self.scale_draft * _interp(self.draft, requests))
        points = self.source_draft.get(source)
        if points is None:
            raise KeyError(f"the cost model has no draft cost for source {source!r}")
        return float(_interp(points, requests))

    def has_source(self, source: str) -> bool:
        return source == MODEL_SOURCE or bool(self.source_draft.get(source))

    def observe_source(self, source: str, requests: int, seconds: float) -> None:
        """A step on which only ``source`` drafted took the proposer ``seconds`` past its plan, for
        ``requests`` requests: that source's own cost of a step that sends its drafts, learnt per batch
        size (an EMA per size).

        One cold step must not set a price. The first step a source sends in a process runs its code
        paths for the first time: in a lockstep run the copy's first step (batch 2) took 3.8 ms against
        0.3-0.6 ms after, and extrapolated from there a batch of 8 was priced at 25 ms until one was seen.
        So that step is not learnt, and a batch size seen for the first time starts from the curve the
        other sizes drew and moves like any EMA (a stalled first step at batch 7 had set 5.3 ms there)."""
        if not self.learn_sources:
            return
        seen = self.sources_seen[source] = self.sources_seen.get(source, 0) + 1
        if seen <= SOURCE_COLD_STEPS:
            return
        curve = self.source_draft.get(source, [])
        points = dict(curve)
        old = points.get(requests)
        if old is None and curve:
            old = float(_interp(curve, requests))  # the kept curve is sorted already
        points[requests] = float(seconds) if old is None else _ema(old, float(seconds), 0.1)
        self.source_draft[source] = sorted(points.items())

    def _far(self, scale: float) -> bool:
        return not (1.0 / self.drift <= scale <= self.drift)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.scale_verify = _ema(self.scale_verify, seconds / max(1e-9, float(_interp(self._shaped, tokens))),
                                 self.ema)
        self.far_verify = self.far_verify + 1 if self._far(self.scale_verify) else 0
        if self.learn_shape:
            self._learn_shape(int(tokens), seconds / max(1e-9, float(self.verify_time(tokens))))

    def _learn_shape(self, tokens: int, ratio: float) -> None:
        """Move the two points around ``tokens`` towards what was observed, each by its share of the
        interpolation (in log space, a single observation clamped as in :func:`_ema`)."""
        xs = [n for n, _ in self.verify]
        i = bisect.bisect_right(xs, tokens) - 1
        if i < 0 or i >= len(xs) - 1:
            shares = [(0 if i < 0 else len(xs) - 1, 1.0)]
        else:
            frac = (tokens - xs[i]) / (xs[i + 1] - xs[i])
            shares = [(i, 1.0 - frac), (i + 1, frac)]
        # Plain floats: a handful of points, every decode step (numpy's per-call cost was most of it).
        step = math.log(min(max(ratio, 0.25), 4.0))
        logs = [math.log(f) for f in self.shape_verify]
        for j, w in shares:
            logs[j] += self.ema * w * step
        # The shape is relative (geometric mean 1): a machine slower everywhere is the global scale's to
        # learn, so that the scale alone still says when the profile went stale.
        mean = sum(logs) / len(logs)
        self.shape_verify = [math.exp(min(max(x - mean, -1.4), 1.4)) for x in logs]
        self._shaped = self._shape()

    def observe_draft(self, requests: int, seconds: float) -> None:
        self.scale_draft = _ema(self.scale_draft, seconds / max(1e-9, float(_interp(self.draft, requests))),
                                self.ema)
        self.far_draft = self.far_draft + 1 if self._far(self.scale_draft) else 0

    @property
    def stale(self) -> bool:
        return max(self.far_verify, self.far_draft) >= self.patience

    def rebase(self) -> None:
        """Fold the online corrections into the curves (after a stale profile was detected)."""
        self.verify = [(n, t * self.scale_verify) for n, t in self._shaped]
        self.draft = [(n, t * self.scale_draft) for n, t in self.draft]
        self.scale_verify = self.scale_draft = 1.0
        self.shape_verify = [1.0] * len(self.verify)
        self._shaped = self._shape()
        self.far_verify = self.far_draft = 0
        self.rebased += 1

    def to_dict(self) -> dict:
        return {"verify": [list(p) for p in self.verify], "draft": [list(p) for p in self.draft],
                "source": self.source}

    @classmethod
    def from_dict(cls, d: dict, source: str | None = None, *, given: bool = False) -> CostModel:
        """``given``: a table the user (or a test) set, whose ``sources`` (``{"copy": [[requests, s], ...]}``)
        are fixed, not learnt; a cached profile's sources are learnt again."""
        sources = {k: [(int(n), float(t)) for n, t in v] for k, v in (d.get("sources") or {}).items()} if given else {}
        return cls(verify=[tuple(p) for p in d["verify"]], draft=[tuple(p) for p in d["draft"]],
                   source=source or d.get("source", "given"), source_draft=sources, learn_sources=not given,
                   learn_shape=not given)


def _ema(old: float, new: float, a: float) -> float:
    # Clamp single observations: a stalled step (GC, another process) must not swing the model.
    new = min(max(new, 0.25 * old), 4.0 * old)
    return (1 - a) * old + a * new


def _merged(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Sorted points, one per x (the slower of two: noise only ever adds time).

    A verify point keeps a dip below the points before it. Each point is the fastest of several runs,
    so a dip is the machine's, not noise: bf16 SmolLM2 on the 2-core EPYC verifies 3-6 tokens in
    22.1-22.5 ms and 1 token in 23.4 (the GEMM's small-M path), and a curve lifted to 23.4 there priced
    the first drafts of a batch-1 step at a cost they do not have."""
    out: list[tuple[int, float]] = []
    for n, t in points:
        if out and n == out[-1][0]:
            out[-1] = (n, max(out[-1][1], t))
        else:
            out.append((n, t))
    return out


def _monotone(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Non-decreasing times: more requests never cost the drafter less (profiling noise otherwise misleads)."""
    out: list[tuple[int, float]] = []
    for n, t in _merged(points):
        out.append((n, max(t, out[-1][1] if out else t)))
    return out


def _interp(points: list[tuple[int, float]], x):
    if isinstance(x, (int, float, np.integer, np.floating)):
        return _interp_scalar(points, float(x))
    xs = np.array([p[0] for p in points], dtype=np.float64)
    ys = np.array([p[1] for p in points], dtype=np.float64)
    return _interp_xy(xs, ys, x)


def _interp_xy(xs: np.ndarray, ys: np.ndarray, x):
    """:func:`_interp` over the curve's points as arrays: linear between them, the last slope past them."""
    xa = np.asarray(x, dtype=np.float64)
    y = np.interp(xa, xs, ys)
    if len(xs) >= 2:
        slope = max(0.0, (ys[-1] - ys[-2]) / max(1e-9, xs[-1] - xs[-2]))
        y = np.where(xa > xs[-1], ys[-1] + slope * (xa - xs[-1]), y)
    return y if y.ndim else float(y)


def _interp_point(points: list[tuple[int, float]], x: float) -> float:
    """:func:`_interp_xy` of one number in plain floats, with ``np.interp``'s arithmetic: the same bits
    (``tests/spec_decode/test_budget.py`` holds them to it). :func:`_interp_scalar` rounds differently."""
    (x0, y0), (xn, yn) = points[0], points[-1]
    if x > xn:
        if len(points) < 2:
            return float(yn)
        xa, ya = points[-2]
        slope = max(0.0, (float(yn) - float(ya)) / max(1e-9, float(xn) - float(xa)))
        return float(yn) + slope * (x - float(xn))
    if x < x0:
        return float(y0)
    j = bisect.bisect_right(points, x, key=lambda p: p[0]) - 1
    xj, yj = float(points[j][0]), float(points[j][1])
    if j == len(points) - 1 or x == xj:
        return yj
    xk, yk = float(points[j + 1][0]), float(points[j + 1][1])
    slope = (yk - yj) / (xk - xj)
    y = slope * (x - xj) + yj
    if math.isnan(y):  # as numpy: from the other end, then the flat value
        y = slope * (x - xk) + yk
        if math.isnan(y) and yj == yk:
            y = yj
    return y


def _interp_scalar(points: list[tuple[int, float]], x: float) -> float:
    """:func:`_interp` of one number, in plain Python: the budget asks this three times a step, and
    building the numpy arrays took 0.1-0.2 ms of every step at batch 1 (cProfile, never-accepted drafter)."""
    n0, t0 = points[0]
    if x <= n0 or len(points) == 1:
        return float(t0)
    i = bisect.bisect_left(points, x, key=lambda p: p[0])
    if i == len(points):
        (na, ta), (nb, tb) = points[-2], points[-1]
        return float(tb + max(0.0, (tb - ta) / max(1e-9, nb - na)) * (x - nb))
    (na, ta), (nb, tb) = points[i - 1], points[i]
    if x == nb:
        return float(tb)
    return float(ta + (tb - ta) * (x - na) / (nb - na))


# Every size up to here is profiled, powers of two beyond. A CPU's GEMM changes path with the row count:
# bf16 on the 2-core EPYC takes 23.4 ms for 1 token, 22.1-22.5 for 3-6 and 24.0 for 7, which the points
# 1, 2, 4, 8 drew as a rising line. Past 16 tokens the steps of the curve are small beside its slope.
DENSE_SIZES = 16


def profile_sizes(max_size: int, dense: int = 1) -> list[int]:
    """1 .. ``dense`` every size, then powers of two, and ``max_size`` (all at most ``max_size``)."""
    sizes = list(range(1, min(dense, max_size) + 1))
    n = 1
    while n < max_size:
        sizes.append(n)
        n *= 2
    sizes.append(max_size)
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
