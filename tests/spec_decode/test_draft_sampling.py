"""Sampled drafts: the returned q is exactly the distribution each token was drawn from (no engine)."""

from __future__ import annotations

import torch

from vllm_dspark.model.markov_weights import MarkovWeights
from vllm_dspark.spec_decode.common.draft_sampling import sample_drafts

V, R, N, RANK = 12, 1, 3, 4


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return MarkovWeights.build(vocab=V, markov_w1=torch.randn(V, RANK, generator=g),
                               markov_w2=0.5 * torch.randn(V, RANK, generator=g))


def _base(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(R, N, V, generator=g)


def test_tokens_follow_q_at_every_position():
    mw, base = _weights(), _base()
    n = 4000
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 3
    toks, _, q = sample_drafts(base.expand(n, -1, -1), torch.full((n,), 2, dtype=torch.int64), mw,
                               torch.full((n,), 0.8), seeds, None)
    # Position 0's q is the same for every row (same anchor): compare frequencies with it.
    q0 = q[0, 0]
    assert torch.allclose(q[:, 0], q0.expand(n, -1))
    freq = torch.bincount(toks[:, 0], minlength=V).float() / n
    assert (freq - q0).abs().max() < 4 * (q0 * (1 - q0) / n).sqrt().max() + 1e-3
    # Later positions: q depends on the drafted prefix, and each drawn token is in its support.
    picked = q[torch.arange(n), 1, toks[:, 1]]
    assert bool((picked > 0).all())
    torch.testing.assert_close(q.sum(-1), torch.ones(n, N))


def test_top_k_and_top_p_shrink_the_support_and_tokens_stay_inside():
    mw, base = _weights(), _base()
    n = 256
    seeds = torch.arange(n, dtype=torch.int64)
    toks, _, q = sample_drafts(base.expand(n, -1, -1), torch.zeros(n, dtype=torch.int64), mw,
                               torch.full((n,), 1.0), seeds, None, top_k=torch.full((n,), 3, dtype=torch.int32))
    assert int((q[0] > 0).sum(-1).max()) <= 3
    assert bool((q.gather(-1, toks[..., None]) > 0).all())
    _, _, qp = sample_drafts(base.expand(n, -1, -1), torch.zeros(n, dtype=torch.int64), mw,
                             torch.full((n,), 1.0), seeds, None, top_p=torch.full((n,), 0.5))
    full = sample_drafts(base[:1], torch.zeros(1, dtype=torch.int64), mw, torch.ones(1), seeds[:1], None)[2]
    assert int((qp[0, 0] > 0).sum()) < int((full[0, 0] > 0).sum())


def test_seeded_draws_reproduce_and_confidences_use_the_previous_token():
    mw = MarkovWeights.build(vocab=V, markov_w1=_weights().markov_w1, markov_w2=_weights().markov_w2,
                             conf_weight=torch.ones(1, 8 + RANK), conf_bias=torch.zeros(1), hidden_size=8,
                             conf_with_markov=True)
    base = _base()
    conf_base = torch.zeros(R, N)
    a = sample_drafts(base, torch.tensor([5]), mw, torch.tensor([1.0]), torch.tensor([42]), conf_base)
    b = sample_drafts(base, torch.tensor([5]), mw, torch.tensor([1.0]), torch.tensor([42]), conf_base)
    assert torch.equal(a[0], b[0])
    prev = torch.cat([torch.tensor([5]), a[0][0, :-1]])
    want = torch.sigmoid(mw.markov_w1[prev].double() @ mw.conf_w_markov.double()).float()
    torch.testing.assert_close(a[1][0], want)
