"""The per-request verification rules and their counters (no engine)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_dspark.spec_decode.common.verify import VerifyStats, product_length, rule_lengths, threshold_length

EXAMPLE = [0.95, 0.9, 0.9, 0.85, 0.8, 0.8, 0.7]


def test_reference_rule_vs_product_rule_on_the_issue_example():
    assert threshold_length(EXAMPLE, 0.8) == 6  # DeepSpec _confident_prefix_length
    assert product_length(EXAMPLE, 0.8) == 2  # the project's earlier rule


@pytest.mark.parametrize("t, want", [(0.0, 7), (-1.0, 7), (0.96, 0), (0.71, 6), (0.7, 7)])
def test_threshold_rule_edges(t, want):
    assert threshold_length(EXAMPLE, t) == want


@pytest.mark.parametrize("conf, t", [
    (EXAMPLE, 0.8), (EXAMPLE, 0.0), (EXAMPLE, -1.0), (EXAMPLE, 0.96), (EXAMPLE, 0.85),
    (EXAMPLE, 0.9),  # the fp32 confidence is compared: fp32(0.9) = 0.89999998 < 0.9
    ([0.9, 0.3, 0.99, 0.99], 0.5),  # a later recovery does not extend the draft
    ([0.02, 0.9, 0.9], 0.5),  # an empty draft is allowed
    ([float("nan"), 0.9, 0.2], 0.5),  # NaN compares false: it never stops a draft
])
def test_serving_rule_equals_the_golden_reference(conf, t):
    """verify.threshold_length (what serving cuts with) and the reference drafter's
    confident_prefix_length are two writings of DeepSpec's rule; they must agree."""
    import torch

    from vllm_dspark.model.reference import confident_prefix_length

    c32 = torch.tensor([conf], dtype=torch.float32)
    want = int(confident_prefix_length(c32, t)[0])
    assert threshold_length(c32[0].double().tolist(), t) == want
    assert rule_lengths(c32.double().numpy(), [len(conf)], "threshold", t) == [want]


def test_rule_lengths_apply_caps():
    conf = np.array([EXAMPLE, EXAMPLE])
    assert rule_lengths(conf, [7, 3], "threshold", 0.8) == [6, 3]
    assert rule_lengths(conf, [7, 0], "fixed", 0.0) == [7, 0]
    assert rule_lengths(conf, [7, 7], "product", 0.8) == [2, 2]
    with pytest.raises(ValueError):
        rule_lengths(conf, [7, 7], "budget", 0.0)


def test_counters_and_log_line():
    s = VerifyStats()
    s.add_step(drafted=True, cap=7, kept=[7, 3, 0])
    s.add_step(drafted=False, cap=7, kept=[0, 0])
    s.add_acceptance(7, 5)
    s.add_acceptance(3, 0)
    s.add_step(drafted=True, cap=7, kept=[2, 0], probe=True)  # a probe: one request's first two drafts
    assert s.as_dict() == {"steps": 3, "steps_drafted": 2, "steps_probed": 1, "steps_skipped": 1, "requests": 4,
                           "tokens_drafted": 23, "tokens_admitted": 12, "empty_drafts": 1, "drafts_observed": 2,
                           "tokens_verified_observed": 10, "tokens_accepted": 5,
                           "accepted_per_position": [1, 1, 1, 1, 1],
                           "by_source": {"dspark": {"drafts": 2, "verified": 10, "accepted": 5}}}
    assert s.line("budget") == ("DSpark verification (budget): admitted 12/23 drafted tokens (52.2%), 1 empty "
                                "drafts, 1/3 steps without drafting, 1 probes; accepted 5/10 verified draft tokens "
                                "(50.0%)")  # the drafter alone: no per-source split
    s.add_acceptance(4, 4, "copy")
    assert s.line("budget").endswith("accepted 9/14 verified draft tokens (64.3%) [copy 4/4, dspark 5/10]")
