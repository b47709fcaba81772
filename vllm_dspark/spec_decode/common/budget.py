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

Costs come from a start-up profile (:class:`CostModel`, ``costs.py``, cached on
disk) and are corrected online by the step times actually observed; a profile
the corrections keep disowning is stale (:attr:`CostModel.stale`).

Nothing the confidence head says is trusted before it is measured
(:class:`Calibrator`, ``calibration.py``): the acceptance prior is pessimistic (10% per position,
worth 4 observations), a position nothing has reached yet is assumed no better
than the one before, and the head's confidence only ranks slots within a
position. So an unproven drafter does not draft; :class:`BudgetPolicy` lets it
prove itself with cheap **probes** (2 drafts for a few requests) while an upper
bound of its measured acceptance could still pay, within a probe budget and
with a doubling wait, and starts drafting once the *measured* acceptance says
drafting pays. A run of all-rejected drafting steps stops admitting (after
``reject_run`` steps, or as soon as the run was unlikely under the measured
acceptance), and only probes follow until one is accepted.

This follows vLLM 0.33's adaptive verification (V2 runner) in spirit:
survival-ranked global admission under profiled costs. It differs in
deliberate ways: the admission rule maximises the measured throughput ratio
instead of filling a fixed budget, the head's confidences are recalibrated
online from observed acceptances, and an unproven head is not believed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from vllm_dspark.spec_decode.common.calibration import SMALL, Calibrator
from vllm_dspark.spec_decode.common.costs import CostModel
from vllm_dspark.spec_decode.common.sources import MODEL_SOURCE

# numpy adds fewer numbers than this one after another; from here on it sums pairwise (other bits).
PAIRWISE = 8


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


def expected_tokens(surv: np.ndarray, caps: Sequence[int]) -> np.ndarray:
    """[R, N] survivals -> [R] expected accepted tokens within each request's cap."""
    if surv.ndim == 2 and surv.shape[1] < PAIRWISE and surv.size <= SMALL:
        # Plain floats, summed in order as numpy sums fewer than PAIRWISE numbers: the same bits, without
        # four array calls that run cold after the target's forward (every copy step at batch 1 asks twice).
        return np.array([sum(row[:max(int(c), 0)]) for row, c in zip(surv.tolist(), caps, strict=True)],
                        dtype=np.float64)
    within = np.arange(surv.shape[1])[None, :] < np.asarray(caps, dtype=np.int64)[:, None]
    return np.where(within, surv, 0.0).sum(1)


def allocate(surv: np.ndarray, caps: Sequence[int], costs: CostModel, *, extra_tokens: int = 0,
             margin: float = 0.02, source_cost: float = 0.0) -> Allocation:
    """Admit the survival-ranked prefix of slots that maximises expected tokens per second.

    Parameters
    ----------
    surv : [R, N] survival probabilities (non-increasing along each row)
    caps : [R] the most drafts each request may verify (0 = none)
    costs : the cost model
    extra_tokens : tokens in the next step besides the R decode tokens and the drafts
        (e.g. prefill chunks scheduled alongside), which the verify cost also pays for
    margin : drafting must beat plain decoding by this fraction to be forecast to pay
    source_cost : seconds the drafts' source adds to a step that sends any (the copy's, measured:
        ``CostModel.observe_source``); the admitted prefix pays for it, or nothing is admitted
    """
    surv = np.asarray(surv, dtype=np.float64)
    if surv.ndim == 2 and surv.size <= SMALL:
        return _allocate_small(surv, caps, costs, extra_tokens, margin, source_cost)
    surv = np.minimum.accumulate(surv, axis=1) if surv.size else surv
    r = surv.shape[0]
    base_tokens = r + extra_tokens
    # Each request's first caps[i] slots, row by row (boolean indexing keeps that order).
    if r:
        within = np.arange(surv.shape[1])[None, :] < np.asarray(caps, dtype=np.int64).reshape(r, 1)
        values, rows = surv[within], np.nonzero(within)[0]
    else:
        values, rows = np.zeros(0), np.zeros(0, dtype=np.int64)
    t_plain = float(costs.verify_time(base_tokens))
    plain_rate = r / t_plain if t_plain > 0 else 0.0
    d = costs.draft_time(r)
    if not values.size:
        return Allocation([0] * r, float(r), t_plain, plain_rate, plain_rate, 0.0, False)
    order = np.argsort(-values, kind="stable")  # ties: lower position first
    v = values[order]
    m = np.arange(len(v) + 1)
    gain = np.concatenate([[0.0], np.cumsum(v)])
    t = np.asarray(costs.verify_time(base_tokens + m), dtype=np.float64)
    t[1:] += source_cost
    rate = (r + gain) / t
    best = int(np.argmax(rate))
    draft_rate = float(np.max((r + gain) / (t + d)))
    kept = np.bincount(rows[order[:best]], minlength=r).tolist()
    return Allocation(kept, float(r + gain[best]), float(t[best]), plain_rate, float(rate[best]),
                      draft_rate, draft_rate > plain_rate * (1.0 + margin))


