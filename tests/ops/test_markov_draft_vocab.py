"""Draft vocabularies (``d2t``) through the Markov draft op: the CPU twin against the reference.

A speculators-layout checkpoint scores Vd < V tokens: base logits and ``markov_w2`` have Vd
rows, ``markov_w1`` keeps V rows indexed by target ids and ``d2t`` holds offsets (target id =
draft id + d2t[draft id]). The op's tokens and logits are draft ids; the next position's
``markov_w1`` row is the drafted token's target id. The CUDA source runs the same cases in
``tests/ops/test_simt_emulation.py`` (``emulate_cuda.draft_vocab_grid``).
"""

from __future__ import annotations

import pytest
import torch

from vllm_dspark.ops import markov as M
from vllm_dspark.ops.markov_reference import check_d2t, markov_draft_reference, markov_max_norms, markov_row_norms

from .markov_cases import (
    CONF_ATOL,
    K3_VOCAB,
    assert_matches,
    make_case,
    run_compiled,
    run_reference,
    temperatures,
    with_draft_vocab,
)

VD, VT = 300, 1000  # draft and target vocabulary of the small cases


def _case(R, B, dtype=torch.float32, *, seed=0, sort=True, w_std=0.5, rank=16, peaky=False):
    return with_draft_vocab(make_case(R, B, VD, rank, dtype, seed=seed, peaky=peaky), VT, seed=seed + 1,
                            sort=sort, w_std=w_std)


@pytest.mark.parametrize("R,B", [(1, 7), (4, 7), (3, 1)], ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "shuffled"])
def test_op_matches_reference_with_a_draft_vocab(R, B, dtype, mode, sort):
    case = _case(R, B, dtype, seed=R * 10 + B, sort=sort)
    temp = temperatures(R, mode)
    out = run_compiled(case, temp)
    assert_matches(out, run_reference(case, temp))
    assert int(out.tokens.max()) < VD  # draft ids


@pytest.mark.parametrize("w_std", [0.15, 0.5], ids=["tables", "strong-bias"])
def test_the_map_matters(w_std):
    # The cases have teeth: the target id fed to markov_w1 changes the drafts (or at least the
    # confidences) against feeding the draft id itself.
    case = _case(4, 7, seed=3, w_std=w_std, peaky=True)
    temp = temperatures(4, "mixed")
    out = run_compiled(case, temp)
    assert_matches(out, run_reference(case, temp))
    wrong = dict(case, d2t=torch.zeros_like(case["d2t"]))  # draft id used as the target id
    tok, conf = run_reference(wrong, temp)
    assert not torch.equal(tok, out.tokens) or not torch.allclose(conf, out.conf, atol=1e-4)


@pytest.mark.parametrize("mode", ["greedy", "mixed"])
def test_out_logits_are_in_draft_space(mode):
    case = _case(3, 5, torch.bfloat16, seed=5, sort=False)
    temp = temperatures(3, mode)
    out = run_compiled(case, temp, return_logits=True)
    ref = run_reference(case, temp, return_logits=True)
    assert_matches(out, ref)
    assert out.logits.shape == (3, 5, VD)
    torch.testing.assert_close(out.logits, ref[2], atol=1e-6, rtol=1e-6)
    assert bool((out.stats == VD).all())


def test_stats_count_draft_vocab_rows():
    # Peaky rows, weak bias: the pruned walk scores a handful of the Vd tokens exactly.
    case = _case(2, 7, seed=6, w_std=0.15, peaky=True)
    out = run_compiled(case, torch.zeros(2))
    assert_matches(out, run_reference(case, torch.zeros(2)))
    assert out.stats.shape == (2, 7) and int(out.stats.min()) >= 1 and int(out.stats.max()) < VD // 4


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_anchors_are_target_ids(mode):
    # In the target vocabulary but outside the draft subset: a real embedding. Outside the target
    # vocabulary (= markov_w1's rows): none, whatever the draft vocabulary's size.
    case = _case(5, 4, seed=7)
    tgt = torch.arange(VD) + case["d2t"]
    off_subset = next(j for j in range(VD, VT) if not bool((tgt == j).any()))
    case["anchor_ids"] = torch.tensor([off_subset, VT, -1, 2**40, int(tgt[0])])
    temp = temperatures(5, mode)
    out = run_compiled(case, temp)
    assert_matches(out, run_reference(case, temp))
    expect0 = torch.sigmoid(case["conf_base"][[1, 2, 3], 0].double()).float()
    torch.testing.assert_close(out.conf[[1, 2, 3], 0], expect0, atol=CONF_ATOL, rtol=0)
    e = case["markov_w1"][off_subset].double()  # the valid off-subset anchor has its Markov part
    z = case["conf_base"][0, 0].double() + e @ case["conf_w_markov"].double()
    torch.testing.assert_close(out.conf[0, 0], torch.sigmoid(z).float(), atol=CONF_ATOL, rtol=0)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_a_map_outside_markov_w1_reads_nothing_out_of_bounds(mode):
    # The raw op does not read d2t's values to check them (a host sync on a GPU): a mapped id
    # outside markov_w1 gets no embedding, as in the reference, and nothing is read out of bounds.
    case = _case(3, 7, seed=8)
    d2t = case["d2t"].clone()
    d2t[::3] = 10 * VT  # also target ids far past the end
    d2t[1::3] = -(2**62)
    R, B, _ = case["base_logits"].shape
    temp = temperatures(R, mode)
    tokens, conf = torch.empty(R, B, dtype=torch.int64), torch.empty(R, B)
    norms = markov_row_norms(case["markov_w2"])
    torch.ops.vllm_dspark.markov_draft(
        case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"], norms,
        case["conf_base"], case["conf_w_markov"], temp, case["seeds"], tokens, conf, None, None,
        None, d2t)
    ref = markov_draft_reference(case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
                                 case["conf_base"], case["conf_w_markov"], temp, case["seeds"], d2t=d2t)
    assert torch.equal(tokens, ref[0])
    torch.testing.assert_close(conf, ref[1], atol=CONF_ATOL, rtol=0)


