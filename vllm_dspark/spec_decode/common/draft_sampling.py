"""Sampled drafts for requests with temperature > 0, honouring each request's top-k and top-p.

With greedy drafts, a request sampled at temperature 1 accepts a draft token
only with probability ``p_target(token)``: on a chat model that is often well
below one half, so speculation at T = 1 rarely pays. Drafting by sampling from
the drafter's own distribution ``q`` and verifying with the ratio test
``min(1, p / q)`` accepts with probability ``1 - TV(p, q)`` instead.

For that to stay lossless, the ``q`` handed to the rejection sampler must be
exactly the distribution each draft token was drawn from. Here, position by
position (the Markov bias depends on the previous draft; the loop is
``markov_recurrence``, the reference's own, with this ``pick``):

    logits_i = base_i + markov_w2 @ markov_w1[prev]      (fp64 bias, as the op; a gated or
                                                          rnn head's own bias, ``heads.py``)
    z_i      = top_k_top_p(logits_i / T)                 (vLLM's own filter, the one the
                                                          target's distribution goes through)
    q_i      = softmax(z_i)
    token_i  = argmax(z_i + Gumbel(seed, i, .))          (an exact draw from q_i)

The Gumbel noise is the op's counter-based hash (``gumbel_noise``), so a seeded
request drafts the same tokens alone or in any batch. Greedy requests never
come here: they draft through the Markov draft op.

With a draft vocabulary (``mw.d2t``) all of this is in draft ids (q over the
Vd scored tokens); ``markov_w1[prev]`` takes the previous token's target id
(``markov_recurrence``). The stage maps tokens and q to the target vocabulary.
"""

from __future__ import annotations

import torch

from vllm_dspark.model.markov_weights import MarkovWeights
from vllm_dspark.ops.markov_reference import gumbel_noise, markov_recurrence
from vllm_dspark.spec_decode.common.heads import make_head


def _top_k_top_p(z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    if top_k is None and top_p is None:
        return z
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    return apply_top_k_top_p(z.clone(), top_k, top_p)


@torch.no_grad()
def sample_drafts(base: torch.Tensor, anchors: torch.Tensor, mw: MarkovWeights, temperature: torch.Tensor,
                  seeds: torch.Tensor, conf_base: torch.Tensor | None, *, top_k: torch.Tensor | None = None,
                  top_p: torch.Tensor | None = None, head=None,
                  hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft one block per request by sampling.

    Parameters
    ----------
    base : [R, N, V] base logits (target LM head on the draft hidden states)
    anchors : [R] int64 last accepted token per request
    mw : the Markov stage's weights
    temperature : [R] fp32, all > 0
    seeds : [R] int64 Gumbel seeds (one per request and decoding step)
    conf_base : [R, N] fp32 parallel part of the confidence, or None
    top_k : [R] int or None; top_p : [R] fp32 or None (vLLM's per-request tensors)
    head : the Markov head variant (``embed``, ``start``: ``spec_decode/common/heads.py``;
        ``drafts.MarkovStage`` passes its own); None: the head ``mw`` was built for
    hidden : [R, N, H] the backbone's hidden rows, for a head that reads them (gated, rnn)

    Returns
    -------
    tokens [R, N] int64, conf [R, N] fp32, q [R, N, V] fp32 (the draw's distribution);
    tokens and q in draft ids with a draft vocabulary (``mw.d2t``)
    """
    r, n, v = base.shape
    dev = base.device
    tokens = torch.empty(r, n, dtype=torch.int64, device=dev)
    conf = torch.ones(r, n, dtype=torch.float32, device=dev)
    q = torch.empty(r, n, v, dtype=torch.float32, device=dev)
    t = temperature.to(torch.float32)[:, None]

    def pick(i: int, logits: torch.Tensor) -> torch.Tensor:
        z = _top_k_top_p(logits / t, top_k, top_p)
        q[:, i] = torch.softmax(z, dim=-1)
        return torch.argmax(z + gumbel_noise(seeds, i, v), dim=-1)

    if head is None:
        head = make_head(mw)
    markov_recurrence(base, anchors, head.embed, head.start(hidden), pick, tokens, conf, conf_base,
                      mw.conf_w_markov, mw.d2t)
    return tokens, conf, q
