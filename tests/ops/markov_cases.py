"""The Markov op's test cases and its CUDA checks, importable without pytest or vLLM.

Used by ``tests/ops/test_markov_op.py`` (the CPU twin), ``tests/ops/test_markov_cuda.py``
(the CUDA op under pytest) and ``scripts/gpu_check.py`` (the same CUDA checks on a GPU
machine that has only Python, torch and nvcc). Everything here imports torch and
``vllm_dspark.ops`` alone.

``CUDA_CHECKS`` is the one list of CUDA op checks: each :class:`Check` has a name
(its pytest id) and a function that raises ``AssertionError`` on a mismatch. The
checks take ``device``: ``"cuda"`` is what they are for; most also run on
``"cpu"`` against the CPU twin (``device_agnostic``), which is how CI exercises
their logic without a GPU. Tolerances are the CPU tests': tokens equal
(``torch.equal``), confidences within ``CONF_ATOL``, logits within 1e-6.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import NamedTuple

import torch

from vllm_dspark.ops import markov as M
from vllm_dspark.ops.markov_reference import (
    HEAD_TYPES,
    d2t_of_target_ids,
    head_shapes,
    markov_draft_reference,
    markov_max_norms,
    markov_row_norms,
)

CONF_ATOL = 1e-6
K3_VOCAB = 163840
EXAMPLE_CONF = [0.95, 0.9, 0.9, 0.85, 0.8, 0.8, 0.7]


# ------------------------------------------------------------------ inputs
def make_case(R, B, V, rank, dtype=torch.float32, *, seed=0, base_std=1.0, w_std=0.05,
              conf=True, conf_w=True, peaky=False):
    """Random op inputs on the CPU: base logits [R, B, V], Markov weights [V, rank], ..."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(R, B, V, generator=g) * base_std
    if peaky:  # a trained-like row: a few tokens far above the rest
        top = torch.randint(0, V, (R, B, 4), generator=g)
        base.scatter_add_(2, top, 8.0 + 4.0 * torch.rand(R, B, 4, generator=g))
    w1 = torch.randn(V, rank, generator=g) * w_std
    w2 = torch.randn(V, rank, generator=g) * w_std
    case = dict(
        base_logits=base.to(dtype),
        anchor_ids=torch.randint(0, V, (R,), generator=g),
        markov_w1=w1.to(dtype),
        markov_w2=w2.to(dtype),
        conf_base=(torch.randn(R, B, generator=g) * 1.5 + 2.5) if conf else None,
        conf_w_markov=(torch.randn(rank, generator=g) * 0.3) if (conf and conf_w) else None,
        seeds=torch.randint(-2**62, 2**62, (R,), generator=g),
    )
    return case


@functools.lru_cache(maxsize=2)
def _fp32_case(R, B, V, rank, seed, peaky):
    return make_case(R, B, V, rank, torch.float32, seed=seed, peaky=peaky)


def cached_case(R, B, V, rank, dtype, *, seed, peaky):
    """``make_case(...)`` without regenerating the fp32 draw per dtype (the same values:
    ``make_case`` draws in fp32 and casts). Callers must not modify the result in place."""
    fp32 = _fp32_case(R, B, V, rank, seed, peaky)
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and k in ("base_logits", "markov_w1", "markov_w2")
                else v) for k, v in fp32.items()}


def clear_case_cache() -> None:
    _fp32_case.cache_clear()