def test_max_norms_over_the_target_vocabulary_bound_every_row():
    case = _case(2, 7, seed=9)
    norms = markov_row_norms(case["markov_w2"])
    mn = markov_max_norms(case["markov_w1"], norms)
    assert float(mn[0]) >= float(case["markov_w1"].double().norm(dim=1).max())
    assert float(mn[1]) == float(norms.max())


def test_k3_sized_draft_vocab():
    # Kimi K3-like: 32000 draft tokens out of 163840, rank 256, bf16, peaky rows.
    case = with_draft_vocab(make_case(2, 7, 32000, 256, torch.bfloat16, seed=10, peaky=True), K3_VOCAB,
                            seed=11, w_std=0.05)
    temp = temperatures(2, "mixed")
    out = run_compiled(case, temp)
    assert_matches(out, run_reference(case, temp))
    assert int(out.stats.max()) < 32000 // 10


def test_opcheck_with_d2t():
    case = _case(3, 4, seed=12)
    R, B, _ = case["base_logits"].shape
    args = (case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
            markov_row_norms(case["markov_w2"]), case["conf_base"], case["conf_w_markov"],
            temperatures(R, "mixed"), case["seeds"], torch.empty(R, B, dtype=torch.int64), torch.empty(R, B),
            None, torch.empty(R, B, dtype=torch.int32), None, case["d2t"])
    torch.library.opcheck(torch.ops.vllm_dspark.markov_draft.default, args)


# --- bad maps are refused, naming the problem -----------------------------------------------

def _call_wrapper(case, d2t):
    return M.markov_draft(case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
                          d2t=d2t, allow_fallback=False)


@pytest.mark.parametrize("bad,match", [
    (lambda d: d.to(torch.int32), "int64"),
    (lambda d: d[:-1], r"\[300\]"),
    (lambda d: d[None, :], "1-D"),
    (lambda d: d.to("meta"), "meta"),
    (lambda d: d + torch.arange(VD), "outside the target vocabulary"),  # target ids given as offsets
    (lambda d: d - 5000, "outside the target vocabulary"),
    (lambda d: d.tolist(), "tensor"),
], ids=["int32", "short", "2-D", "device", "target-ids-not-offsets", "negative", "list"])
def test_wrapper_refuses_a_bad_d2t(bad, match):
    case = _case(2, 3, seed=13)
    with pytest.raises(ValueError, match=match):
        _call_wrapper(case, bad(case["d2t"]))


def test_wrapper_checks_the_values_once_per_tensor_version():
    case = _case(2, 3, seed=14)
    d2t = case["d2t"].clone()
    _call_wrapper(case, d2t)
    d2t[0] = 10**9  # an in-place change bumps the version: checked again
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        _call_wrapper(case, d2t)


def test_another_tensor_at_a_checked_address_is_checked_again():
    # A freed tensor's address (and version 0) comes back for new tensors: CI once saw a bad map
    # pass as "checked" because an earlier good one had lived at the same address. Here two views
    # share one address and one version counter, and numpy writes the bad values without a bump.
    case = _case(2, 3, seed=17)
    base = case["d2t"].clone()
    good = base.view(VD)
    _call_wrapper(case, good)
    base.numpy()[:] = (case["d2t"] - 5000).numpy()
    bad = base.view(VD)
    assert (bad.data_ptr(), bad._version) == (good.data_ptr(), good._version)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        _call_wrapper(case, bad)


def test_wrapper_takes_inference_tensors():
    # vLLM builds its weights under inference mode: such a d2t has no version counter.
    case = _case(2, 3, seed=16)
    with torch.inference_mode():
        d2t = case["d2t"].clone()
        out = _call_wrapper(case, d2t)
    ref = markov_draft_reference(case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
                                 d2t=d2t)
    assert torch.equal(out.tokens, ref[0])


@pytest.mark.parametrize("what", ["dtype", "length", "no-d2t-shape"])
def test_raw_op_refuses_bad_shapes(what):
    case = _case(2, 3, seed=15)
    R, B, _ = case["base_logits"].shape
    d2t = case["d2t"]
    if what == "dtype":
        d2t, match = d2t.to(torch.int32), "d2t"
    elif what == "length":
        d2t, match = d2t[:-1], "d2t"
    else:
        d2t, match = None, "needs d2t"  # markov_w1 taller than markov_w2 without a map
    with pytest.raises(RuntimeError, match=match):
        torch.ops.vllm_dspark.markov_draft(
            case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
            markov_row_norms(case["markov_w2"]), None, None, torch.zeros(R), case["seeds"],
            torch.empty(R, B, dtype=torch.int64), torch.empty(R, B), None, None, None, d2t)


def test_check_d2t_accepts_a_good_map():
    d2t = torch.tensor([0, 5, 5, 7])  # draft ids 0..3 -> target ids 0, 6, 7, 10
    check_d2t(d2t, 4, 11)
    with pytest.raises(ValueError, match=r"3 -> 10"):
        check_d2t(d2t, 4, 10)
