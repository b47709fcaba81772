"""One draft path: the runners and the profile reach the Markov op only through ``MarkovStage``, and the
stage drafts exactly what the reference does; the budget ranks drafts from any number of sources."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_dspark.model.markov_weights import MarkovWeights
from vllm_dspark.ops import is_compiled_available
from vllm_dspark.ops.markov_reference import markov_draft_reference
from vllm_dspark.spec_decode.common import budget
from vllm_dspark.spec_decode.common.costs import CostModel
from vllm_dspark.spec_decode.common.draft_sampling import sample_drafts
from vllm_dspark.spec_decode.common.drafts import DraftBatch, DraftSource, MarkovStage

PKG = Path(__file__).resolve().parents[2] / "vllm_dspark"
# What drafts: the op, its reference, the recurrence and the sampled path. Only the stage may name them.
DRAFTING = {"markov_draft", "markov_draft_reference", "markov_recurrence", "sample_drafts", "vllm_dspark._C"}


def _names(path: Path) -> set[str]:
    """Identifiers, attribute names and imported names a module's code uses (docstrings excluded)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            out |= {a.name for a in node.names} | {node.module or ""}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


@pytest.mark.parametrize("path", sorted([*(PKG / "spec_decode" / "v1").glob("*.py"),
                                         *(PKG / "spec_decode" / "v2").glob("*.py"),
                                         PKG / "spec_decode" / "common" / "profile.py"]),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_runners_and_profile_draft_only_through_the_stage(path):
    assert not (_names(path) & DRAFTING), f"{path.name} drafts around MarkovStage: {_names(path) & DRAFTING}"


def test_the_stage_is_the_one_caller():
    assert _names(PKG / "spec_decode" / "common" / "drafts.py") & DRAFTING >= {"markov_draft", "sample_drafts"}


V, H, RANK, N = 111, 16, 8, 5


def _stage(with_conf=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    lm = torch.randn(V, H, generator=g)
    w = MarkovWeights.build(vocab=V, markov_w1=torch.randn(V, RANK, generator=g),
                            markov_w2=torch.randn(V, RANK, generator=g) * 0.5,
                            conf_weight=torch.randn(H + RANK, generator=g) * 0.2 if with_conf else None,
                            conf_bias=0.1, hidden_size=H, conf_with_markov=True)
    return MarkovStage(w, lambda h: h @ lm.T), lm


def _batch(r, rows, sampled, seed=1, n=N):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(rows) * n, H, generator=g)
    anchors = torch.randint(0, V, (r,), generator=g)
    temps = torch.where(torch.from_numpy(sampled), torch.tensor(0.8), torch.tensor(0.0))
    return DraftBatch(rows=rows, anchors=anchors, num_tokens=n, sampled=sampled, hidden=hidden,
                      temperature=temps, seeds=lambda rr: torch.tensor([7 + x for x in rr], dtype=torch.int64))


def test_compiled_op_is_loaded():
    assert is_compiled_available("cpu")  # the greedy rows below run the compiled op, not a fallback


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 2]])
def test_stage_drafts_what_the_reference_drafts(rows):
    stage, lm = _stage()
    assert isinstance(stage, DraftSource)
    sampled = np.array([False, True, False, True])
    b = _batch(4, rows, sampled)
    d = stage.draft(b)
    w = stage.weights
    base = (b.hidden @ lm.T).view(len(rows), N, V)
    conf_base = w.confidence_base(b.hidden).view(len(rows), N)
    anchors = b.anchors[rows]
    is_s = sampled[rows]
    g = np.flatnonzero(~is_s)
    tok, conf = markov_draft_reference(base[g], anchors[g], w.markov_w1, w.markov_w2, conf_base[g], w.conf_w_markov)
    assert torch.equal(d.tokens[g], tok) and torch.allclose(d.confidence[g], conf, atol=1e-6)
    assert d.path == "compiled" and d.source == "dspark"
    s = np.flatnonzero(is_s)
    t_s, c_s, q_s = sample_drafts(base[s], anchors[s], w, b.temperature[torch.tensor(rows)[s]],
                                  b.seeds(torch.tensor(rows)[s].tolist()), conf_base[s])
    assert torch.equal(d.tokens[s], t_s) and torch.equal(d.confidence[s], c_s)
    assert d.probs is not None and torch.equal(d.probs[s], q_s)
    assert not d.probs[g].any()  # greedy rows propose deterministically: no q


def test_greedy_only_batch_has_no_q():
    stage, _ = _stage(with_conf=False)
    d = stage.draft(_batch(3, [0, 1, 2], np.zeros(3, dtype=bool)))
    assert d.probs is None and torch.equal(d.confidence, torch.ones(3, N))


def _costs():
    return CostModel(verify=[(1, 0.01), (64, 0.0101)], draft=[(1, 0.0001), (64, 0.0001)])


def test_choose_among_one_source_is_choose():
    pol = budget.BudgetPolicy(N, costs=_costs())
    conf = np.random.RandomState(0).uniform(0.2, 0.95, (6, N))
    sampled = np.zeros(6, dtype=bool)
    a = pol.choose(conf, [N] * 6, sampled)
    b, src = budget.BudgetPolicy(N, costs=_costs()).choose_among({"dspark": conf}, [N] * 6, sampled)
    assert a == b and src == ["dspark"] * 6


def test_each_request_takes_the_source_its_own_calibration_prefers():
    pol = budget.BudgetPolicy(N, costs=_costs())
    # The second source has proven itself (every draft accepted); the drafter has not.
    for _ in range(50):
        pol.feedback(budget.PlanMode.DRAFT, [budget.Feedback([0.9] * N, N, N, False, source="other")])
    hi, lo = np.full((2, N), 0.9), np.full((2, N), 0.1)
    _, src = pol.choose_among({"dspark": hi, "other": lo}, [N, N], np.zeros(2, dtype=bool))
    assert src == ["other", "other"]  # the drafter's 0.9 is only a ranking until measured
    assert pol.calibrators["dspark"].measured(False) is False


def test_plan_modes_and_sources():
    assert budget.Plan("probe", (0, 2), 2).mode is budget.PlanMode.PROBE
    assert budget.SKIP.sources == () and not budget.SKIP.runs
    assert budget.DRAFT.sources == ("dspark",) and budget.DRAFT.runs
    p = budget.Plan(budget.PlanMode.PROBE, (1,), 2)
    assert budget.Plan.from_wire(p.to_wire()) == p and p.mode == "probe"
    assert budget.Feedback.of(([0.5], 1, 0, True)) == budget.Feedback([0.5], 1, 0, True, "dspark")