def _allocate_small(surv: np.ndarray, caps: Sequence[int], costs: CostModel, extra_tokens: int, margin: float,
                    source_cost: float) -> Allocation:
    """:func:`allocate` in plain floats for a few slots: the same operations in the same order (the verify
    curve priced by the same call), so the same allocation to the bit."""
    r = surv.shape[0]
    base_tokens = r + extra_tokens
    values: list[float] = []
    owners: list[int] = []
    for i, (row, cap) in enumerate(zip(surv.tolist(), caps, strict=True)):
        low = 0.0
        for j, x in enumerate(row):
            low = x if j == 0 else min(low, x)  # np.minimum.accumulate
            if j < int(cap):
                values.append(low)
                owners.append(i)
    t_plain = float(costs.verify_time(base_tokens))
    plain_rate = r / t_plain if t_plain > 0 else 0.0
    d = costs.draft_time(r)
    if not values:
        return Allocation([0] * r, float(r), t_plain, plain_rate, plain_rate, 0.0, False)
    order = sorted(range(len(values)), key=lambda k: -values[k])  # stable: ties keep the lower position first
    gain = [0.0]
    for k in order:
        gain.append(gain[-1] + values[k])
    t = costs.verify_prefixes(base_tokens, len(values))
    t = [t[0]] + [x + source_cost for x in t[1:]]
    rate = [(r + g) / x for g, x in zip(gain, t, strict=True)]
    best = max(range(len(rate)), key=rate.__getitem__)  # the first of equal maxima, as np.argmax
    draft_rate = max((r + g) / (x + d) for g, x in zip(gain, t, strict=True))
    kept = [0] * r
    for k in order[:best]:
        kept[owners[k]] += 1
    return Allocation(kept, float(r + gain[best]), float(t[best]), plain_rate, float(rate[best]), draft_rate,
                      draft_rate > plain_rate * (1.0 + margin))


def forecast_pays(mean_surv: Sequence[float], requests: int, cap: int, costs: CostModel,
                  margin: float = 0.02) -> bool:
    """Whether drafting pays for ``requests`` requests with a typical survival profile."""
    if requests <= 0 or cap <= 0:
        return False
    s = np.tile(np.asarray(mean_surv, dtype=np.float64)[None, :cap], (requests, 1))
    return allocate(s, [cap] * requests, costs, margin=margin).draft_pays


