"""Gated and rnn Markov heads in the compiled op (CPU twin) against the PyTorch reference.

The op takes a head as ``head_type`` (1 gated, 2 rnn), ``head_hidden`` [R, B, m] fp32 (the part
that reads the backbone's hidden rows, precomputed for every position) and ``head_w`` (the
token side); see "Head variants" in ``vllm_dspark/ops/markov.py``. Here: tokens ``torch.equal``
and confidences within CONF_ATOL for both heads x greedy / sampled / mixed rows x the full
vocabulary / a draft vocabulary (``d2t``) x fp32 / bf16 inputs, the dense path's logits, a
Kimi K3-sized vocabulary, rows whose bias outweighs the base (pruning with the real ``||v||``),
bad anchors, the NaN policy, one block per request (the rnn state), the heads really changing the
drafts, ``opcheck``, the older positional forms of the schema, and bad head arguments refused by
name. Every op call asserts that the compiled kernel ran (no fallback).
"""

from __future__ import annotations

import pytest
import torch

from vllm_dspark.ops import markov as M
from vllm_dspark.ops.markov_reference import HEAD_TYPES, markov_draft_reference, markov_row_norms

from .markov_cases import (
    CONF_ATOL,
    K3_VOCAB,
    assert_matches,
    head_kwargs,
    make_case,
    nan_case,
    run_compiled,
    run_reference,
    temperatures,
    with_draft_vocab,
    with_head,
)

HEADS = ["gated", "rnn"]
MODES = ["greedy", "sampled", "mixed"]


def test_compiled_op_is_loaded():
    # A silent fallback to Python must not let the kernel tests below pass.
    assert M.is_compiled_available("cpu")
    schema = str(torch.ops.vllm_dspark.markov_draft.default._schema)
    assert "head_hidden" in schema and "int head_type=0" in schema


