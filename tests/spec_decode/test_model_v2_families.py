"""vLLM 0.33 V2 hook: a draft vocabulary (``d2t``) and gated / rnn Markov heads, on CPU.

The fake speculator of ``test_model_v2.py`` drives ``run_markov_stage`` with the compiled CPU op.
What upstream (vLLM 0.33.0, ``dspark/speculator.py`` and ``qwen3_dspark.py``) does with a draft
vocabulary, restated here as the expectation:

* greedy: argmax of the corrected DRAFT-vocabulary logits, mapped to a target id by
  ``draft id + d2t[draft id]`` (``map_draft_to_target``); the next position's ``markov_w1`` row
  is that target id's;
* probabilistic: the corrected draft logits scattered into a target-vocabulary row that is
  -inf everywhere else (``_draft_scatter_buf``, index ``arange(Vd) + d2t``), and that whole row
  cached at ``draft_logits[state, i, :]`` (so q is zero outside the draft vocabulary);
* the acceptance estimator gets the draft-vocabulary logits (it is called before the scatter).

Upstream has no gated or rnn head (no ``gate_proj`` / ``joint_proj`` module): the hook is the
only thing that can draft them, so every reason it would decline becomes a refusal.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.spec_decode.test_model_v2 import MAX_REQS, RANK, FakeSpeculator, H, N
from vllm_dspark.model.markov_weights import MarkovWeights
from vllm_dspark.ops import is_compiled_available, markov_draft_reference
from vllm_dspark.ops.markov_reference import d2t_of_target_ids
from vllm_dspark.spec_decode.common.draft_keys import check_v2_head
from vllm_dspark.spec_decode.common.drafts import MarkovStage
from vllm_dspark.spec_decode.v2 import model as model_v2
from vllm_dspark.spec_decode.v2.model import (
    build_markov,
    hook_reason,
    run_markov_stage,
    split_head_projection,
    why_not_config,
    why_not_speculator,
)

VT, VD = 300, 111  # target vocabulary, draft vocabulary
HEADS = ["vanilla", "gated", "rnn"]
FAMILIES = [(head, dv) for head in HEADS for dv in (False, True)]


def _projection(head: str, g: torch.Generator) -> dict:
    if head == "gated":
        return dict(gate_weight=torch.randn(RANK, H + RANK, generator=g) * 0.4,
                    gate_bias=torch.randn(RANK, generator=g) * 0.4)
    if head == "rnn":
        return dict(joint_weight=torch.randn(3 * RANK, 2 * RANK + H, generator=g) * 0.4,
                    joint_bias=torch.randn(3 * RANK, generator=g) * 0.4)
    return {}


def make_model(head: str, draft_vocab: bool, seed: int = 1):
    """(weights, compute_draft_logits, d2t or None): markov_w1 [VT, r] always (indexed by target ids);
    the LM head and markov_w2 score VD draft ids with a draft vocabulary, VT without."""
    g = torch.Generator().manual_seed(seed)
    vd = VD if draft_vocab else VT
    lm_head = torch.randn(vd, H, generator=g)
    w1 = torch.randn(VT, RANK, generator=g) * 0.7
    w2 = torch.randn(vd, RANK, generator=g) * 0.7
    d2t = None
    if draft_vocab:
        d2t = d2t_of_target_ids(torch.randperm(VT, generator=g)[:vd].sort().values)
    weights = MarkovWeights.build(vocab=VT, markov_w1=w1, markov_w2=w2, d2t=d2t,
                                  conf_weight=torch.randn(H + RANK, generator=g) * 0.2, conf_bias=0.3,
                                  hidden_size=H, conf_with_markov=True, **_projection(head, g))
    return weights, (lambda h: h.float() @ lm_head.T), d2t


def make_spec(d2t, states, *, num_reqs=None, cache=False, estimator=False):
    spec = FakeSpeculator(vocab=VT, states=states, num_reqs=num_reqs,
                          cache_dtype=torch.float32 if cache else None, estimator=estimator)
    if cache and d2t is not None:  # upstream builds it only for probabilistic drafting
        spec._d2t_scatter_index = torch.arange(d2t.numel()) + d2t
    return spec


def run(spec, weights, logits_fn, seed=2):
    head_hidden = torch.randn(spec.num_reqs * N + 3, H, generator=torch.Generator().manual_seed(seed))
    run_markov_stage(spec, spec.num_reqs, head_hidden, weights, logits_fn)
    return head_hidden


def to_target(ids, d2t):
    """Draft ids -> target ids, element by element (the definition, not the stage's gather)."""
    if d2t is None:
        return ids
    return torch.tensor([j + int(d2t[j]) for j in ids.flatten().tolist()]).view(ids.shape)


def logits_to_target(logits, d2t):
    """[R, N, Vd] draft logits -> the whole [R, N, VT] target row upstream caches (-inf elsewhere)."""
    if d2t is None:
        return logits
    out = torch.full((*logits.shape[:-1], VT), float("-inf"))
    for j in range(logits.shape[-1]):
        out[..., j + int(d2t[j])] = logits[..., j]
    return out


def head_args(weights, hidden):
    """The op's head arguments from their definition (fp64 products, bias included, rounded once)."""
    h = hidden.double()
    if weights.head_type == "gated":
        wg = weights.gate_weight.double()
        return dict(head_type=1, head_w=wg[:, H:].float(),
                    head_hidden=(h @ wg[:, :H].T + weights.gate_bias.double()).float())
    if weights.head_type == "rnn":
        wj = weights.joint_weight.double()
        return dict(head_type=2, head_w=wj[:, :2 * RANK].float(),
                    head_hidden=(h @ wj[:, 2 * RANK:].T + weights.joint_bias.double()).float())
    return {}


def reference(spec, weights, logits_fn, head_hidden, num_real, d2t, temperature=None, seeds=None):
    """tokens [R, N] target ids, conf, logits [R, N, Vd] draft ids: ``markov_draft_reference``."""
    hid = head_hidden[spec.sample_indices[:num_real * N]]
    base = logits_fn(hid).view(num_real, N, -1)
    conf_base = weights.confidence_base(hid).view(num_real, N)
    tok, conf, logits = markov_draft_reference(
        base, spec.anchors(num_real), weights.markov_w1, weights.markov_w2, conf_base, weights.conf_w_markov,
        temperature, seeds, return_logits=True, d2t=d2t, **head_args(weights, hid.view(num_real, N, H)))
    return to_target(tok, d2t), conf, logits


@pytest.fixture(autouse=True, scope="module")
def compiled_op():
    # Loads vllm_dspark._C: every stage below runs the compiled CPU op, never a Python fallback.
    assert is_compiled_available("cpu")


# ---------------------------------------------------------------- drafting
@pytest.mark.parametrize("head,draft_vocab", FAMILIES)
@pytest.mark.parametrize("padded", [False, True])
def test_greedy_equals_the_reference_and_the_stage(head, draft_vocab, padded):
    weights, logits_fn, d2t = make_model(head, draft_vocab)
    states = [3, 0, 5]
    spec = make_spec(d2t, states, num_reqs=5 if padded else None)
    R = len(states)
    # Query rows in another order than (request, step): the head reads each position's own row.
    spec.sample_indices[:R * N] = torch.randperm(spec.num_reqs * N + 3, generator=torch.Generator().manual_seed(9))[
        :R * N]
    head_hidden = run(spec, weights, logits_fn)
    tok, conf, _ = reference(spec, weights, logits_fn, head_hidden, R, d2t)
    assert torch.equal(spec.draft_tokens[:R], tok)
    torch.testing.assert_close(spec.draft_token_confidence_probs[:R], conf, atol=1e-6, rtol=0)
    if d2t is not None:  # target ids of draft-vocabulary members
        assert set(spec.draft_tokens[:R].flatten().tolist()) <= set((torch.arange(VD) + d2t).tolist())

    # The stage's own greedy rows (the V1 path's call) on the same rows agree.
    hid = head_hidden[spec.sample_indices[:R * N]]
    stage = MarkovStage(weights, logits_fn)
    base, conf_base = stage.inputs(hid, R, N, with_confidence=True)
    g_tok, g_conf, path = stage.greedy(base, spec.anchors(R), conf_base, hidden=hid.view(R, N, H))
    assert path == "compiled"
    assert torch.equal(spec.draft_tokens[:R], g_tok)
    torch.testing.assert_close(spec.draft_token_confidence_probs[:R], g_conf, atol=1e-6, rtol=0)


def test_greedy_draft_vocabulary_is_upstreams_loop():
    # Restatement of DSparkSpeculator's dense loop with a reduced vocabulary: argmax in draft ids,
    # map_draft_to_target, the next markov_w1 row by target id.
    weights, logits_fn, d2t = make_model("vanilla", True)
    spec = make_spec(d2t, [1, 4, 2, 6])
    head_hidden = run(spec, weights, logits_fn)
    R = 4
    base = logits_fn(head_hidden[spec.sample_indices[:R * N]]).view(R, N, VD)
    prev = spec.anchors(R)
    for i in range(N):
        draft = torch.argmax(base[:, i] + weights.markov_w1[prev] @ weights.markov_w2.T, dim=-1)
        prev = draft + d2t[draft]
        assert torch.equal(spec.draft_tokens[:R, i], prev)


@pytest.mark.parametrize("head,draft_vocab", FAMILIES)
def test_probabilistic_cache_holds_target_vocabulary_logits(head, draft_vocab):
    weights, logits_fn, d2t = make_model(head, draft_vocab)
    states = [6, 2, 4]
    spec = make_spec(d2t, states, num_reqs=4, cache=True)
    head_hidden = run(spec, weights, logits_fn)
    st = torch.tensor(states)
    temp = spec.temperature[st]
    seeds = spec.seeds[st] ^ (spec.anchor_pos << 32)
    tok, conf, logits = reference(spec, weights, logits_fn, head_hidden, 3, d2t, temp, seeds)
    assert torch.equal(spec.draft_tokens[:3], tok)
    torch.testing.assert_close(spec.draft_token_confidence_probs[:3], conf, atol=1e-6, rtol=0)
    want = logits_to_target(logits, d2t)  # [3, N, VT]
    for r, s in enumerate(states):
        torch.testing.assert_close(spec.draft_logits[s], want[r], atol=1e-6, rtol=0)
    for s in set(range(MAX_REQS)) - set(states):  # the padded row (state -1) lands nowhere
        assert bool((spec.draft_logits[s] == -3.0).all()), s
    if d2t is not None:
        # The rejection sampler's q: zero outside the draft vocabulary, the draft's q on it.
        q = torch.softmax(spec.draft_logits[st] / temp[:, None, None], dim=-1)
        q_draft = torch.softmax(logits / temp[:, None, None], dim=-1)
        inside = torch.zeros(VT, dtype=torch.bool)
        inside[torch.arange(VD) + d2t] = True
        assert bool((q[..., ~inside] == 0).all())
        torch.testing.assert_close(q[..., inside], q_draft, atol=1e-6, rtol=1e-5)
        greedy, *_ = reference(spec, weights, logits_fn, head_hidden, 3, d2t)
        assert not torch.equal(tok, greedy)  # sampled, not greedy


def test_estimator_reads_draft_vocabulary_logits():
    weights, logits_fn, d2t = make_model("gated", True)
    spec = make_spec(d2t, [2, 0], estimator=True)
    spec.use_confidence_head = False
    head_hidden = run(spec, weights, logits_fn)
    _, _, logits = reference(spec, weights, logits_fn, head_hidden, 2, d2t)
    calls = spec.acceptance_estimator.calls
    assert [c[2] for c in calls] == list(range(N))
    for i, (lg, idx, _) in enumerate(calls):
        assert lg.shape == (2, VD)
        torch.testing.assert_close(lg, logits[:, i], atol=1e-6, rtol=0)
        assert idx.tolist() == [2, 0]


@pytest.mark.parametrize("head,draft_vocab", [("vanilla", True), ("rnn", True), ("gated", False)])
def test_capture_warmup_with_all_rows_padding_writes_nothing(head, draft_vocab):
    weights, logits_fn, d2t = make_model(head, draft_vocab)
    spec = make_spec(d2t, [], num_reqs=2, cache=True)
    before = spec.draft_logits.clone()
    run(spec, weights, logits_fn)
    assert torch.equal(spec.draft_logits, before)
    assert bool((spec.draft_tokens[2:] == 0).all())


def test_rnn_state_starts_afresh_in_every_block():
    # Two requests with identical inputs draft identically whatever sits beside them in the batch.
    weights, logits_fn, d2t = make_model("rnn", True)
    spec = make_spec(d2t, [0, 1])
    spec.input_buffers.input_ids[N] = spec.input_buffers.input_ids[0]
    hidden = torch.randn(N, H, generator=torch.Generator().manual_seed(5))
    head_hidden = torch.cat([hidden, hidden, torch.zeros(3, H)])
    run_markov_stage(spec, 2, head_hidden, weights, logits_fn)
    assert torch.equal(spec.draft_tokens[0], spec.draft_tokens[1])


# ---------------------------------------------------------------- what remains declined or refused
def test_speculator_reasons_with_a_draft_vocabulary():
    weights, _, d2t = make_model("vanilla", True)
    cpu = torch.device("cpu")
    spec = make_spec(d2t, [0], cache=True)
    assert why_not_speculator(spec, cpu, weights) is None
    spec._d2t_scatter_index = torch.arange(VD - 1)
    assert "_d2t_scatter_index" in why_not_speculator(spec, cpu, weights)
    spec = make_spec(d2t, [0], cache=True)
    spec.draft_logits = spec.draft_logits[..., :VT - 1]
    assert "fewer than the target vocabulary" in why_not_speculator(spec, cpu, weights)
    full, _, _ = make_model("vanilla", False)
    spec = make_spec(d2t, [0], cache=True)  # a map the weights don't have
    assert "_d2t_scatter_index" in why_not_speculator(spec, cpu, full)


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_hook_refuses_what_it_would_leave_to_upstream_for_a_hidden_head(head):
    weights, _, d2t = make_model(head, True)
    spec = make_spec(d2t, [0])
    assert hook_reason(weights, None, spec) is None
    cases = [("_draft_topk", 8, "top-k"), ("draft_watermarker", object(), "watermark"),
             ("draft_logits", torch.zeros(MAX_REQS, N, VT, dtype=torch.bfloat16), "head_dtype")]
    for attr, value, word in cases:
        s = make_spec(d2t, [0])
        setattr(s, attr, value)
        with pytest.raises(ValueError, match=f"markov_head_type '{head}'.*{word}.*vanilla head"):
            hook_reason(weights, None, s)
    vanilla, _, _ = make_model("vanilla", True)
    s = make_spec(d2t, [0])
    s.draft_watermarker = object()
    assert "watermark" in hook_reason(vanilla, None, s)  # a vanilla head declines: upstream drafts it right


def test_config_reasons():
    def cfg(method="greedy", head_dtype=torch.bfloat16, watermark=None):
        return SimpleNamespace(speculative_config=SimpleNamespace(draft_sample_method=method),
                               model_config=SimpleNamespace(head_dtype=head_dtype), watermark_config=watermark)

    assert why_not_config(cfg()) is None
    assert why_not_config(cfg("probabilistic", torch.float32)) is None
    assert "head_dtype" in why_not_config(cfg("probabilistic"))
    assert "watermark" in why_not_config(cfg(watermark=object()))
    with pytest.raises(ValueError, match="markov_head_type 'rnn'.*head_dtype"):
        model_v2.refuse_hidden_head("rnn", why_not_config(cfg("probabilistic")))
    model_v2.refuse_hidden_head("vanilla", why_not_config(cfg("probabilistic")))


def test_check_v2_head():
    for head in (None, "vanilla", "gated", "rnn"):
        check_v2_head(SimpleNamespace(markov_head_type=head))
    check_v2_head(SimpleNamespace(markov_head_type="vanilla", dspark_draft_topk=16))
    for head in ("gated", "rnn"):
        with pytest.raises(ValueError, match=f"'{head}' with dspark_draft_topk.*never calls"):
            check_v2_head(SimpleNamespace(markov_head_type=head, dspark_draft_topk=16))
    with pytest.raises(ValueError, match="'fir': not a Markov head"):
        check_v2_head(SimpleNamespace(markov_head_type="fir"))


# ---------------------------------------------------------------- loading (a stand-in for upstream's model)
class UnquantizedEmbeddingMethod:  # the name vLLM's plain LM-head-like layers carry
    pass


class Fp8LinearMethod:
    pass


def fake_model(weights, d2t, head="vanilla", *, quantized=False, scale=1.0):
    """The attributes of upstream's loaded Qwen3DSparkForCausalLM that ``build_markov`` reads (vLLM pads
    markov_w2 to a multiple of 64 rows)."""
    w2 = torch.cat([weights.markov_w2, torch.zeros(64 - weights.vocab % 64, RANK)])
    conf = SimpleNamespace(proj=SimpleNamespace(weight=torch.cat([weights.conf_w_hidden, weights.conf_w_markov])[None],
                                                bias=torch.tensor([weights.conf_bias])), with_markov=True)
    markov_head = SimpleNamespace(
        markov_w1=SimpleNamespace(weight=weights.markov_w1),
        markov_w2=SimpleNamespace(weight=w2, quant_method=Fp8LinearMethod() if quantized else
                                  UnquantizedEmbeddingMethod()))
    return SimpleNamespace(
        config=SimpleNamespace(markov_head_type=head, hidden_size=H, vocab_size=VT),
        model=SimpleNamespace(markov_head=markov_head, confidence_head=conf),
        logits_processor=SimpleNamespace(org_vocab_size=weights.vocab, scale=scale, soft_cap=None),
        draft_id_to_target_id=None if d2t is None else torch.nn.Parameter(d2t, requires_grad=False),
        target_vocab_size=VT)


def checkpoint_projection(weights):
    names = {"gate_weight": "gate_proj.weight", "gate_bias": "gate_proj.bias",
             "joint_weight": "joint_proj.weight", "joint_bias": "joint_proj.bias"}
    return {f"model.markov_head.{n}": getattr(weights, k) for k, n in names.items() if getattr(weights, k) is not None}


@pytest.mark.parametrize("head,draft_vocab", FAMILIES)
def test_load_captures_the_projection_and_builds_the_weights(head, draft_vocab):
    want, _, d2t = make_model(head, draft_vocab)
    ckpt = {"model.layers.0.mlp.up_proj.weight": torch.zeros(2), "markov_head.markov_w1.weight": want.markov_w1,
            **checkpoint_projection(want)}
    proj: dict = {}
    passed = dict(split_head_projection(ckpt.items(), proj))
    assert set(passed) == {"layers.0.mlp.up_proj.weight", "markov_head.markov_w1.weight"}  # upstream's names only
    assert len(proj) == (0 if head == "vanilla" else 2)
    got, reason = build_markov(fake_model(want, d2t, head), proj)
    assert reason is None and got is not None
    assert got.head_type == head and got.vocab == want.vocab and got.target_vocab == VT
    for name in ("markov_w1", "markov_w2", "d2t", "gate_weight", "gate_bias", "joint_weight", "joint_bias",
                 "conf_w_hidden", "conf_w_markov"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        assert a is None or torch.equal(a, b), name
    assert got.conf_bias == pytest.approx(want.conf_bias)


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_load_refuses_what_a_hidden_head_cannot_be_drafted_with(head, monkeypatch):
    want, _, d2t = make_model(head, True)
    proj = {k.removeprefix("model."): v for k, v in checkpoint_projection(want).items()}
    with pytest.raises(ValueError, match=f"'{head}'.*quantized.*vanilla head"):
        build_markov(fake_model(want, d2t, head, quantized=True), proj)
    with pytest.raises(ValueError, match=f"'{head}'.*logit_scale"):
        build_markov(fake_model(want, d2t, head, scale=0.5), proj)
    twice = d2t.clone()
    twice[1] = twice[0] - 1  # draft ids 0 and 1 on one target id
    with pytest.raises(ValueError, match=f"'{head}'.*two draft ids to one target id"):
        build_markov(fake_model(want, twice, head), proj)
    with pytest.raises(ValueError, match="proj.bias: missing"):
        build_markov(fake_model(want, d2t, head), {k: v for k, v in proj.items() if k.endswith("weight")})
    import vllm_dspark.ops

    monkeypatch.setattr(vllm_dspark.ops, "is_compiled_available", lambda device="cpu": False)
    with pytest.raises(ValueError, match=f"'{head}'.*no compiled markov_draft kernel for 'cpu'"):
        build_markov(fake_model(want, d2t, head), proj)


def test_load_declines_for_a_vanilla_head_and_refuses_a_stray_projection():
    want, _, d2t = make_model("vanilla", True)
    assert build_markov(fake_model(want, d2t, quantized=True), {}) == (None, "markov_w2 is quantized (Fp8LinearMethod)")
    twice = d2t.clone()
    twice[1] = twice[0] - 1
    assert build_markov(fake_model(want, twice), {}) == (None, "d2t maps two draft ids to one target id")
    gated, _, _ = make_model("gated", True)
    stray = {k.removeprefix("model."): v for k, v in checkpoint_projection(gated).items()}
    with pytest.raises(ValueError, match="gate_proj.*markov_head_type is 'vanilla'"):
        build_markov(fake_model(want, d2t), stray)