# ------------------------------------------------------------------ trust
@dataclass(frozen=True)
class TrustConfig:
    """How an unproven drafter proves itself, and how a drafter that stops being accepted is stopped.

    ``prior_strength`` / ``prior_acceptance``: the calibrator's pessimistic prior
    (pseudo-observations and the acceptance they assume at the first position).
    ``probe_tokens``: drafts a probe verifies per probed request (at most
    ``probe_requests`` requests per probe; 0: no probes). ``probe_period``: steps
    without drafting before the first probe; the wait doubles after every probe
    whose drafts were all rejected (and after every drafting step whose allocation
    says drafting stopped paying), up to ``probe_max_period``, and returns to
    ``probe_period`` once drafting pays. ``reject_run``: that many drafting steps
    in a row in which every verified draft was rejected stop admitting (0: never);
    then only probes run until one is accepted. ``probe_overhead``: after a first burst
    of a few probes (at any batch size), probes take at most this share of the time.
    """

    prior_strength: float = 4.0
    prior_acceptance: float = 0.1
    probe_tokens: int = 2
    probe_period: int = 1
    probe_max_period: int = 256
    reject_run: int = 8
    probe_requests: int = 4
    probe_overhead: float = 0.02


class PlanMode(StrEnum):
    """What a step runs (a ``str``: plans cross the TP broadcast and the trace as plain strings)."""

    SKIP = "skip"  # no source runs its forward; the drafter's context K/V is kept (held or stored)
    PROBE = "probe"  # the sources run for ``rows`` only, ``tokens`` drafts each, verified whatever they cost
    DRAFT = "draft"  # the sources run for every request; the allocation decides what is verified


@dataclass(frozen=True)
class Plan:
    """What the next step runs. ``sources`` say which draft sources run (the drafter's forward
    among them); ``mode`` says which of their drafts are sent: none (``skip``), ``tokens`` for each
    of ``rows`` (``probe``), or what the allocation admits (``draft``)."""

    mode: PlanMode
    rows: tuple[int, ...] = ()
    tokens: int = 0
    sources: tuple[str, ...] | None = None  # None: the drafter for probe and draft, nothing for skip
    # The copy source's drafts decided with the plan (``copy_policy.py``): kept per request, and
    # whether they were sent as a probe or by the allocation. Empty when the copy sends nothing
    # now, or when a drafting step leaves the choice to ``choose_among``.
    copy_kept: tuple[int, ...] = ()
    copy_mode: PlanMode = PlanMode.SKIP

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", PlanMode(self.mode))
        object.__setattr__(self, "copy_mode", PlanMode(self.copy_mode))
        if self.sources is None:
            object.__setattr__(self, "sources", () if self.mode is PlanMode.SKIP else (MODEL_SOURCE,))

    @property
    def runs(self) -> bool:
        """Whether any source runs its forward this step."""
        return bool(self.sources)

    @property
    def drafter_runs(self) -> bool:
        """Whether the drafter's forward (block forward and Markov stage) runs this step."""
        return MODEL_SOURCE in (self.sources or ())

    def to_wire(self) -> tuple:
        return (str(self.mode), self.rows, self.tokens, self.sources, self.copy_kept, str(self.copy_mode))

    @classmethod
    def from_wire(cls, w: Sequence) -> Plan:
        copy_kept = tuple(int(x) for x in w[4]) if len(w) > 4 else ()
        return cls(PlanMode(w[0]), tuple(int(x) for x in w[1]), int(w[2]), tuple(str(x) for x in w[3]),
                   copy_kept, PlanMode(w[5]) if len(w) > 5 else PlanMode.SKIP)


@dataclass(frozen=True)
class Feedback:
    """One request's drafts as the verify step judged them."""

    confidence: Sequence[float]  # the confidences the drafts were sent with
    verified: int  # drafts the target verified
    accepted: int  # of which accepted (a prefix)
    sampled: bool  # drafted by sampling (judged by the ratio test)
    source: str = MODEL_SOURCE

    @classmethod
    def of(cls, x: Feedback | Sequence) -> Feedback:
        """A record, or the ``(confidence, verified, accepted, sampled)`` tuple older callers pass."""
        return x if isinstance(x, Feedback) else cls(*x)


SKIP = Plan(PlanMode.SKIP)
STOP_SURPRISE = float(np.log(100.0))
# The drafter unmeasured for this many planned steps (or for LOAD_STALE_STEPS when the load changes):
# what was measured of it is softened to STALE_EVIDENCE observations a position (Calibrator.soften).
STALE_STEPS = 256
LOAD_STALE_STEPS = 32
STALE_EVIDENCE = 4.0
PROBE_BURST = 4.0
DRAFT = Plan(PlanMode.DRAFT)