def _case(head, *, R=4, B=7, V=300, rank=16, dtype=torch.float32, draft_vocab=False, seed=0, w_std=0.3,
          peaky=True):
    case = make_case(R, B, V, rank, dtype, seed=seed, w_std=w_std, peaky=peaky)
    if draft_vocab:
        case = with_draft_vocab(case, 1000, seed=seed, w_std=w_std)
    return with_head(case, head, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("draft_vocab", [False, True], ids=["full", "d2t"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head", HEADS)
def test_op_matches_reference(head, mode, draft_vocab, dtype):
    case = _case(head, dtype=dtype, draft_vocab=draft_vocab, seed=HEADS.index(head) * 7 + MODES.index(mode))
    temp = temperatures(4, mode)
    out = run_compiled(case, temp)
    assert_matches(out, run_reference(case, temp))


@pytest.mark.parametrize("draft_vocab", [False, True], ids=["full", "d2t"])
@pytest.mark.parametrize("mode", ["greedy", "mixed"])
@pytest.mark.parametrize("head", HEADS)
def test_out_logits_take_the_dense_path(head, mode, draft_vocab):
    case = _case(head, dtype=torch.bfloat16, draft_vocab=draft_vocab, seed=21)
    temp = temperatures(4, mode)
    out = run_compiled(case, temp, return_logits=True)
    ref = run_reference(case, temp, return_logits=True)
    assert_matches(out, ref)
    torch.testing.assert_close(out.logits, ref[2], atol=1e-6, rtol=1e-6)
    assert bool((out.stats == case["base_logits"].shape[-1]).all())


@pytest.mark.parametrize("head", HEADS)
def test_pruning_uses_the_rows_own_norm(head):
    # Peaky rows with a moderate bias: most rows are decided from a few exact scores.
    case = _case(head, R=3, V=5000, rank=32, w_std=0.05, seed=3)
    out = run_compiled(case, torch.zeros(3))
    assert_matches(out, run_reference(case, torch.zeros(3)))
    assert float(out.stats.float().median()) < 100, out.stats


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("head", HEADS)
def test_bias_outweighs_base(head, mode):
    # Flat base, strong Markov weights: the bias decides, bounds are loose, rows go dense.
    case = _case(head, R=3, V=1000, rank=64, w_std=0.5, peaky=False, seed=4)
    case["base_logits"] = case["base_logits"] * 0.05
    temp = temperatures(3, mode)
    assert_matches(run_compiled(case, temp), run_reference(case, temp))


@pytest.mark.parametrize("head", HEADS)
def test_k3_vocabulary(head):
    case = _case(head, R=2, B=7, V=K3_VOCAB, rank=256, dtype=torch.bfloat16, w_std=0.05, seed=5)
    temp = temperatures(2, "mixed")
    assert_matches(run_compiled(case, temp), run_reference(case, temp))


@pytest.mark.parametrize("head", HEADS)
def test_the_head_changes_the_drafts(head):
    case = _case(head, R=8, V=300, rank=16, w_std=0.5, peaky=False, seed=6)
    temp = torch.zeros(8)
    headed = run_compiled(case, temp).tokens
    vanilla = run_compiled({**case, "head_type": 0}, temp).tokens
    assert not torch.equal(headed, vanilla)
    other = with_head(case, "rnn" if head == "gated" else "gated", seed=6)
    assert not torch.equal(headed, run_compiled(other, temp).tokens)


@pytest.mark.parametrize("head", HEADS)
def test_each_request_is_its_own_block(head):
    # The rnn state (and the gated head's hidden rows) belong to one request's block: a request
    # drafted alone gives what it gives in a batch, and a second call starts the state afresh.
    case = _case(head, R=4, V=300, rank=16, w_std=0.5, seed=7)
    temp = temperatures(4, "mixed")
    both = run_compiled(case, temp)
    assert torch.equal(run_compiled(case, temp).tokens, both.tokens)
    for r in range(4):
        one = {k: (v[r:r + 1] if k in ("base_logits", "anchor_ids", "conf_base", "seeds", "head_hidden") else v)
               for k, v in case.items()}
        alone = run_compiled(one, temp[r:r + 1])
        assert torch.equal(alone.tokens[0], both.tokens[r])
        torch.testing.assert_close(alone.conf[0], both.conf[r], atol=CONF_ATOL, rtol=0)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("head", HEADS)
def test_bad_anchors_have_no_embedding(head, mode):
    # e = 0 at position 0: the gated head's v is 0; the rnn head's v = tanh(o) still reads h.
    case = _case(head, R=4, B=5, V=300, rank=8, seed=8)
    case["anchor_ids"] = torch.tensor([300, -1, 7, 2**40])
    temp = temperatures(4, mode)
    assert_matches(run_compiled(case, temp), run_reference(case, temp))


@pytest.mark.parametrize("with_logits", [False, True])
@pytest.mark.parametrize("head", HEADS)
def test_nan_policy(head, with_logits):
    case = with_head(nan_case(torch.float32), head, seed=9)
    temp = temperatures(4, "mixed")
    out = run_compiled(case, temp, return_logits=with_logits)
    assert_matches(out, run_reference(case, temp))
    assert out.tokens[0, 1].item() == 0


def test_head_type_by_name():
    case = _case("rnn", seed=10)
    temp = temperatures(4, "mixed")
    by_code = run_compiled(case, temp)
    by_name = run_compiled({**case, "head_type": "rnn"}, temp)
    assert torch.equal(by_code.tokens, by_name.tokens)
    assert HEAD_TYPES == ("vanilla", "gated", "rnn")


# --- the schema: new trailing arguments, older forms keep working -------------------------------

def _raw_args(case, temp):
    R, B, _ = case["base_logits"].shape
    return [case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
            markov_row_norms(case["markov_w2"]), case["conf_base"], case["conf_w_markov"], temp, case["seeds"],
            torch.empty(R, B, dtype=torch.int64), torch.empty(R, B), None, torch.empty(R, B, dtype=torch.int32)]


def test_older_positional_forms_are_the_vanilla_head():
    case = _case("gated", seed=11)
    temp = temperatures(4, "mixed")
    ref = markov_draft_reference(case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
                                 case["conf_base"], case["conf_w_markov"], temp, case["seeds"])
    for extra in ([], [None], [None, None], [None, None, None, None, 0]):
        args = _raw_args(case, temp) + extra
        torch.ops.vllm_dspark.markov_draft(*args)
        assert torch.equal(args[9], ref[0]), len(args)
        torch.testing.assert_close(args[10], ref[1], atol=CONF_ATOL, rtol=0)
    args = _raw_args(case, temp)
    torch.ops.vllm_dspark.markov_draft(*args, head_hidden=case["head_hidden"], head_w=case["head_w"], head_type=1)
    assert torch.equal(args[9], run_reference(case, temp)[0])


@pytest.mark.parametrize("head", HEADS)
def test_opcheck_with_a_head(head):
    case = _case(head, R=3, B=4, seed=12)
    args = tuple(_raw_args(case, temperatures(3, "mixed"))) + (
        None, None, case["head_hidden"], case["head_w"], case["head_type"])
    torch.library.opcheck(torch.ops.vllm_dspark.markov_draft.default, args)


# --- bad head arguments are refused, naming the argument -----------------------------------------

def _call_wrapper(case, **kw):
    args = {**head_kwargs(case), **kw}
    return M.markov_draft(case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
                          allow_fallback=False, **args)


@pytest.mark.parametrize("bad,match", [
    (dict(head_type=3), "head_type must be"),
    (dict(head_type="lstm"), "head_type must be"),
    (dict(head_type=0), "head_hidden and head_w given but head_type is 0"),
    (dict(head_hidden=None), "needs head_hidden"),
    (dict(head_w=None), "needs head_w"),
    (dict(head_hidden="double"), "head_hidden must be fp32"),
    (dict(head_w="double"), "head_w must be fp32"),
    (dict(head_hidden="short"), r"head_hidden must be \[4, 7, 48\]"),
    (dict(head_w="transposed"), r"head_w must be \[48, 32\]"),
    (dict(head_hidden="meta"), "head_hidden is on meta"),
    (dict(head_w="meta"), "head_w is on meta"),
    (dict(head_type=1), r"head_hidden must be \[4, 7, 16\]"),  # rnn tensors for a gated head
], ids=["code", "name", "vanilla-with-tensors", "no-hidden", "no-w", "hidden-fp64", "w-fp64", "hidden-shape",
        "w-shape", "hidden-device", "w-device", "wrong-head"])
def test_wrapper_refuses_bad_head_arguments(bad, match):
    case = _case("rnn", seed=13)
    hh, hw = case["head_hidden"], case["head_w"]
    kw = dict(bad)
    edits = {"double": lambda t: t.double(), "short": lambda t: t[:, :, :-1], "transposed": lambda t: t.T,
             "meta": lambda t: t.to("meta")}
    for name, t in (("head_hidden", hh), ("head_w", hw)):
        if isinstance(kw.get(name), str):
            kw[name] = edits[kw[name]](t)
    with pytest.raises(ValueError, match=match):
        _call_wrapper(case, **kw)


@pytest.mark.parametrize("what,match", [
    ("type", "head_type must be"), ("no-hidden", "needs head_hidden"), ("hidden-shape", "head_hidden must be"),
    ("w-dtype", "head_w must be"), ("vanilla-with-tensors", "head_type is 0"),
])
def test_raw_op_refuses_bad_head_arguments(what, match):
    case = _case("gated", seed=14)
    hh, hw, code = case["head_hidden"], case["head_w"], 1
    if what == "type":
        code = 5
    elif what == "no-hidden":
        hh = None
    elif what == "hidden-shape":
        hh = hh[:, :-1]
    elif what == "w-dtype":
        hw = hw.double()
    else:
        code = 0
    with pytest.raises(RuntimeError, match=match):
        torch.ops.vllm_dspark.markov_draft(*_raw_args(case, torch.zeros(4)), None, None, hh, hw, code)
