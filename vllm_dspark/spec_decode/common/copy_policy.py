"""When the copy source's drafts are sent, and when the drafter's forward can be skipped for them.

The copy source (``copy_source.py``) offers, per request, up to N tokens copied from its own text
and a confidence that ranks them by match length. Whether they are worth verifying is the
budget's question, answered with the budget's machinery on the copy's own evidence:

* its own :class:`~vllm_dspark.spec_decode.common.calibration.Calibrator` (``BudgetPolicy.
  calibrator_of(COPY_SOURCE)``), which learns acceptance per position and per confidence bin,
  so per match length. It starts from the acceptance measured offline on the target's answers and
  stored with the drafter (``copy_prior.py``), so a match is drafted from the first step where it
  pays; without a stored prior nothing is believed before it is measured;
* the same :func:`~vllm_dspark.spec_decode.common.budget.allocate` against the same verify
  cost. A copy costs no forward, so its slots pay as soon as their survival outweighs their
  verify time;
* probes while it is unproven: when the calibrated survival admits nothing but its optimistic
  bound would, the longest matches verify ``probe_tokens`` copied tokens each, with a wait that
  doubles after a probe with nothing accepted and halves after an accepted one (the drafter's
  probe rhythm, kept apart: a copy's evidence says nothing about the drafter's).

On a step the drafter drafts in full, each request takes the source whose calibrated survival
promises more (``BudgetPolicy.choose_among``). When the copies alone forecast at least the rate the
drafter's forward would reach beside them, its cost paid (the requests its measured levels promise
more for, priced together), the plan drops that forward (``sources`` = copy only): only its context
K/V is kept, as on any step without a forward.

Pure logic (numpy); under TP only the deciding rank runs it and the plan is broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_dspark.spec_decode.common.budget import (
    BudgetPolicy,
    Feedback,
    Plan,
    PlanMode,
    ProbeRhythm,
    allocate,
    expected_tokens,
    survival,
)
from vllm_dspark.spec_decode.common.calibration import SMALL
from vllm_dspark.spec_decode.common.copy_prior import CopyPrior
from vllm_dspark.spec_decode.common.sources import COPY_SOURCE, MODEL_SOURCE


class CopyPolicy:
    """The copy source's decisions, beside the drafter's :class:`BudgetPolicy` (which it shares
    the cost model, the trust settings and the calibrators with)."""

    def __init__(self, policy: BudgetPolicy, prior: CopyPrior | None = None):
        self.policy = policy
        self.calibrator = policy.calibrator_of(COPY_SOURCE)
        self.prior = prior
        if prior is not None:  # greedy acceptance measured offline (copy_prior.py); sampled starts pessimistic
            self.calibrator.seed(prior.hits, prior.counts, prior.pred)
        self.rhythm = ProbeRhythm(policy.trust.probe_period, policy.trust.probe_max_period)  # its own
        self.counters = dict.fromkeys(("probes", "probes_accepted", "steps_sent", "steps_copy_only"), 0)

    # -------------------------------------------------------------- evidence
    def feedback(self, kind: PlanMode, results: Sequence[Feedback]) -> None:
        """The copy drafts just verified (``kind``: how they were sent). The calibrator learns in
        :meth:`BudgetPolicy.feedback`; here only the probe rhythm moves."""
        seen = [f for f in results if f.verified > 0 and f.source == COPY_SOURCE]
        if not seen or kind is not PlanMode.PROBE:
            return
        if any(f.accepted > 0 for f in seen):
            self.counters["probes_accepted"] += 1
            self.rhythm.accepted()
        else:
            self.rhythm.rejected()

    # -------------------------------------------------------------- pieces
    def cost(self, requests: int) -> float:
        """The copy's own cost of a step that sends copies at this batch size, once measured (0 before:
        the first copy step measures it)."""
        costs = self.policy.costs
        return costs.draft_time(requests, COPY_SOURCE) if costs is not None and costs.has_source(COPY_SOURCE) \
            else 0.0

    def survival(self, conf: np.ndarray, lengths: Sequence[int], sampled: np.ndarray, *,
                 optimistic: bool = False) -> np.ndarray:
        """[R, N] calibrated survival of each request's copy (0 past its copied length)."""
        conf = np.asarray(conf, dtype=np.float64)
        if not optimistic and conf.size <= SMALL:
            return self._survival_small(conf, lengths, sampled)
        if optimistic:
            lv = self.calibrator.levels_optimistic()[np.asarray(sampled, dtype=np.int64)]
            s = survival(lv[:, :conf.shape[1]])
        else:
            s = survival(self.calibrator.calibrate(conf, sampled))
        return np.where(np.arange(conf.shape[1])[None, :] < np.asarray(lengths)[:, None], s, 0.0)

    def _survival_small(self, conf: np.ndarray, lengths: Sequence[int], sampled: np.ndarray) -> np.ndarray:
        """:meth:`survival` of a few rows in plain floats: calibrated, clipped and multiplied along the row
        in the order ``np.cumprod`` does, zero past the copy (the same bits). At batch 1 every copy step
        pays it, after the target's forward left numpy's code cold: six array calls were most of it."""
        out = []
        cal = self.calibrator.calibrate_rows(conf.tolist(), np.asarray(sampled).reshape(-1).tolist())
        for row, n in zip(cal, lengths, strict=True):
            got, prod = [], 1.0
            for j, c in enumerate(row):
                x = min(max(c, 0.0), 1.0)
                prod = x if j == 0 else prod * x
                got.append(prod if j < n else 0.0)
            out.append(got)
        return np.array(out, dtype=np.float64).reshape(conf.shape)

    def model_expected(self, caps: Sequence[int], sampled: np.ndarray, n: int) -> np.ndarray:
        """[R] what the drafter is expected to get accepted, from its measured levels (its head's word
        is not in yet: its forward has not run)."""
        return expected_tokens(self.policy.level_survival(sampled)[:, :n], caps)

    def _probe(self, conf: np.ndarray, lengths: Sequence[int], caps: Sequence[int],
               sampled: np.ndarray, free: np.ndarray, extra: int) -> list[int]:
        """A probe's kept list (all zero when no probe is due or could pay)."""
        r = len(caps)
        none = [0] * r
        if not self.rhythm.due():
            return none
        t = self.policy.trust
        if t.probe_tokens <= 0 or t.probe_requests <= 0:
            return none
        opt = self.survival(conf, lengths, sampled, optimistic=True)
        eff = [int(c) if f else 0 for c, f in zip(caps, free, strict=True)]
        assert self.policy.costs is not None
        if sum(allocate(opt, eff, self.policy.costs, extra_tokens=extra).kept) == 0:
            self.rhythm.rejected()
            return none
        # The longest matches first (their confidence ranks them), ties by row.
        rows = [i for i in np.argsort(-np.asarray(conf)[:, 0], kind="stable").tolist() if eff[i] > 0]
        kept = list(none)
        for i in rows[:t.probe_requests]:
            kept[i] = min(t.probe_tokens, eff[i], int(lengths[i]))
        self.counters["probes"] += 1
        return kept

    # -------------------------------------------------------------- the plan
    def plan(self, model: Plan, conf: np.ndarray, lengths: Sequence[int], caps: Sequence[int],
             sampled: np.ndarray) -> Plan:
        """``model`` (the drafter's plan for this step) with the copy's part added.

        ``conf`` [R, N]: the copy's confidences (0 where nothing was copied), ``lengths`` [R]: copied
        tokens per request. A drafting step leaves the choice to ``choose_among`` once the drafter
        has drafted, unless every request does at least as well on its copy (the forward is then
        dropped); a probing or skipped step sends what the copy's own allocation admits for the
        requests the probe does not use.
        """
        r = len(caps)
        lengths = [int(x) for x in lengths]
        drafter_caps = [int(c) for c in caps]
        caps = [min(int(c), n) for c, n in zip(caps, lengths, strict=True)]  # the copy's own
        if r == 0 or max(caps, default=0) <= 0 or self.policy.costs is None:
            return model
        surv = self.survival(conf, lengths, sampled)
        if model.mode is PlanMode.DRAFT:
            return self._with_drafting(model, conf, surv, lengths, caps, drafter_caps, sampled)
        free = np.ones(r, dtype=bool)
        extra = 0
        if model.mode is PlanMode.PROBE:
            free[list(model.rows)] = False
            extra = len(model.rows) * model.tokens
        eff = [c if f else 0 for c, f in zip(caps, free, strict=True)]
        kept = allocate(surv, eff, self.policy.costs, extra_tokens=extra, source_cost=self.cost(r)).kept
        mode = PlanMode.DRAFT
        if sum(kept) == 0:
            kept, mode = self._probe(conf, lengths, caps, sampled, free, extra), PlanMode.PROBE
        if sum(kept) == 0:
            return model
        self.counters["steps_sent"] += 1
        return Plan(model.mode, model.rows, model.tokens, (*(model.sources or ()), COPY_SOURCE), tuple(kept), mode)

    def _with_drafting(self, model: Plan, conf: np.ndarray, surv: np.ndarray, lengths: Sequence[int],
                       caps: Sequence[int], drafter_caps: Sequence[int], sampled: np.ndarray) -> Plan:
        """A drafting step's copy part. The copies alone forecast at least what the drafter's forward would
        add for its cost: the forward is dropped. Some copy promising more than the drafter: ``choose_among``
        picks per request after the forward. None, but its optimistic bound would for some: those rows
        probe the copy (else an unproven copy would never be tried beside a drafter that wins every tie)."""
        assert self.policy.costs is not None
        model_exp = self.model_expected(drafter_caps, sampled, surv.shape[1])
        copy_exp = expected_tokens(surv, caps)
        live = np.asarray(caps) > 0  # requests with a copy
        copy_alloc = allocate(surv, caps, self.policy.costs, source_cost=self.cost(len(caps)))
        if sum(copy_alloc.kept) and not self._forward_pays(copy_alloc, surv, caps, drafter_caps, sampled,
                                                          copy_exp >= model_exp):
            self.counters["steps_copy_only"] += 1
            self.counters["steps_sent"] += 1
            return Plan(model.mode, model.rows, model.tokens, (COPY_SOURCE,), tuple(copy_alloc.kept), PlanMode.DRAFT)
        if np.any((copy_exp > model_exp) & live):
            return Plan(model.mode, model.rows, model.tokens, (MODEL_SOURCE, COPY_SOURCE))
        opt = expected_tokens(self.survival(conf, lengths, sampled, optimistic=True), caps)
        free = (opt > model_exp) & live
        if not free.any():
            return model
        kept = self._probe(conf, lengths, caps, sampled, free, 0)
        if sum(kept) == 0:
            return model
        self.counters["steps_sent"] += 1
        return Plan(model.mode, model.rows, model.tokens, (MODEL_SOURCE, COPY_SOURCE), tuple(kept), PlanMode.PROBE)

    def _forward_pays(self, copy_alloc, surv: np.ndarray, caps: Sequence[int], drafter_caps: Sequence[int],
                      sampled: np.ndarray, copy_wins: np.ndarray) -> bool:
        """Whether running the drafter's forward beside the copies is forecast to beat the copies alone.

        The mixed forecast gives each request the source its measured levels promise more from and pays
        the drafter's cost for the batch; it must beat the copies' own rate by the budget's margin. At
        batch 8 on this CPU a forward the copies leave one or two rows to costs more than those rows
        gain (docs/benchmarks/copy-default-bf16: the drafter was accepted 21 of 106 tokens there while
        its forward ran on a fifth of the steps)."""
        assert self.policy.costs is not None
        if np.all(copy_wins | (np.asarray(drafter_caps) <= 0)):
            return False
        n = surv.shape[1]
        model_surv = self.policy.level_survival(sampled)[:, :n]
        if model_surv.shape[1] < n:
            model_surv = np.pad(model_surv, ((0, 0), (0, n - model_surv.shape[1])))
        mixed = np.where(copy_wins[:, None], surv, model_surv)
        mixed_caps = [c if w else int(d) for c, d, w in zip(caps, drafter_caps, copy_wins, strict=True)]
        with_forward = allocate(mixed, mixed_caps, self.policy.costs, source_cost=self.cost(len(caps)))
        return with_forward.draft_rate > copy_alloc.rate * (1.0 + self.policy.margin)

    def report(self) -> dict:
        return {"period": self.rhythm.period, "wait": self.rhythm.wait, **self.counters,
                "prior": None if self.prior is None else {"accepted_per_step": self.prior.accepted_per_step(),
                                                          **self.prior.meta},
                "calibration": self.calibrator.table()}
