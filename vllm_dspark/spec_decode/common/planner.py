"""The draft step's decisions, apart from the runner: feedback -> plan -> source per request -> allocation.

:class:`StepPlanner` owns what a step decides and what it learns from: the budget
(:class:`~.budget.BudgetPolicy`, its calibrator and the cost model), the copy's policy
(:class:`~.copy_policy.CopyPolicy`), the verification rules (:mod:`.verify`), the counters, and
the drafts sent to the target that the next step judges. It reads plain numbers (request ids, caps,
confidences as NumPy arrays, the rejected counts as a list) and imports neither torch nor vLLM, so
it is tested without either (``tests/spec_decode/test_planner.py``).

A runner adapter (V1's ``DSparkProposer``) lays out the inputs, runs the sources the plan names
through :class:`~.drafts.DraftSource`, and hands their confidences back here:

1. :meth:`StepPlanner.feedback`: the previous step's drafts judged (every rank learns alike);
2. :meth:`StepPlanner.plan`: what this step runs, given the copy's offer when there is one;
3. :meth:`StepPlanner.allocate`: how many drafts each request sends, and from which source;
4. :meth:`StepPlanner.record` (or :meth:`StepPlanner.record_none`): what was sent, for step 1 next time.

Decisions that change what tensor-parallel ranks execute go through ``decide`` (the
:class:`~.consensus.Consensus` of the adapter): the deciding rank's answer, broadcast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_dspark.spec_decode.common import budget
from vllm_dspark.spec_decode.common.budget import Feedback, Plan, PlanMode
from vllm_dspark.spec_decode.common.copy_policy import CopyPolicy
from vllm_dspark.spec_decode.common.copy_prior import CopyPrior
from vllm_dspark.spec_decode.common.costs import CostModel
from vllm_dspark.spec_decode.common.sources import COPY_SOURCE, MODEL_SOURCE
from vllm_dspark.spec_decode.common.verify import VerifyStats, rule_lengths

Decide = Callable[[Callable[[], Any]], Any]


@dataclass(frozen=True)
class SentDrafts:
    """A request's drafts sent to the target, awaiting the verify step's verdict."""

    confidence: list[float]
    kept: int
    sampled: bool
    source: str


@dataclass(frozen=True)
class CopyDrafts:
    """What the planner reads of the copy source's drafts for the whole batch."""

    confidence: np.ndarray  # [batch, N] (0 past each copy)
    lengths: list[int]  # copied tokens per request (0: no match, or not drafting)