def with_draft_vocab(case, target_vocab, *, seed=0, sort=True, w_std=0.5):
    """``case`` as a draft-vocabulary checkpoint (speculators' layout): its vocabulary becomes the
    draft vocabulary Vd, ``markov_w1`` gets ``target_vocab`` rows (indexed by target ids) and
    ``d2t`` int64 [Vd] offsets map the draft ids onto a random subset of the target ids, ascending
    when ``sort`` (as exported) or shuffled. Even requests anchor on a target id outside the draft
    vocabulary, odd ones on a target id inside it."""
    g = torch.Generator().manual_seed(seed)
    R, _, Vd = case["base_logits"].shape
    rank = case["markov_w2"].shape[1]
    perm = torch.randperm(target_vocab, generator=g)
    tgt = perm[:Vd].sort().values if sort else perm[:Vd]
    out = dict(case)
    out["d2t"] = d2t_of_target_ids(tgt)
    out["markov_w1"] = (torch.randn(target_vocab, rank, generator=g) * w_std).to(case["markov_w1"].dtype)
    out["markov_w2"] = (torch.randn(Vd, rank, generator=g) * w_std).to(case["markov_w2"].dtype)
    anchors = perm[Vd:][torch.randint(0, target_vocab - Vd, (R,), generator=g)]
    anchors[1::2] = tgt[torch.randint(0, Vd, (R // 2,), generator=g)]
    out["anchor_ids"] = anchors
    return out


def with_head(case, head, *, seed=0, w_scale=2.0, hidden_std=1.0):
    """``case`` with a gated or rnn Markov head, as the op takes it: ``head_type`` (1 or 2),
    ``head_hidden`` [R, B, m] fp32 (the hidden part a caller precomputes, random here, std
    ``hidden_std``) and ``head_w`` fp32 (the token side, entries ``w_scale / sqrt(fan_in)``)."""
    g = torch.Generator().manual_seed(seed + 1000)
    R, B, _ = case["base_logits"].shape
    rank = case["markov_w2"].shape[1]
    code = HEAD_TYPES.index(head) if isinstance(head, str) else int(head)
    hh_shape, w_shape = head_shapes(code, R, B, rank)
    out = dict(case)
    out["head_type"] = code
    out["head_hidden"] = torch.randn(hh_shape, generator=g) * hidden_std
    out["head_w"] = torch.randn(w_shape, generator=g) * (w_scale / w_shape[1] ** 0.5)
    return out


def head_kwargs(case):
    """The head arguments of ``case`` for ``markov_draft`` / ``markov_draft_reference`` ({} if vanilla)."""
    if not case.get("head_type"):
        return {}
    return dict(head_hidden=case["head_hidden"], head_w=case["head_w"], head_type=case["head_type"])


def temperatures(R, mode):
    if mode == "greedy":
        return torch.zeros(R)
    if mode == "sampled":
        return torch.linspace(0.6, 1.4, R) if R > 1 else torch.ones(1)
    t = torch.ones(R)  # mixed: even requests greedy
    t[::2] = 0.0
    return t


def constant_conf_case(confs):
    """One request whose confidences are exactly ``confs`` (no Markov part)."""
    B = len(confs)
    case = make_case(1, B, 111, 8, seed=21, conf_w=False)
    c = torch.tensor(confs, dtype=torch.float64)
    case["conf_base"] = torch.log(c / (1 - c)).float()[None, :]
    return case


def nan_case(dtype):
    """NaN policy rows: NaN ranks below -inf; a row of only NaN proposes token 0."""
    V = 500
    case = make_case(4, 3, V, 16, dtype, seed=22)
    base = case["base_logits"]
    base[0, 0, 17] = float("nan")            # one NaN among finite logits
    base[0, 1, :] = float("nan")             # all NaN -> token 0
    base[1, 0, :] = float("-inf")
    base[1, 0, :3] = float("nan")            # NaN before the -infs -> token 3
    base[1, 1, ::2] = float("nan")           # half NaN, half finite
    base[2, :, 0] = float("nan")
    base[2, :, 1:] = 0.25                    # NaN at 0, ties elsewhere -> token 1
    case["markov_w2"][:] = 0
    return case


def to_device(case, dev):
    return {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def upstream_loop(case):
    """Upstream vLLM's greedy loop: per position gather, matmul, add, argmax. Tokens [R, B]."""
    base, w1, w2 = case["base_logits"], case["markov_w1"], case["markov_w2"]
    prev = case["anchor_ids"]
    toks = []
    for i in range(base.shape[1]):
        logits = base[:, i].float() + (w1[prev] @ w2.T).float()
        prev = logits.argmax(dim=-1)
        toks.append(prev)
    return torch.stack(toks, dim=1)


# ------------------------------------------------------------------ op and reference
def run_compiled(case, temp, *, with_max_norms=True, **kw):
    """The compiled op (asserts it really ran, no fallback), with stats."""
    norms = markov_row_norms(case["markov_w2"])
    out = M.markov_draft(case["base_logits"], case["anchor_ids"], case["markov_w1"],
                         case["markov_w2"], norms, case["conf_base"], case["conf_w_markov"],
                         temp, case["seeds"], allow_fallback=False, return_stats=True,
                         max_norms=markov_max_norms(case["markov_w1"], norms)
                         if with_max_norms else None, d2t=case.get("d2t"), **head_kwargs(case), **kw)
    assert out.path == "compiled"
    return out


def run_reference(case, temp, **kw):
    return markov_draft_reference(case["base_logits"], case["anchor_ids"], case["markov_w1"],
                                  case["markov_w2"], case["conf_base"], case["conf_w_markov"],
                                  temp, case["seeds"], d2t=case.get("d2t"), **head_kwargs(case), **kw)


def assert_matches(out, ref):
    tokens, conf = ref[:2]
    assert torch.equal(out.tokens, tokens), (out.tokens, tokens)
    torch.testing.assert_close(out.conf, conf, atol=CONF_ATOL, rtol=0)


# ------------------------------------------------------------------ the CUDA checks
CUDA_SHAPES = [(1, 7, 111, 1), (5, 7, 111, 256), (8, 7, K3_VOCAB, 256), (2, 1, 5000, 64),
               (64, 7, K3_VOCAB, 256)]  # (R, B, V, rank)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("greedy", "sampled", "mixed")
HOST_TENSOR_ARGS = ("conf_base", "conf_w_markov", "out_logits", "out_stats", "max_norms", "d2t", "head_hidden",
                    "head_w")


def _compiled_matches_reference(case, temp, vocab, *, dense, with_max_norms=True):
    """The compiled op against the reference: tokens and confidences, and when ``dense`` the logits
    and an exact score for every one of the ``vocab`` rows."""
    out = run_compiled(case, temp, with_max_norms=with_max_norms, return_logits=dense)
    ref = run_reference(case, temp, return_logits=dense)
    assert_matches(out, ref)
    if dense:
        torch.testing.assert_close(out.logits, ref[2], atol=1e-6, rtol=1e-6)
        assert bool((out.stats == vocab).all())


def check_matches_reference(shape, dtype, mode, dense, device="cuda"):
    R, B, V, rank = shape
    case = to_device(cached_case(R, B, V, rank, dtype, seed=3, peaky=V > 1000), device)
    _compiled_matches_reference(case, temperatures(R, mode).to(device), V, dense=dense)


def check_matches_upstream_loop_on_clear_winners(R, device="cuda"):
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    case = to_device(make_case(R, 7, K3_VOCAB, 256, torch.float32, seed=4, peaky=True), device)
    temp = torch.zeros(R, device=device)
    out = run_compiled(case, temp)
    assert torch.equal(out.tokens, upstream_loop(case))
    assert_matches(out, run_reference(case, temp))


def check_flat_rows_and_max_norms_on_device(with_max_norms, mode, device="cuda"):
    case = to_device(make_case(4, 7, K3_VOCAB, 256, torch.bfloat16, seed=6), device)
    temp = temperatures(4, mode).to(device)
    assert_matches(run_compiled(case, temp, with_max_norms=with_max_norms),
                   run_reference(case, temp))


def check_nan_policy(with_logits, mode, device="cuda"):
    case = to_device(nan_case(torch.float32), device)
    temp = temperatures(4, mode).to(device)
    out = run_compiled(case, temp, return_logits=with_logits)
    assert_matches(out, run_reference(case, temp))
    assert out.tokens[0, 1].item() == 0 and out.tokens[1, 0].item() == 3


def check_out_of_range_anchor(device="cuda"):
    case = to_device(make_case(4, 5, 300, 8, seed=13), device)
    case["anchor_ids"] = torch.tensor([300, -1, 7, 2**40], device=device)
    for mode in ("greedy", "sampled"):
        temp = temperatures(4, mode).to(device)
        assert_matches(run_compiled(case, temp), run_reference(case, temp))


def check_rejects_host_tensors(name, device="cuda"):
    """A host tensor among the CUDA op's arguments is refused, naming it."""
    case = to_device(with_head(make_case(2, 3, 111, 8, seed=14), "gated", seed=14), device)
    R, B, V = case["base_logits"].shape
    norms = markov_row_norms(case["markov_w2"])
    args = dict(conf_base=case["conf_base"], conf_w_markov=case["conf_w_markov"],
                out_logits=torch.empty(R, B, V, device=device),
                out_stats=torch.empty(R, B, dtype=torch.int32, device=device),
                max_norms=markov_max_norms(case["markov_w1"], norms),
                d2t=torch.zeros(V, dtype=torch.int64, device=device),
                head_hidden=case["head_hidden"], head_w=case["head_w"])
    args[name] = args[name].cpu()
    extra = {}
    if name == "d2t":
        extra = dict(d2t=args["d2t"])
    elif name in ("head_hidden", "head_w"):
        extra = dict(head_hidden=args["head_hidden"], head_w=args["head_w"], head_type=case["head_type"])
    try:
        torch.ops.vllm_dspark.markov_draft(
            case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
            norms, args["conf_base"], args["conf_w_markov"], torch.zeros(R, device=device),
            case["seeds"], torch.empty(R, B, dtype=torch.int64, device=device),
            torch.empty(R, B, device=device), args["out_logits"], args["out_stats"], args["max_norms"],
            **extra)
    except RuntimeError as exc:
        assert re.search(name, str(exc)), f"the error does not name {name}: {exc}"
    else:
        raise AssertionError(f"a host {name} was accepted")


def check_draft_vocab(shape, target_vocab, dtype, mode, dense, sort=True, with_max_norms=True,
                      device="cuda"):
    """A draft vocabulary (``d2t``): tokens and logits in draft ids, markov_w1 indexed by target ids,
    anchors inside and outside the draft subset. ``shape`` = (R, B, Vd, rank)."""
    R, B, Vd, rank = shape
    w_std = 0.5 if Vd < 1000 else 0.05
    case = to_device(with_draft_vocab(make_case(R, B, Vd, rank, dtype, seed=17, peaky=Vd > 1000),
                                      target_vocab, seed=18, sort=sort, w_std=w_std), device)
    _compiled_matches_reference(case, temperatures(R, mode).to(device), Vd, dense=dense,
                                with_max_norms=with_max_norms)


def check_head(head, shape, dtype, mode, dense, draft_vocab=False, with_max_norms=True, device="cuda"):
    """A gated or rnn Markov head (``head_type``, ``head_hidden``, ``head_w``): tokens, confidences and
    (dense) logits equal the reference's. Pruned: the walk's head step with each row's ||v||, its dense
    jobs posting v; dense: ``head_kernel`` before every position. ``shape`` = (R, B, V, rank)."""
    R, B, V, rank = shape
    w_std = 0.15 if V < 10000 else 0.05
    case = make_case(R, B, V, rank, dtype, seed=19, peaky=True, w_std=w_std)
    if draft_vocab:
        case = with_draft_vocab(case, K3_VOCAB if V >= 32000 else 2 * V + 500, seed=19, w_std=w_std)
    case = to_device(with_head(case, head, seed=20), device)
    _compiled_matches_reference(case, temperatures(R, mode).to(device), V, dense=dense,
                                with_max_norms=with_max_norms)


def check_all_equal_base_goes_dense(device="cuda"):
    case = to_device(make_case(2, 3, 20000, 8, seed=7), device)
    case["base_logits"].fill_(0.25)
    case["markov_w2"].zero_()
    out = run_compiled(case, torch.zeros(2, device=device))
    assert bool((out.tokens == 0).all()) and bool((out.stats == 20000).all())


def check_graph_capture(device="cuda"):
    """The raw op captured in a CUDA graph and replayed on new base logits."""
    case = to_device(make_case(4, 7, 4096, 64, seed=9), device)
    R, B, V = case["base_logits"].shape
    norms = markov_row_norms(case["markov_w2"])
    max_norms = markov_max_norms(case["markov_w1"], norms)
    temp = temperatures(R, "mixed").to(device)
    outs = (torch.empty(R, B, dtype=torch.int64, device=device),
            torch.empty(R, B, device=device))

    def step():
        torch.ops.vllm_dspark.markov_draft(
            case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
            norms, case["conf_base"], case["conf_w_markov"], temp, case["seeds"],
            *outs, None, None, max_norms)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    case["base_logits"].copy_(torch.randn_like(case["base_logits"]))
    g.replay()
    torch.cuda.synchronize()
    ref = run_reference(case, temp)
    assert torch.equal(outs[0], ref[0])
    torch.testing.assert_close(outs[1], ref[1], atol=CONF_ATOL, rtol=0)


class Check(NamedTuple):
    name: str                      # the pytest id: test_markov_cuda.py::test_cuda_check[name]
    fn: Callable[..., None]
    kwargs: dict
    device_agnostic: bool = True   # also runs on the CPU twin (device="cpu")
    big: bool = False              # K3-sized (slow on a CPU)

    def run(self, device: str = "cuda") -> None:
        self.fn(**self.kwargs, device=device)


def _shape_id(s):
    return "R{}-B{}-V{}-r{}".format(*s)


def cuda_checks() -> list[Check]:
    """Every CUDA op check, cheap ones first (the GPU check runs them in this order)."""
    small: list[Check] = []
    big: list[Check] = []
    for shape in CUDA_SHAPES:
        for dname, dtype in DTYPES.items():
            for mode in MODES:
                for dense in (False, True):
                    name = (f"matches_reference-{_shape_id(shape)}-{dname}-{mode}-"
                            f"{'dense' if dense else 'pruned'}")
                    at_k3 = shape[2] == K3_VOCAB
                    (big if at_k3 else small).append(Check(
                        name, check_matches_reference,
                        dict(shape=shape, dtype=dtype, mode=mode, dense=dense), big=at_k3))
    policies = [
        *(Check(f"nan_policy-{'dense' if wl else 'pruned'}-{mode}", check_nan_policy,
                dict(with_logits=wl, mode=mode)) for wl in (False, True) for mode in ("greedy", "sampled")),
        Check("out_of_range_anchor", check_out_of_range_anchor, {}),
        Check("all_equal_base_goes_dense", check_all_equal_base_goes_dense, {}),
        *(Check(f"draft_vocab-R{R}-B{B}-{dname}-{mode}-{'dense' if dense else 'pruned'}-"
                f"{'sorted' if sort else 'shuffled'}{'' if mn else '-max_norms_on_device'}",
                check_draft_vocab, dict(shape=(R, B, 300, 16), target_vocab=1000, dtype=DTYPES[dname],
                                        mode=mode, dense=dense, sort=sort, with_max_norms=mn))
          for (R, B, dname, mode, dense, sort, mn) in [
              (1, 7, "fp32", "greedy", False, True, True), (4, 7, "bf16", "mixed", False, False, True),
              (3, 1, "fp16", "sampled", False, True, False), (4, 7, "fp32", "mixed", True, False, True)]),
        *(Check(f"head-{head}-R{R}-B{B}-{dname}-{mode}-{'dense' if dense else 'pruned'}-{'d2t' if dv else 'full'}"
                f"{'' if mn else '-max_norms_on_device'}", check_head,
                dict(head=head, shape=(R, B, 1000, 16), dtype=DTYPES[dname], mode=mode, dense=dense,
                     draft_vocab=dv, with_max_norms=mn))
          for head in ("gated", "rnn")
          for (R, B, dname, mode, dense, dv, mn) in [
              (1, 7, "fp32", "greedy", False, False, True), (4, 7, "bf16", "mixed", False, False, True),
              (3, 7, "fp16", "sampled", False, True, False), (4, 7, "fp32", "mixed", True, True, True),
              (4, 1, "bf16", "greedy", True, False, True), (4, 7, "bf16", "sampled", False, True, True)]),
        *(Check(f"rejects_host_tensor-{n}", check_rejects_host_tensors, dict(name=n),
                device_agnostic=False) for n in HOST_TENSOR_ARGS),
        Check("graph_capture", check_graph_capture, {}, device_agnostic=False),
    ]
    k3 = [
        *(Check(f"matches_upstream_loop_on_clear_winners-R{R}", check_matches_upstream_loop_on_clear_winners,
                dict(R=R), big=True) for R in (1, 8, 64)),
        *(Check(f"draft_vocab-K3-Vd32000-{mode}", check_draft_vocab,
                dict(shape=(8, 7, 32000, 256), target_vocab=K3_VOCAB, dtype=torch.bfloat16, mode=mode,
                     dense=False), big=True) for mode in ("greedy", "mixed")),
        *(Check(f"head-{head}-K3-R8-bf16-{mode}-{'d2t-Vd32000' if dv else 'full'}", check_head,
                dict(head=head, shape=(8, 7, 32000 if dv else K3_VOCAB, 256), dtype=torch.bfloat16, mode=mode,
                     dense=False, draft_vocab=dv), big=True)
          for head in ("gated", "rnn") for mode in ("greedy", "mixed") for dv in (False, True)),
        *(Check(f"flat_rows_and_max_norms-{'given' if mn else 'on_device'}-{mode}",
                check_flat_rows_and_max_norms_on_device, dict(with_max_norms=mn, mode=mode), big=True)
          for mn in (True, False) for mode in ("greedy", "sampled")),
    ]
    return [*policies, *small, *k3, *big]


CUDA_CHECKS = cuda_checks()
