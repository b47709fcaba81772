"""The Markov stage with a draft vocabulary (``MarkovWeights.d2t``): it drafts in draft ids through
the op and the recurrence and hands target ids and a target-vocabulary q to everyone else."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from vllm_dspark.model.markov_weights import MarkovWeights
from vllm_dspark.ops import is_compiled_available
from vllm_dspark.ops.markov_reference import d2t_of_target_ids, markov_draft_reference
from vllm_dspark.spec_decode.common.draft_sampling import sample_drafts
from vllm_dspark.spec_decode.common.drafts import DraftBatch, DraftVocab, IdentityVocab, MarkovStage

V, VD, H, RANK, N = 400, 150, 16, 8, 5


def _d2t(seed=0, sort=True):
    g = torch.Generator().manual_seed(seed)
    tgt = torch.randperm(V, generator=g)[:VD]
    if sort:
        tgt = tgt.sort().values
    return d2t_of_target_ids(tgt)


def _stage(seed=0, sort=True):
    g = torch.Generator().manual_seed(seed)
    lm = torch.randn(VD, H, generator=g)
    # Padded as vLLM pads LM-head-like weights: the build trims w1 to V rows and w2 to Vd.
    w = MarkovWeights.build(vocab=V, markov_w1=torch.randn(V + 5, RANK, generator=g),
                            markov_w2=torch.randn(VD + 7, RANK, generator=g) * 0.5,
                            conf_weight=torch.randn(H + RANK, generator=g) * 0.2, conf_bias=0.1, hidden_size=H,
                            conf_with_markov=True, d2t=_d2t(seed, sort))
    pad = torch.full((1, 3), -1e4)
    return MarkovStage(w, lambda h: torch.cat([h @ lm.T, pad.expand(h.shape[0], 3)], dim=1)), lm


def _batch(r, rows, sampled, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(rows) * N, H, generator=g)
    anchors = torch.randint(0, V, (r,), generator=g)  # target ids, mostly outside the draft subset
    temps = torch.where(torch.from_numpy(sampled), torch.tensor(0.8), torch.tensor(0.0))
    return DraftBatch(rows=rows, anchors=anchors, num_tokens=N, sampled=sampled, hidden=hidden,
                      temperature=temps, seeds=lambda rr: torch.tensor([7 + x for x in rr], dtype=torch.int64))


def test_weights_and_vocab_shapes():
    stage, _ = _stage()
    w = stage.weights
    assert w.vocab == VD and w.target_vocab == V and w.markov_w2.shape == (VD, RANK)
    assert w.markov_w1.shape == (V, RANK) and w.w2_row_norms.shape == (VD,)
    assert isinstance(stage.vocab, DraftVocab)
    assert stage.vocab.size == V and stage.vocab.draft_size == VD
    assert torch.equal(stage.vocab.target_ids, torch.arange(VD) + w.d2t)
    assert w.to("cpu").d2t is w.d2t or torch.equal(w.to("cpu").d2t, w.d2t)
    assert torch.equal(w.without_bias().d2t, w.d2t)
    plain = MarkovWeights.build(vocab=V, markov_w1=w.markov_w1, markov_w2=torch.randn(V, RANK))
    assert plain.d2t is None and isinstance(MarkovStage(plain, lambda h: h).vocab, IdentityVocab)


@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "shuffled"])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 2]])
def test_stage_drafts_the_mapped_reference(rows, sort):
    assert is_compiled_available("cpu")
    stage, lm = _stage(seed=3, sort=sort)
    sampled = np.array([False, True, False, True])
    b = _batch(4, rows, sampled)
    d = stage.draft(b)
    w = stage.weights
    tgt = torch.arange(VD) + w.d2t
    base = (b.hidden @ lm.T).view(len(rows), N, VD)
    conf_base = w.confidence_base(b.hidden).view(len(rows), N)
    anchors = b.anchors[rows]
    is_s = sampled[rows]
    g = np.flatnonzero(~is_s)
    tok, conf = markov_draft_reference(base[g], anchors[g], w.markov_w1, w.markov_w2, conf_base[g],
                                       w.conf_w_markov, d2t=w.d2t)
    assert d.path == "compiled"
    assert torch.equal(d.tokens[g], tgt[tok]) and torch.allclose(d.confidence[g], conf, atol=1e-6)
    s = np.flatnonzero(is_s)
    t_s, c_s, q_s = sample_drafts(base[s], anchors[s], w, b.temperature[torch.tensor(rows)[s]],
                                  b.seeds(torch.tensor(rows)[s].tolist()), conf_base[s])
    assert q_s.shape == (len(s), N, VD) and int(t_s.max()) < VD
    assert torch.equal(d.tokens[s], tgt[t_s]) and torch.equal(d.confidence[s], c_s)
    # q over the target vocabulary: the draft q at the target ids, exactly, and zero elsewhere.
    assert d.probs is not None and d.probs.shape == (len(rows), N, V)
    assert torch.equal(d.probs[s][..., tgt], q_s)
    outside = torch.ones(V, dtype=torch.bool)
    outside[tgt] = False
    assert not d.probs[..., outside].any() and not d.probs[g].any()
    # q is float32: its sum is 1 to a few float32 ulps (1.19e-7 each), not to assert_close's float64 default
    # (1e-7), which an AVX-512 softmax misses by 2.7e-7 on one row (AVX2 machines happened to pass it).
    torch.testing.assert_close(d.probs[s].double().sum(-1), torch.ones(len(s), N, dtype=torch.float64),
                               atol=1e-6, rtol=0)
    # Every sampled token has mass under the q it was drawn from.
    assert bool((d.probs[s].gather(-1, d.tokens[s][..., None]) > 0).all())


def test_the_sampled_recurrence_feeds_target_ids_to_markov_w1():
    stage, lm = _stage(seed=4)
    w = stage.weights
    b = _batch(3, [0, 1, 2], np.ones(3, dtype=bool), seed=5)
    base = (b.hidden @ lm.T).view(3, N, VD)
    args = (base, b.anchors, w, b.temperature, b.seeds([0, 1, 2]), w.confidence_base(b.hidden).view(3, N))
    t, c, _ = sample_drafts(*args)
    t0, c0, _ = sample_drafts(*args[:2], replace(w, d2t=torch.zeros_like(w.d2t)),
                              *args[3:])
    assert not torch.equal(t, t0) or not torch.allclose(c, c0)


def test_draft_into_writes_target_ids_and_draft_space_logits():
    stage, lm = _stage(seed=6)
    w = stage.weights
    b = _batch(3, [0, 1, 2], np.zeros(3, dtype=bool), seed=7)
    base, conf_base = stage.inputs(b.hidden, 3, N, with_confidence=True)
    assert base.shape == (3, N, VD)
    temp, seeds = torch.tensor([0.0, 0.9, 0.0]), torch.tensor([3, 4, 5])
    out_tokens, out_conf = torch.empty(3, N, dtype=torch.int64), torch.empty(3, N)
    out_logits = torch.empty(3, N, VD)
    stage.draft_into(base, b.anchors, conf_base, temp, seeds, out_tokens, out_conf, out_logits)
    tok, conf, logits = markov_draft_reference(base, b.anchors, w.markov_w1, w.markov_w2, conf_base,
                                               w.conf_w_markov, temp, seeds, return_logits=True, d2t=w.d2t)
    assert torch.equal(out_tokens, stage.vocab.to_target(tok))
    torch.testing.assert_close(out_conf, conf, atol=1e-6, rtol=0)
    torch.testing.assert_close(out_logits, logits, atol=1e-6, rtol=1e-6)


def test_draft_into_keeps_the_old_schema_without_d2t():
    # Without a draft vocabulary the op is called exactly as before (14 arguments), so stand-ins
    # written for that schema keep working.
    g = torch.Generator().manual_seed(8)
    w = MarkovWeights.build(vocab=50, markov_w1=torch.randn(50, 4, generator=g),
                            markov_w2=torch.randn(50, 4, generator=g))
    calls = []
    stage = MarkovStage(w, lambda h: h)
    stage.draft_into(torch.zeros(1, 2, 50), torch.zeros(1, dtype=torch.int64), None, torch.zeros(1),
                     torch.zeros(1, dtype=torch.int64), torch.empty(1, 2, dtype=torch.int64), torch.empty(1, 2),
                     None, op=lambda *a: calls.append(len(a)))
    assert calls == [14]


def test_q_to_target_sums_mass_of_shared_target_ids():
    vocab = DraftVocab(torch.tensor([2, 1, 0, -3]), 6)  # draft 0..3 -> target 2, 2, 2, 0
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    assert torch.equal(vocab.to_target(torch.tensor([[0, 3]])), torch.tensor([[2, 0]]))
    torch.testing.assert_close(vocab.q_to_target(q), torch.tensor([[0.4, 0.0, 0.6, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("bad,match", [
    (lambda d: d + torch.arange(VD), "outside the target vocabulary"),
    (lambda d: d.to(torch.int32), "int64"),
    (lambda d: d[None], "1-D"),
], ids=["target-ids-not-offsets", "int32", "2-D"])
def test_build_refuses_a_bad_d2t(bad, match):
    g = torch.Generator().manual_seed(9)
    with pytest.raises(ValueError, match=match):
        MarkovWeights.build(vocab=V, markov_w1=torch.randn(V, RANK, generator=g),
                            markov_w2=torch.randn(VD, RANK, generator=g), d2t=bad(_d2t()))