class StepPlanner:
    """One proposer's decisions and what they learn from (see the module docstring).

    ``settings`` is the proposer's ``DSparkSettings``; ``n_draft`` the drafts a block proposes.
    """

    def __init__(self, settings, n_draft: int, decide: Decide, copy_prior: CopyPrior | None = None):
        self.settings = settings
        self.decide = decide
        self.stats = VerifyStats()
        self.policy = budget.BudgetPolicy(n_draft, budget.TrustConfig(**settings.trust()))
        self.copy_policy = CopyPolicy(self.policy, copy_prior) if settings.copies else None
        self.step = 0  # steps decided so far (the trace's step number)
        self.sent: dict[str, SentDrafts] = {}  # req id -> drafts the next step judges
        self.sent_kind = PlanMode.SKIP  # the plan of the step that sent them
        self.copy_kind = PlanMode.SKIP  # how that step sent its copies (probe or allocation)

    @property
    def costs(self) -> CostModel | None:
        return self.policy.costs

    @costs.setter
    def costs(self, model: CostModel | None) -> None:
        self.policy.costs = model

    # ------------------------------------------------------------------ 1. feedback
    def feedback(self, req_ids: Sequence[str], rejected: Sequence[int] | None, *, trace: bool = False) -> list[dict]:
        """The verdict on the drafts the previous step sent: each request's accepted count (``rejected``
        per batch row; None: every verified draft was accepted) feeds the policies and the counters.
        Returns the trace's acceptance records when ``trace``."""
        self.step += 1
        if not self.sent:
            return []
        records, results = [], []
        for i, rid in enumerate(req_ids):
            sent = self.sent.get(rid)
            if sent is None:
                continue
            kept = sent.kept
            accepted = kept if rejected is None else max(0, min(kept, kept - int(rejected[i])))
            results.append(Feedback(sent.confidence, kept, accepted, sent.sampled, sent.source))
            self.stats.add_acceptance(kept, accepted, sent.source)
            if trace:
                records.append({"step": self.step, "req_id": rid, "verified": kept, "accepted": accepted,
                                "confidence": sent.confidence[:kept], "sampled": sent.sampled,
                                "kind": str(self.copy_kind if sent.source == COPY_SOURCE else self.sent_kind),
                                "source": sent.source})
        # Every rank learns from the same acceptances; only the deciding rank's policy decides.
        self.policy.feedback(self.sent_kind, results)
        if self.copy_policy is not None:
            self.copy_policy.feedback(self.copy_kind, results)
        return records

    # ------------------------------------------------------------------ 2. plan
    def plan(self, caps: list[int], sampled: np.ndarray, copy: CopyDrafts | None = None) -> Plan:
        """What this step runs, the same on every TP rank (the copy's offer is: every rank indexes
        the same tokens)."""
        if max(caps, default=0) <= 0:
            return budget.SKIP  # rank-independent: the caps come from the scheduler and sequence lengths
        if self.settings.verification != "budget":
            if copy is not None and self.copy_policy is not None and any(copy.lengths):
                return Plan(PlanMode.DRAFT, sources=(MODEL_SOURCE, COPY_SOURCE))  # a rule picks per request
            return budget.DRAFT
        if self.costs is None:
            raise RuntimeError("vllm_dspark: budgeted verification has no cost model; the worker's warm-up "
                               "hook did not run (is the vllm_dspark plugin registered in the worker?)")

        # With the copy on, what it offers this step says whether the drafting state's forecast (both
        # sources priced together) speaks for the drafter's forward (BudgetPolicy.plan).
        copies = self.copy_policy is not None and copy is not None and any(copy.lengths)
        nothing_to_copy = self.copy_policy is not None and not copies

        def plan() -> tuple:
            p = self.policy.plan(caps, sampled, nothing_to_copy=nothing_to_copy)
            if copies:
                assert self.copy_policy is not None and copy is not None
                p = self.copy_policy.plan(p, copy.confidence, copy.lengths, caps, sampled)
            return p.to_wire()

        return Plan.from_wire(self.decide(plan))

    # ------------------------------------------------------------------ 3. allocation
    def allocate(self, plan: Plan, caps: list[int], sampled: np.ndarray, model_conf: np.ndarray | None,
                 copy: CopyDrafts | None = None) -> tuple[list[int], list[str]]:
        """Drafts to verify per request and the source each request's come from: a probe's fixed few
        (and the copies the plan sends beside it), the copies alone on a step the drafter skips, or
        the verification rule's choice (with copies: the budget's choice among both sources).
        ``model_conf`` [batch, N] is the drafter's confidence (None when it did not run)."""
        batch = len(caps)
        if plan.mode is PlanMode.PROBE:
            kept = self.policy.probe_kept(plan, caps)
            picks = [MODEL_SOURCE] * batch
            for i, k in enumerate(plan.copy_kept):
                if k and not kept[i]:
                    kept[i], picks[i] = k, COPY_SOURCE
            return kept, picks
        if model_conf is None:  # the drafter did not run: what the plan copies, nothing else
            kept = list(plan.copy_kept) or [0] * batch
            return kept, [COPY_SOURCE if k else MODEL_SOURCE for k in kept]
        if copy is None or COPY_SOURCE not in (plan.sources or ()):
            return self.verify(model_conf, caps, sampled), [MODEL_SOURCE] * batch
        if self.settings.verification != "budget":
            return self._rule_choice(model_conf, caps, sampled, copy)
        confs = {MODEL_SOURCE: model_conf, COPY_SOURCE: copy.confidence.astype(np.float64)}
        probed = list(plan.copy_kept) or [0] * batch  # rows probing the copy keep their probe
        free = [0 if p else c for c, p in zip(caps, probed, strict=True)]

        def choose() -> tuple[list[int], list[str]]:
            alloc, picks = self.policy.choose_among(confs, free, sampled)
            kept = [min(k, copy.lengths[i]) if p == COPY_SOURCE else k
                    for i, (k, p) in enumerate(zip(alloc.kept, picks, strict=True))]
            for i, k in enumerate(probed):
                if k:
                    kept[i], picks[i] = k, COPY_SOURCE
            return kept, picks

        kept, picks = self.decide(choose)
        return list(kept), list(picks)

    def _rule_choice(self, model_conf: np.ndarray, caps: list[int], sampled: np.ndarray,
                     copy: CopyDrafts) -> tuple[list[int], list[str]]:
        """Under a verification rule, a request takes its copy where the copy's calibrated survival promises
        more accepted tokens than the drafter's (its own calibrator on the drafts the rule keeps). A copy
        is sent whole, up to the cap; under ``fixed`` only a copy as long as the cap is taken, so every
        request still verifies a fixed number of drafts (what async scheduling needs)."""
        copy_policy = self.copy_policy
        assert copy_policy is not None
        s = self.settings

        def choose() -> tuple[list[int], list[str]]:
            kept = rule_lengths(model_conf, caps, s.verification, s.threshold)
            model_exp = budget.expected_tokens(budget.survival(self.policy.calibrator.calibrate(model_conf, sampled)),
                                               kept)
            copy_kept = [min(c, n) for c, n in zip(caps, copy.lengths, strict=True)]
            if s.verification == "fixed":
                copy_kept = [k if k >= c else 0 for k, c in zip(copy_kept, caps, strict=True)]
            copy_exp = budget.expected_tokens(copy_policy.survival(copy.confidence, copy.lengths, sampled),
                                              copy_kept)
            picks = [COPY_SOURCE if k > 0 and ce > me else MODEL_SOURCE
                     for k, ce, me in zip(copy_kept, copy_exp, model_exp, strict=True)]
            return ([ck if p == COPY_SOURCE else mk for ck, mk, p in zip(copy_kept, kept, picks, strict=True)],
                    picks)

        kept, picks = self.decide(choose)
        return list(kept), list(picks)

    def verify(self, conf: np.ndarray, caps: list[int], sampled: np.ndarray) -> list[int]:
        """How many of each request's drafts the target verifies, by the verification setting."""
        s = self.settings
        if s.verification != "budget":
            # A function of the confidences alone; the decider's list is still what every rank keeps,
            # so the ranks' feedback and counters cannot drift apart by a rounding difference.
            kept = rule_lengths(conf, caps, s.verification, s.threshold)
            return kept if s.verification == "fixed" else list(self.decide(lambda: kept))
        return list(self.decide(lambda: self.policy.choose(conf, caps, sampled).kept))

    # ------------------------------------------------------------------ 4. what was sent
    def record(self, req_ids: Sequence[str], plan: Plan, cap: int, kept: list[int], picks: list[str],
               confidence: list[list[float]], sampled: np.ndarray) -> None:
        """A step that sent drafts: the counters, and the drafts the next step's feedback judges."""
        probe = plan.mode is PlanMode.PROBE or not plan.drafter_runs
        self.stats.add_step(drafted=True, cap=cap, kept=kept, probe=probe)
        self.sent = {rid: SentDrafts(confidence[i], kept[i], bool(sampled[i]), picks[i])
                     for i, rid in enumerate(req_ids) if kept[i] > 0}
        self.sent_kind, self.copy_kind = plan.mode, plan.copy_mode

    def record_none(self, cap: int, batch: int) -> None:
        """A step that drafted nothing: the counters, and no feedback pending."""
        self.stats.add_step(drafted=False, cap=cap, kept=[0] * batch)
        self.sent, self.sent_kind, self.copy_kind = {}, PlanMode.SKIP, PlanMode.SKIP