class ProbeRhythm:
    """How long a source waits between looks (probes, checks): ``period`` steps, doubled when a look
    finds nothing to accept (up to ``longest``), halved when one is accepted (down to ``shortest``);
    ``wait`` counts the steps left. The drafter's policy and the copy's each keep one."""

    def __init__(self, shortest: int, longest: int):
        self.shortest, self.longest = max(1, shortest), max(1, longest)
        self.reset()

    def reset(self) -> None:
        self.period = self.wait = self.shortest

    def grow(self) -> None:
        self.period = min(self.longest, self.period * 2)

    def rejected(self) -> None:
        """A look found nothing accepted: wait a doubled period."""
        self.grow()
        self.wait = self.period

    def accepted(self) -> None:
        """A look came back accepted: look again sooner."""
        self.period = max(self.shortest, self.period // 2)
        self.wait = min(self.wait, self.period)

    def look_now(self) -> None:
        """Look at the next step and back off afresh from the shortest period (the load changed, or
        the evidence that set the wait was softened)."""
        self.period, self.wait = self.shortest, 0

    def due(self) -> bool:
        """Count one step; True (and a new wait begins) when the wait is over."""
        self.wait -= 1
        if self.wait > 0:
            return False
        self.wait = self.period
        return True


class BudgetPolicy:
    """The budget's decisions, step by step: draft, probe or skip; and which drafts to verify.

    States:

    * ``waiting`` (the start): drafting has not been shown to pay. Each time the
      wait runs out, the step drafts in full if the *measured* acceptance levels
      (:meth:`Calibrator.levels`, not the head's word) forecast that drafting
      pays at this batch size, else it probes: ``probe_tokens`` drafts for a few
      requests, verified whatever they cost. A probe with no acceptance doubles
      the wait. No probe is made when even a drafter that is always accepted
      could not pay under the cost model.
    * ``drafting``: every step drafts, and :func:`allocate` decides what is
      verified. When its forecast and the measured levels both say the next
      step's drafting will not pay, back to ``waiting``.
    * ``blocked``: ``reject_run`` drafting steps in a row had every verified draft
      rejected. Nothing is admitted but probes (with the doubling wait) until a
      probe is accepted.

    A drafter unmeasured for ``STALE_STEPS`` planned steps (``LOAD_STALE_STEPS`` after a load
    change) has its evidence softened (:meth:`Calibrator.soften`) and its wait restarted, so
    that old evidence cannot keep it out of use on a workload it never saw.

    Greedy and sampled requests are measured apart (a sampled draft is accepted
    by a different rule), but they share one wait. So when requests of a mode
    nothing has measured yet join the batch, the wait ends at once, and the
    probe that follows takes their rows first: sampled requests arriving after
    greedy ones had grown the wait to hundreds of steps would otherwise wait
    that long for their first look.

    Pure logic (numpy only); the proposer feeds it acceptances and confidences,
    and under tensor parallelism only the deciding rank runs it.
    """

    def __init__(self, num_positions: int, trust: TrustConfig | None = None, *, costs: CostModel | None = None,
                 margin: float = 0.02):
        self.trust = trust or TrustConfig()
        t = self.trust
        self.num_positions = num_positions
        # Each source proves itself on its own evidence; the drafter's is the one the plan reads.
        self.calibrators: dict[str, Calibrator] = {}
        self.calibrator = self.calibrator_of(MODEL_SOURCE)
        self.costs = costs
        self.margin = margin
        self.state = "waiting"
        self.rhythm = ProbeRhythm(t.probe_period, t.probe_max_period)
        self.wait_batch = 0
        self.reject_steps = 0
        self.surprise = 0.0  # -log P(the current run of rejections) under the measured acceptance
        self.draft_pays_next = False
        self.credit = PROBE_BURST  # probes the measurements do not justify, still allowed
        self._cursor = 0
        self._fresh_present = False  # the last plan's batch had a request of an unmeasured mode
        self.unmeasured = 0  # planned steps since the drafter's drafts were last verified
        self.counters = dict.fromkeys(("probes", "probes_accepted", "full_checks", "stops", "unblocks", "softened"), 0)

    def calibrator_of(self, source: str) -> Calibrator:
        cal = self.calibrators.get(source)
        if cal is None:
            t = self.trust
            cal = self.calibrators[source] = Calibrator(self.num_positions, prior_strength=t.prior_strength,
                                                        prior_acceptance=t.prior_acceptance)
        return cal

    # -------------------------------------------------------------- feedback
    def feedback(self, kind: str, results: Sequence[Feedback | tuple]) -> None:
        """The verify step just run: ``kind`` (the :class:`PlanMode`) of the step that proposed, and
        one :class:`Feedback` per request that sent drafts (or its 4-tuple)."""
        seen = [f for f in map(Feedback.of, results) if f.verified > 0]
        # What was expected of the drafter's first positions (before they are observed).
        first = self.calibrator.levels()[:, 0]
        for source in dict.fromkeys(f.source for f in seen):
            self.calibrator_of(source).observe_many([(f.confidence, f.verified, f.accepted, f.sampled)
                                                     for f in seen if f.source == source])
        # The states below are the drafter's: another source's drafts (a copy) are no evidence of it.
        seen = [f for f in seen if f.source == MODEL_SOURCE]
        if not seen:
            return
        self.unmeasured = 0
        accepted_any = any(f.accepted > 0 for f in seen)
        t = self.trust
        if kind == PlanMode.PROBE:
            if accepted_any:
                self.counters["probes_accepted"] += 1
                self.rhythm.accepted()
                if self.state == "blocked":
                    self.state, self.rhythm.wait = "waiting", 1
                    self.counters["unblocks"] += 1
            else:  # (a probe's feedback arrives the step after it)
                self.rhythm.rejected()
        elif kind == PlanMode.DRAFT:
            if accepted_any:
                self.reject_steps, self.surprise = 0, 0.0
            else:
                self.reject_steps += 1
                self.surprise += float(sum(-np.log(max(1e-9, 1.0 - first[int(f.sampled)])) for f in seen))
            # Stop after reject_run such steps, or sooner once the run was unlikely (< 1 %) under the
            # measured acceptance: one step at batch 32, two at batch 1 after 90 % acceptance.
            run_over = self.reject_steps >= t.reject_run or self.surprise >= STOP_SURPRISE
            if t.reject_run > 0 and run_over and self.state != "blocked":
                self.state, self.reject_steps, self.surprise = "blocked", 0, 0.0
                self.rhythm.reset()
                self.counters["stops"] += 1

    # -------------------------------------------------------------- decisions
    def level_survival(self, sampled: np.ndarray, *, optimistic: bool = False) -> np.ndarray:
        """[R, N] survival per request from the measured levels of its mode (or their upper bound)."""
        cal = self.calibrator
        # Both modes' survival once per change of the tables (a row's cumulative product is the same alone).
        both = cal.memo("survival_optimistic" if optimistic else "survival",
                        lambda: survival(cal.levels_optimistic() if optimistic else cal.levels()))
        return both[np.asarray(sampled, dtype=np.int64)]

    def drafter_pays(self, caps: Sequence[int], sampled: np.ndarray) -> bool:
        """Whether the drafter's forward, for these requests alone, pays by its measured levels."""
        return self._pays(self.level_survival(sampled), caps)

    def _pays(self, surv: np.ndarray, caps: Sequence[int]) -> bool:
        assert self.costs is not None
        return allocate(surv, caps, self.costs, margin=self.margin).draft_pays

    def plan(self, caps: Sequence[int], sampled: np.ndarray, *, nothing_to_copy: bool = False) -> Plan:
        """The next step's plan (called after :meth:`feedback`). ``nothing_to_copy``: the copy source is on
        and offers nothing this step."""
        r = len(caps)
        if r == 0 or max(caps, default=0) <= 0 or self.costs is None:
            return SKIP
        # Probe credit, counted in probes (PROBE_BURST at most), refilled at probe_overhead of the step
        # time priced at this batch's probe cost. Not in seconds: vLLM may step on a batch's first
        # request alone, and a burst priced at that step's size could not buy one probe of the batch.
        refill = self.trust.probe_overhead * float(self.costs.verify_time(r)) / max(self._probe_cost(r), 1e-12)
        self.credit = min(self.credit + refill, PROBE_BURST)
        if self.state == "drafting":
            # One step's confidences are a noisy forecast of the next: a step whose drafts did not pay
            # ends drafting only when the measured levels say drafting no longer pays either. Ending it on
            # that step alone doubled the wait each time, and at batch 1 the drafter drafted once in up to
            # 256 steps where it paid (copy set: 0.67 tokens accepted a draft, 5 ms a forward, 25 ms a step).
            # The last allocation may have priced copies with the drafter: with nothing to copy this step, only
            # the drafter's own levels speak for its forward. Running it anyway cost 12 ms a step at batch 8 on
            # HumanEval, for 47 accepted tokens of 484 verified in a 452-step lockstep cell. Staying in this
            # state without it would stop the drafter's probes for good (nothing else here measures it).
            if (self.draft_pays_next and not nothing_to_copy) or self.drafter_pays(caps, sampled):
                return DRAFT
            self.state = "waiting"  # neither the allocation nor the levels say the next drafting step pays
            self.rhythm.rejected()
            self.wait_batch = r
        self.unmeasured += 1
        load_changed = bool(self.wait_batch) and not (self.wait_batch / 2 <= r <= self.wait_batch * 2)
        if load_changed:
            # The load changed: look again now, and back off afresh. A wait doubled to hundreds of steps at
            # batch 8, where the copies left the drafter few rows and those were rejected, kept it from
            # drafting at batch 1 after (HumanEval: 24 of 151 steps without a draft before the drafter's
            # forward was priced against the copies, 176 of 231 after, in one lockstep run).
            self.rhythm.look_now()
        if self.unmeasured >= (LOAD_STALE_STEPS if load_changed else STALE_STEPS):
            # Old evidence would keep its upper bound shut (so no probe) on a workload it never saw.
            self.calibrator.soften(STALE_EVIDENCE)
            self.unmeasured = 0
            self.rhythm.look_now()
            self.counters["softened"] += 1
        fresh = self._fresh_rows(caps, sampled)
        if fresh and not self._fresh_present:
            self.rhythm.wait = 0  # a mode nothing has measured joined: the wait was earned by the other one
        self._fresh_present = bool(fresh)
        if not self.rhythm.due():
            return SKIP
        self.wait_batch = r
        if self.state == "waiting":
            self.counters["full_checks"] += 1
            if self.drafter_pays(caps, sampled):
                self.state = "drafting"
                return DRAFT
        return self._probe(caps, sampled, fresh)

    def _fresh_rows(self, caps: Sequence[int], sampled: np.ndarray) -> list[int]:
        """Requests that could draft, of a mode (greedy, sampled) the calibrator has not measured."""
        unmeasured = [not self.calibrator.measured(False), not self.calibrator.measured(True)]
        if not any(unmeasured):
            return []
        # Plain ints: a greedy batch asks this every step (the sampled mode stays unmeasured), and five
        # array calls ran cold there after the target's forward.
        return [i for i, (c, s) in enumerate(zip(caps, np.asarray(sampled).reshape(-1).tolist(), strict=True))
                if c > 0 and unmeasured[int(s)]]

    def _probe_rows(self, caps: Sequence[int], fresh: Sequence[int]) -> tuple[int, ...]:
        """Up to ``probe_requests`` rows in turn, those of an unmeasured mode (``fresh``) first."""
        eligible = [i for i, c in enumerate(caps) if c > 0]
        take = min(len(eligible), self.trust.probe_requests)
        start = self._cursor % len(eligible)
        turn = [eligible[(start + j) % len(eligible)] for j in range(len(eligible))]
        new = set(fresh)
        first = [i for i in turn if i in new] + [i for i in turn if i not in new]
        return tuple(sorted(first[:take]))

    def _probe_cost(self, r: int) -> float:
        """Seconds a probe adds to a plain step of ``r`` requests (drafter priced as a full draft step)."""
        assert self.costs is not None
        extra = min(r, self.trust.probe_requests) * self.trust.probe_tokens
        return float(self.costs.draft_time(r) + self.costs.verify_time(r + extra) - self.costs.verify_time(r))

    def _probe(self, caps: Sequence[int], sampled: np.ndarray, fresh: Sequence[int]) -> Plan:
        t = self.trust
        k = min(t.probe_tokens, max(caps))
        if k <= 0 or t.probe_requests <= 0:
            return SKIP
        # Probe while the acceptance could still be high enough to pay (its upper bound pays) and
        # the credit allows; otherwise look again later (sooner if the batch size changes).
        if self.credit < 1.0:
            return SKIP
        if not self._pays(self.level_survival(sampled, optimistic=True), caps):
            self.rhythm.rejected()
            return SKIP
        self.credit -= 1.0
        rows = self._probe_rows(caps, fresh)
        self._cursor += len(rows)
        self.counters["probes"] += 1
        return Plan(PlanMode.PROBE, rows, k)

    def choose(self, conf: np.ndarray, caps: Sequence[int], sampled: np.ndarray) -> Allocation:
        """A drafting step's allocation of the drafter's drafts (and whether the next step should draft)."""
        return self.choose_among({MODEL_SOURCE: conf}, caps, sampled)[0]

    def choose_among(self, confs: dict[str, np.ndarray], caps: Sequence[int],
                     sampled: np.ndarray) -> tuple[Allocation, list[str]]:
        """Rank the slots of every source's drafts against one verify cost.

        ``confs``: source -> [R, N] confidences of its drafts for every request. Each request takes
        the source whose calibrated survival promises the most accepted tokens within its cap (ties:
        the first source given); the chosen slots are then admitted by :func:`allocate`. Returns the
        allocation and the source each request takes.
        """
        assert self.costs is not None
        names = list(confs)
        survs = [survival(self.calibrator_of(s).calibrate(confs[s], sampled)) for s in names]
        expected = np.stack([expected_tokens(x, caps) for x in survs])
        pick = np.argmax(expected, axis=0) if len(names) > 1 else np.zeros(len(caps), dtype=np.int64)
        surv = np.stack(survs)[pick, np.arange(len(caps))] if len(caps) else survs[0]
        alloc = allocate(surv, caps, self.costs, margin=self.margin)
        self.draft_pays_next = alloc.draft_pays
        # With copies in the allocation this stays the drafting state's forecast, not a verdict on the
        # drafter: whether its forward runs beside the copies is decided each step (CopyPolicy._forward_pays).
        # Judging it here instead put the drafter to a doubled wait each time the copies won a step, and at
        # batch 1 it then never drafted where nothing matched (HumanEval 1.46x -> 1.31x, copy set 1.79x -> 1.45x).
        if alloc.draft_pays:
            self.rhythm.period = self.rhythm.shortest
        return alloc, [names[int(i)] for i in pick]

    def probe_kept(self, plan: Plan, caps: Sequence[int]) -> list[int]:
        rows = set(plan.rows)
        return [min(plan.tokens, int(c)) if i in rows else 0 for i, c in enumerate(caps)]

    def report(self) -> dict:
        return {"state": self.state, "period": self.rhythm.period, "wait": self.rhythm.wait,
                "reject_steps": self.reject_steps,
                "credit_probes": self.credit, **self.counters, "trust": dict(self.trust.__dict__)}
