"""Measured acceptance of the drafter, learnt online: what the budget believes instead of the head.

See :class:`Calibrator`; the budget (``budget.py``) reads its levels and calibrated
confidences to rank and admit draft slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Up to this many values (slots, or verdicts in a step) the per-step arithmetic runs in plain floats, in
# the order numpy's would, to the same bits: a batch-1 step asks for a few numbers, and numpy's per-call
# cost, paid with its code cold after the target's forward, was most of the decision's time. Past it
# numpy wins (AVX2 EPYC, caches thrashed between calls: calibrate 18 against 51 us at 7 slots, even at
# about 56; allocate 55 against 83 us at 7 slots, 88 against 122 at 42).
SMALL = 32
SMALL_VERDICTS = 8  # the same for a step's verdicts (observe): 19 against 48 us at 2, even at about 9


@dataclass
class Calibrator:
    """Measured acceptance, learnt online per (mode, position) and per (mode, position, confidence bin).

    Nothing is trusted before it is measured. Each position's acceptance
    *level* is a Beta-style estimate whose prior is pessimistic and chained:
    position 0 starts from ``prior_acceptance`` with ``prior_strength``
    pseudo-observations, and position ``j`` starts from position ``j-1``'s
    estimate (a drafter proves itself from the first position outwards; a
    position nothing has reached yet is assumed no better than the one before).
    Within a position the head's confidence only *ranks* slots: a slot's prior
    is the level scaled by ``conf / (mean confidence seen at that position)``,
    and each confidence bin's measured rate takes over from it after
    ``bin_prior`` observations. So a head that says 0.9 everywhere and is never
    accepted gets survival estimates that fall with every rejection, instead of
    0.9 until a few hundred verified tokens have outvoted it.

    Evidence fades with ``memory`` (observations, per mode): old acceptances do
    not keep vouching for a drafter on a workload that changed.
    """

    num_positions: int
    bins: int = 10
    prior_strength: float = 4.0
    prior_acceptance: float = 0.1
    bin_prior: float = 20.0
    memory: float = 2000.0
    hits: np.ndarray = field(init=False)  # [2, P, bins], decayed (mode 0 greedy, 1 sampled)
    counts: np.ndarray = field(init=False)
    pred_sum: np.ndarray = field(init=False)
    total_hits: np.ndarray = field(init=False)  # the same, never decayed (the report)
    total_counts: np.ndarray = field(init=False)
    total_pred: np.ndarray = field(init=False)
    # What the tables imply, kept until they next change (observe, seed): the budget reads the levels
    # and the calibrated survival several times a step, and rebuilding them each time took a few
    # hundred microseconds of every step at batch 1 (0.26 ms a calibrate call in the engine).
    _derived: dict = field(init=False, repr=False, compare=False)
    _measured: list = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shape = (2, self.num_positions, self.bins)
        for name in ("hits", "counts", "pred_sum", "total_hits", "total_counts", "total_pred"):
            setattr(self, name, np.zeros(shape))
        self._derived = {}
        self._measured = [False, False]

    def memo(self, key: str, make):
        """``make()``'s array, computed once per change of the tables (read-only: callers share it)."""
        out = self._derived.get(key)
        if out is None:
            out = self._derived[key] = make()
            out.flags.writeable = False
        return out

    def _bin(self, c: np.ndarray) -> np.ndarray:
        return np.clip((np.asarray(c) * self.bins).astype(np.int64), 0, self.bins - 1)

    def _bin_one(self, c: float) -> int:
        """:meth:`_bin` of one confidence (the plain-float paths')."""
        return min(max(int(c * self.bins), 0), self.bins - 1)

    def measured(self, sampled: bool) -> bool:
        """Whether any draft of this mode has been verified yet (the report's counts never fade, so once
        true it stays true: kept as a flag, asked every step)."""
        m = int(sampled)
        if not self._measured[m]:
            self._measured[m] = bool(self.total_counts[m].sum() > 0)
        return self._measured[m]

    def levels(self) -> np.ndarray:
        """[2, P] measured conditional acceptance per mode and position (the chained pessimistic prior)."""
        return self.memo("levels", self._levels)

    def _levels(self) -> np.ndarray:
        return np.array(self._chain(self.hits.sum(axis=2).tolist(), self.counts.sum(axis=2).tolist()),
                        dtype=np.float64)

    def _chain(self, hits: list, counts: list) -> list[list[float]]:
        """The levels' chain in plain floats from the per-position sums: 2 x P numbers, recomputed after
        every step's feedback, and numpy's per-call cost, paid with its code cold after the target's
        forward, was most of it."""
        w = self.prior_strength
        out = []
        for h, n in zip(hits, counts, strict=True):
            prev, row = float(self.prior_acceptance), []
            for hj, nj in zip(h, n, strict=True):
                den = nj + w
                prev = (hj + w * prev) / max(den, 1e-12) if den > 0 else prev
                row.append(prev)
            out.append(row)
        return out

    def levels_optimistic(self, z: float = 2.0) -> np.ndarray:
        """[2, P] an upper confidence bound on the acceptance, from the measurements alone (no prior:
        1 before anything is measured, shrinking like 1/sqrt(observations)); a position is bounded
        by the one before it, as in :meth:`levels`. What the acceptance could still be: while this
        bound says drafting could pay, probing is worth it."""
        return self.memo(f"optimistic{z}", lambda: self._levels_optimistic(z))

    def _levels_optimistic(self, z: float) -> np.ndarray:
        h = self.hits.sum(axis=2)
        n = self.counts.sum(axis=2)
        a, b = h + 1.0, (n - h) + 1.0  # a uniform Beta(1, 1) belief, updated by the data
        mean = a / (a + b)
        ucb = np.clip(mean + z * np.sqrt(mean * (1.0 - mean) / (a + b + 1.0)), 0.0, 1.0)
        return np.minimum.accumulate(ucb, axis=1)

    def calibrate(self, conf: np.ndarray, sampled: np.ndarray) -> np.ndarray:
        """[R, N] predicted conditional acceptance -> calibrated, same shape."""
        conf = np.asarray(conf, dtype=np.float64)
        if conf.size <= SMALL:
            return self.calibrate_small(conf, sampled)
        return self.calibrate_arrays(conf, sampled)

    def calibrate_small(self, conf: np.ndarray, sampled: np.ndarray) -> np.ndarray:
        """:meth:`calibrate` in plain floats (the same operations, so the same result)."""
        return np.array(self.calibrate_rows(conf.tolist(), np.asarray(sampled).reshape(-1).tolist()),
                        dtype=np.float64).reshape(conf.shape)

    def calibrate_rows(self, conf: list[list[float]], sampled: list) -> list[list[float]]:
        """:meth:`calibrate` of a few rows as lists, to lists. A row reads its cells of the hit and count
        tables one by one: listing the whole tables, anew after every step's feedback, cost 50-60 us of
        a batch-1 step (``benchmarks/bench_planner.py``)."""
        mp, lv = self._memo_lists()
        prior = self.bin_prior
        hits, counts = self.hits.item, self.counts.item
        out = []
        for row, s in zip(conf, sampled, strict=True):
            m = int(s)
            mpm, lvm = mp[m], lv[m]
            got = []
            for j, c in enumerate(row):
                p = mpm[j]
                q = min(max(lvm[j] * (c / p if p > 0 else 1.0), 0.0), 1.0)
                b = self._bin_one(c)
                got.append((hits(m, j, b) + prior * q) / (counts(m, j, b) + prior))
            out.append(got)
        return out

    def _memo_lists(self) -> tuple[list, list]:
        """The mean confidences and the levels as nested lists (per change of the tables), from one sum of
        each table: the same numbers as :meth:`_mean_pred` and :meth:`_levels` (whose memo it fills), in
        half the numpy calls. After every step's feedback at batch 1 those calls ran cold."""
        out = self._derived.get("lists")
        if out is None:
            cnt = self.counts.sum(axis=2).tolist()
            pred = self.pred_sum.sum(axis=2).tolist()
            mean = [[p / max(c, 1e-12) if c > 0 else 0.0 for p, c in zip(pr, cr, strict=True)]
                    for pr, cr in zip(pred, cnt, strict=True)]
            levels = self._derived.get("levels")
            if levels is None:
                lv = self._chain(self.hits.sum(axis=2).tolist(), cnt)
                self.memo("levels", lambda: np.array(lv, dtype=np.float64))
            else:
                lv = levels.tolist()
            out = self._derived["lists"] = (mean, lv)
        return out

    def calibrate_arrays(self, conf: np.ndarray, sampled: np.ndarray) -> np.ndarray:
        """:meth:`calibrate` in numpy (any size)."""
        r, n = conf.shape
        m = np.asarray(sampled, dtype=np.int64)
        mp = self.memo("mean_pred", self._mean_pred)[m, :n]  # 0 where nothing was measured
        ratio = np.where(mp > 0, conf / np.where(mp > 0, mp, 1.0), 1.0)
        q = np.clip(self.levels()[m, :n] * ratio, 0.0, 1.0)
        mode, pos = m[:, None], np.arange(n)[None, :]
        b = self._bin(conf)
        h = self.hits[mode, pos, b]
        c = self.counts[mode, pos, b]
        return (h + self.bin_prior * q) / (c + self.bin_prior)

    def _mean_pred(self) -> np.ndarray:
        """[2, P] mean confidence seen per mode and position (0 where nothing was measured)."""
        cnt = self.counts.sum(axis=2)
        return np.where(cnt > 0, self.pred_sum.sum(axis=2) / np.maximum(cnt, 1e-12), 0.0)

    def observe(self, conf: Sequence[float], verified: int, accepted: int, sampled: bool) -> None:
        """One request's verified drafts: positions < accepted were accepted, position ``accepted`` was not."""
        self.observe_many([(conf, verified, accepted, sampled)])

    def observe_many(self, items: Sequence[tuple[Sequence[float], int, int, bool]]) -> None:
        """A step's verdicts at once, ``(conf, verified, accepted, sampled)`` per request: the tables end as
        :meth:`observe` called on each in turn leaves them (an observation fades by ``memory`` once per later
        one of its mode), in one update per table and mode. Request by request it took 0.2-0.3 ms of every
        step at batch 8 (four array updates per request)."""
        for m in (0, 1):
            mine = [x for x in items if x[1] > 0 and int(bool(x[3])) == m]
            if mine:
                self._observe_mode(m, mine)

    def _observe_mode(self, m: int, items: Sequence[tuple[Sequence[float], int, int, bool]]) -> None:
        self._derived.clear()
        keep = 1.0 - 1.0 / self.memory if self.memory > 0 else 1.0
        k = len(items)
        pos: list[int] = []
        cs: list[float] = []
        hit: list[float] = []
        w: list[float] = []
        for i, (conf, verified, accepted, _) in enumerate(items):
            fade = keep ** (k - 1 - i)
            for j in range(min(int(accepted), int(verified) - 1) + 1):
                pos.append(j)
                cs.append(float(conf[j]))
                hit.append(1.0 if j < accepted else 0.0)
                w.append(fade)
        if keep != 1.0:
            for table in (self.hits, self.counts, self.pred_sum):
                table[m] *= keep ** k
        if len(pos) <= SMALL_VERDICTS:
            self._add_small(m, pos, cs, hit, w)
            return
        c = np.asarray(cs, dtype=np.float64)
        flat = np.asarray(pos, dtype=np.int64) * self.bins + self._bin(c)
        h, wt = np.asarray(hit, dtype=np.float64), np.asarray(w, dtype=np.float64)
        size = self.num_positions * self.bins
        for table, weights in ((self.counts, wt), (self.pred_sum, wt * c), (self.hits, wt * h),
                               (self.total_counts, None), (self.total_pred, c), (self.total_hits, h)):
            table[m] += np.bincount(flat, weights=weights, minlength=size).reshape(self.num_positions, self.bins)

    def _add_small(self, m: int, pos: list[int], cs: list[float], hit: list[float], w: list[float]) -> None:
        """The tables' increments of :meth:`_observe_mode` in plain floats: each cell's sum built in the
        verdicts' order from 0, then added to the table, as ``np.bincount`` and ``+=`` do."""
        sums: dict[tuple[int, int], list[float]] = {}
        for j, c, h, wt in zip(pos, cs, hit, w, strict=True):
            cell = (j, self._bin_one(c))
            acc = sums.get(cell)
            if acc is None:
                acc = sums[cell] = [0.0, 0.0, 0.0, 0, 0.0, 0.0]
            acc[0] += wt
            acc[1] += wt * c
            acc[2] += wt * h
            acc[3] += 1
            acc[4] += c
            acc[5] += h
        tables = (self.counts, self.pred_sum, self.hits, self.total_counts, self.total_pred, self.total_hits)
        for (j, b), acc in sums.items():
            for table, x in zip(tables, acc, strict=True):
                table[m, j, b] += x

    def soften(self, cap: float) -> None:
        """Keep what was measured as at most ``cap`` observations per mode and position (rates kept).

        Evidence fades only as new evidence arrives (``memory``). A drafter its evidence put out of use
        is not measured again, so that evidence would speak for every later workload: at batch 1 on
        HumanEval after the chat set the drafter never drafted again (0 of 631 steps; 131 drafts and
        1.39x against 1.27x in a fresh engine). The budget softens it when the drafter has gone
        unmeasured for long, so that its upper bound lets a probe look again."""
        n = self.counts.sum(axis=2, keepdims=True)
        scale = np.minimum(1.0, cap / np.maximum(n, 1e-12))
        if np.all(scale >= 1.0):
            return
        self._derived.clear()
        for table in (self.hits, self.counts, self.pred_sum):
            table *= scale

    def seed(self, hits: np.ndarray, counts: np.ndarray, pred: np.ndarray, *, sampled: bool = False,
             cap: float = 40.0) -> None:
        """Start from an offline measurement ([P, bins] hits, counts and summed confidences, e.g. the copy
        source walked over committed answers) instead of the pessimistic prior.

        Each cell keeps its measured rate but weighs at most ``cap`` observations, so online evidence
        (which fades the seed like any old evidence, ``memory``) takes over after a few dozen verified
        drafts. The seed is belief, not measurement: the report's totals and :meth:`measured` leave it out.
        """
        self._derived.clear()
        c = np.asarray(counts, dtype=np.float64)[: self.num_positions, : self.bins]
        scale = np.minimum(1.0, cap / np.maximum(c, 1e-12))
        p, b = c.shape
        m = int(sampled)
        self.counts[m, :p, :b] += c * scale
        self.hits[m, :p, :b] += np.asarray(hits, dtype=np.float64)[:p, :b] * scale
        self.pred_sum[m, :p, :b] += np.asarray(pred, dtype=np.float64)[:p, :b] * scale

    def table(self) -> dict:
        """The head's calibration: predicted vs measured conditional acceptance per position and per
        confidence bin (both modes pooled, every observation), the expected calibration error over
        the bins, and the levels the budget currently uses (greedy, sampled)."""
        cnt = self.total_counts.sum(axis=(0, 2))
        bcnt = self.total_counts.sum(axis=(0, 1))
        bpred = self.total_pred.sum(axis=(0, 1)) / np.maximum(bcnt, 1)
        bmeas = self.total_hits.sum(axis=(0, 1)) / np.maximum(bcnt, 1)
        total = float(bcnt.sum())
        ece = float((bcnt * np.abs(bpred - bmeas)).sum() / total) if total else float("nan")
        return {"count": cnt.tolist(),
                "predicted": (self.total_pred.sum(axis=(0, 2)) / np.maximum(cnt, 1)).tolist(),
                "measured": (self.total_hits.sum(axis=(0, 2)) / np.maximum(cnt, 1)).tolist(),
                "bins": {"count": bcnt.tolist(), "predicted": bpred.tolist(), "measured": bmeas.tolist()},
                "ece": ece, "levels": self.levels().tolist()}
