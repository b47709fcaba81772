"""The plain-PyTorch drafter against hand-checked properties, and its RoPE against vLLM's.

Tolerances: fp32 values compare with atol 1e-6 where the same operations run in
a different order (hand computations), 1e-5 for RoPE against vLLM; token ids
compare with ``torch.equal``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import K3_CONFIG, QWEN3_CONFIG, tiny_config
from tests.tiny_pair import bigram_chain, expected_length, make_drafter, random_bigram, random_drafter
from vllm_dspark.config import DSparkConfig
from vllm_dspark.model.reference import DSparkDraftModel, count_parameters, expected_tensor_shapes
from vllm_dspark.model.rope import apply_rope, rope_inv_freq_and_scale

CTX = 6  # context tokens per request in these tests


def _model(cfg: DSparkConfig, seed: int = 0, scale: float = 0.2) -> DSparkDraftModel:
    return random_drafter(cfg, seed=seed, scale=scale).eval()


def _inputs(cfg: DSparkConfig, n: int, seed: int = 1):
    """(aux_hidden [n, CTX, aux], embed [V, H], lm_head [V, H]) with unit-scale entries."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(n, CTX, cfg.aux_hidden_size, generator=g)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    lm = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) / math.sqrt(cfg.hidden_size) * 4
    return aux, embed, lm


def _draft(model, aux, embed, lm, *, ctx_len=CTX, anchors=None, **kw):
    n = aux.shape[0]
    ctx_lengths = torch.full((n,), ctx_len) if isinstance(ctx_len, int) else ctx_len
    if anchors is None:
        anchors = torch.arange(n) * 7 % model.config.vocab_size
    return model.draft(aux, ctx_lengths, anchors, embed, lm, **kw)


# ---------------------------------------------------------------- Markov stage
def test_zero_markov_head_is_plain_argmax_of_base_logits():
    cfg = tiny_config()
    model = _model(cfg)
    with torch.no_grad():
        model.markov_head.markov_w1.weight.zero_()
        model.markov_head.markov_w2.weight.zero_()
    aux, embed, lm = _inputs(cfg, n=4)
    anchors = torch.tensor([3, 17, 42, 0])
    out = _draft(model, aux, embed, lm, anchors=anchors)

    # Base logits recomputed by hand: [anchor, mask x (B-1)] at positions p..p+B-1, LM head on top.
    b = cfg.block_size
    q_ids = torch.full((4, b), cfg.mask_token_id)
    q_ids[:, 0] = anchors
    q_pos = CTX + torch.arange(b).expand(4, -1)
    ctx_pos = torch.arange(CTX).expand(4, -1)
    with torch.no_grad():
        hidden = model.backbone(aux, ctx_pos, embed[q_ids], q_pos)
    base = hidden @ lm.t()
    torch.testing.assert_close(out.base_logits, base, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.tokens, out.base_logits.argmax(-1))
    assert torch.equal(out.tokens, base.argmax(-1))
    assert len(set(out.tokens.flatten().tolist())) > 3  # not a degenerate constant draft


def test_use_markov_false_is_plain_argmax():
    cfg = tiny_config()
    model = _model(cfg)
    with torch.no_grad():  # a Markov bias comparable to the base logits
        model.markov_head.markov_w1.weight.mul_(6.0)
        model.markov_head.markov_w2.weight.mul_(6.0)
    aux, embed, lm = _inputs(cfg, n=3)
    with_markov = _draft(model, aux, embed, lm)
    ablated = _draft(model, aux, embed, lm, use_markov=False)
    assert torch.equal(ablated.tokens, ablated.base_logits.argmax(-1))
    assert not torch.equal(with_markov.tokens, ablated.tokens)  # the head does matter here


def _hand_bigram_model(cfg: DSparkConfig, table: torch.Tensor, strength: float) -> DSparkDraftModel:
    """Markov head with rank = vocab that adds exactly ``strength`` to logit table[prev]."""
    model = _model(cfg)
    v = cfg.vocab_size
    with torch.no_grad():
        model.markov_head.markov_w1.weight.copy_(torch.eye(v))  # e(prev) = one-hot(prev)
        w2 = torch.zeros(v, v)
        w2[table, torch.arange(v)] = strength  # bias[j] = strength * [j == table[prev]]
        model.markov_head.markov_w2.weight.copy_(w2)
    return model


def test_markov_head_follows_a_known_bigram_table_from_the_anchor():
    cfg = tiny_config(markov_rank=80)  # rank = vocab: an exact one-hot encoding
    v = cfg.vocab_size
    table = torch.randperm(v, generator=torch.Generator().manual_seed(7))
    model = _hand_bigram_model(cfg, table, strength=10.0)
    with torch.no_grad():
        model.norm.weight.zero_()  # silenced backbone: base logits are exactly 0
    aux, embed, lm = _inputs(cfg, n=v)
    anchors = torch.arange(v)  # every token once as the anchor
    out = _draft(model, aux, embed, lm, anchors=anchors)
    assert torch.equal(out.base_logits, torch.zeros_like(out.base_logits))
    expected = torch.tensor([bigram_chain(table, a, cfg.block_size) for a in range(v)])
    assert torch.equal(out.tokens, expected)


def test_strong_bigram_overrides_an_active_backbone():
    cfg = tiny_config(markov_rank=80)
    v = cfg.vocab_size
    table = torch.randint(0, v, (v,), generator=torch.Generator().manual_seed(8))  # not a permutation
    model = _hand_bigram_model(cfg, table, strength=1e3)
    aux, embed, lm = _inputs(cfg, n=8)
    anchors = torch.tensor([0, 5, 9, 11, 33, 50, 70, 79])
    out = _draft(model, aux, embed, lm, anchors=anchors)
    assert out.base_logits.abs().max() > 1.0  # the backbone is live
    assert out.base_logits.abs().max() < 100.0
    expected = torch.tensor([bigram_chain(table, int(a), cfg.block_size) for a in anchors])
    assert torch.equal(out.tokens, expected)


def test_oracle_checkpoint_from_tiny_follows_its_bigram(tmp_path):
    # tiny.make_drafter's oracle encodes the table with random unit vectors (approximate);
    # rank 128 over 80 tokens separates them, after the bf16 round trip too.
    from vllm_dspark.checkpoint.io import load_reference_model

    cfg = tiny_config(markov_rank=128)
    v = cfg.vocab_size
    table = random_bigram(v, seed=2, allowed=v)
    model = load_reference_model(make_drafter(tmp_path / "oracle", cfg, mode="oracle", bigram=table, seed=4))
    aux, embed, lm = _inputs(cfg, n=v)
    out = _draft(model, aux, embed, lm, anchors=torch.arange(v))
    expected = torch.tensor([bigram_chain(table, a, cfg.block_size) for a in range(v)])
    assert torch.equal(out.tokens, expected)


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_an_exact_oracle_drafts_its_table_through_every_head(tmp_path, head):
    # Markov rank = the vocabulary: one basis vector per token, no crosstalk; the gated head's gate is
    # open and the rnn's output reads the token alone (tiny_pair._open_head). The engine tests' oracle
    # pairs rely on this to be accepted almost always.
    from vllm_dspark.checkpoint.io import load_reference_model

    cfg = tiny_config(markov_rank=tiny_config().vocab_size, markov_head_type=head)
    v = cfg.vocab_size
    table = random_bigram(v, seed=3, allowed=v)
    model = load_reference_model(make_drafter(tmp_path / head, cfg, mode="oracle", bigram=table, seed=4,
                                              backbone_scale=0.05))
    aux, embed, lm = _inputs(cfg, n=v)
    out = _draft(model, aux, embed, lm, anchors=torch.arange(v))
    expected = torch.tensor([bigram_chain(table, a, cfg.block_size) for a in range(v)])
    assert torch.equal(out.tokens, expected)


# ---------------------------------------------------------------- confidence head
def test_confidence_uses_the_previous_tokens_markov_embedding():
    cfg = tiny_config()
    model = _model(cfg, scale=0.5)  # large enough that the Markov part clearly matters
    aux, embed, lm = _inputs(cfg, n=4)
    anchors = torch.tensor([1, 2, 3, 4])
    out = _draft(model, aux, embed, lm, anchors=anchors)

    h = cfg.hidden_size
    w = model.confidence_head.proj.weight.detach()[0]
    b = model.confidence_head.proj.bias.detach()[0]
    w_h, w_m = w[:h], w[h:]
    w1 = model.markov_head.markov_w1.weight.detach()
    prev = torch.cat([anchors[:, None], out.tokens[:, :-1]], dim=1)  # the anchor for position 0
    by_hand = torch.sigmoid(out.hidden @ w_h + w1[prev] @ w_m + b)
    torch.testing.assert_close(out.confidence, by_hand, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.confidence, torch.sigmoid(model.confidence_logits(out.hidden, prev)),
                               atol=1e-6, rtol=0)

    # The wrong conventions are measurably different: the draft's own token, or no Markov input.
    wrong_same = torch.sigmoid(out.hidden @ w_h + w1[out.tokens] @ w_m + b)
    wrong_none = torch.sigmoid(out.hidden @ w_h + b)
    assert (out.confidence - wrong_same).abs().max() > 1e-3
    assert (out.confidence - wrong_none).abs().max() > 1e-3


def test_confidence_without_markov_input_ignores_the_previous_token():
    cfg = tiny_config(confidence_head_with_markov=False)
    model = _model(cfg)
    assert model.confidence_head.proj.weight.shape == (1, cfg.hidden_size)
    aux, embed, lm = _inputs(cfg, n=2)
    out = _draft(model, aux, embed, lm)
    w = model.confidence_head.proj.weight.detach()[0]
    b = model.confidence_head.proj.bias.detach()[0]
    torch.testing.assert_close(out.confidence, torch.sigmoid(out.hidden @ w + b), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- backbone
def _backbone_inputs(cfg, seed=3):
    g = torch.Generator().manual_seed(seed)
    b = cfg.block_size
    aux = torch.randn(1, CTX, cfg.aux_hidden_size, generator=g)
    x = torch.randn(1, b, cfg.hidden_size, generator=g)
    ctx_pos = torch.arange(CTX)[None]
    q_pos = CTX + torch.arange(b)[None]
    return aux, ctx_pos, x, q_pos


def test_block_is_non_causal():
    cfg = tiny_config()
    model = _model(cfg)
    aux, ctx_pos, x, q_pos = _backbone_inputs(cfg)
    x2 = x.clone()
    x2[0, -1] += 1.0  # change only the LAST mask position's input
    with torch.no_grad():
        before = model.backbone(aux, ctx_pos, x, q_pos)
        after = model.backbone(aux, ctx_pos, x2, q_pos)
    assert (after[0, 0] - before[0, 0]).abs().max() > 1e-3  # the anchor row sees it

    # Control: under a causal mask the same change leaves earlier rows untouched.
    b = cfg.block_size
    causal = torch.cat([torch.ones(b, CTX, dtype=torch.bool), torch.ones(b, b, dtype=torch.bool).tril()], -1)[None]
    with torch.no_grad():
        before_c = model.backbone(aux, ctx_pos, x, q_pos, causal)
        after_c = model.backbone(aux, ctx_pos, x2, q_pos, causal)
    torch.testing.assert_close(after_c[0, :-1], before_c[0, :-1], atol=1e-6, rtol=0)


def test_block_mask_shape_and_content():
    m = DSparkDraftModel.block_mask(torch.tensor([2, 4]), num_ctx=4, block=3)
    assert m.shape == (2, 3, 7)
    assert m[0, :, :2].all() and not m[0, :, 2:4].any() and m[0, :, 4:].all()
    assert m[1].all()


def test_context_past_ctx_lengths_is_ignored():
    cfg = tiny_config()
    model = _model(cfg)
    aux, embed, lm = _inputs(cfg, n=2)
    lengths = torch.tensor([3, CTX])
    out = _draft(model, aux, embed, lm, ctx_len=lengths)
    garbage = aux.clone()
    garbage[0, 3:] = 1e3 * torch.randn(CTX - 3, cfg.aux_hidden_size)
    out2 = _draft(model, garbage, embed, lm, ctx_len=lengths)
    assert torch.equal(out.tokens, out2.tokens)
    torch.testing.assert_close(out.confidence, out2.confidence, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.base_logits, out2.base_logits, atol=1e-5, rtol=0)

    # Request 0 drafted alone with only its 3 context rows gives the same block.
    alone = model.draft(aux[:1, :3], torch.tensor([3]), torch.tensor([0]), embed, lm)
    assert torch.equal(alone.tokens, out.tokens[:1])
    torch.testing.assert_close(alone.base_logits, out.base_logits[:1], atol=1e-5, rtol=0)


def test_context_actually_matters():
    cfg = tiny_config()
    model = _model(cfg)
    aux, embed, lm = _inputs(cfg, n=1)
    out = _draft(model, aux, embed, lm)
    out2 = _draft(model, aux * -1.0, embed, lm)
    assert (out.base_logits - out2.base_logits).abs().max() > 1e-2


# ---------------------------------------------------------------- layout and early stop
def test_anchor_first_drafts_block_size_tokens():
    cfg = tiny_config(block_size=7)
    assert cfg.query_layout == "anchor_first"
    model = _model(cfg)
    aux, embed, lm = _inputs(cfg, n=3)
    out = _draft(model, aux, embed, lm)
    assert out.tokens.shape == (3, 7) and out.tokens.dtype == torch.int64
    assert out.confidence.shape == (3, 7) and out.base_logits.shape == (3, 7, cfg.vocab_size)
    assert torch.equal(out.lengths, torch.full((3,), 7, dtype=torch.int32))  # threshold 0 keeps all


def test_one_plus_n_layout_drafts_one_fewer():
    cfg = tiny_config(block_size=7, sample_from_anchor=False)
    assert cfg.num_draft_tokens == 6
    out = _draft(_model(cfg), *_inputs(cfg, n=2))
    assert out.tokens.shape == (2, 6)


def _constant_confidence_model(cfg, c: float) -> DSparkDraftModel:
    model = _model(cfg)
    with torch.no_grad():
        model.confidence_head.proj.weight.zero_()
        model.confidence_head.proj.bias.fill_(math.log(c / (1 - c)))
    return model


@pytest.mark.parametrize("threshold, length", [
    (0.0, 5),  # threshold 0 keeps all
    (0.5, 5),  # every position's own confidence 0.8 passes (the running product would stop at 3)
    (0.79, 5),
    (0.8, 5),  # fp32(0.8) >= 0.8
    (0.81, 0),  # the first position already fails: empty draft
    (1.0, 0),
])
def test_threshold_is_the_reference_rule_on_each_confidence(threshold, length):
    cfg = tiny_config()
    model = _constant_confidence_model(cfg, 0.8)
    out = _draft(model, *_inputs(cfg, n=2), threshold=threshold)
    torch.testing.assert_close(out.confidence, torch.full((2, 5), 0.8), atol=1e-6, rtol=0)
    assert torch.equal(out.lengths, torch.full((2,), length, dtype=torch.int32))
    assert out.tokens.shape == (2, 5)  # tokens are produced for every position regardless


def test_lengths_match_the_reference_rule_on_returned_confidences():
    cfg = tiny_config()
    model = _model(cfg, scale=0.6)
    aux, embed, lm = _inputs(cfg, n=6)
    for threshold in (0.0, 0.05, 0.2, 0.4, 0.7):
        out = _draft(model, aux, embed, lm, threshold=threshold)
        want = [expected_length(row.tolist(), threshold) for row in out.confidence]
        assert out.lengths.tolist() == want, (threshold, out.confidence)


# ---------------------------------------------------------------- sampling
def test_seeded_sampling_is_reproducible_and_greedy_rows_stay_greedy():
    cfg = tiny_config()
    model = _model(cfg)
    aux, embed, lm = _inputs(cfg, n=4)
    greedy = _draft(model, aux, embed, lm)
    temps = torch.tensor([0.0, 1.5, 0.0, 1.5])
    seeds = torch.tensor([11, 12, 13, 14])
    a = _draft(model, aux, embed, lm, temperature=temps, seeds=seeds)
    b = _draft(model, aux, embed, lm, temperature=temps, seeds=seeds)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.tokens[[0, 2]], greedy.tokens[[0, 2]])
    hot = _draft(model, aux, embed, lm, temperature=1.5, seeds=torch.tensor([101, 102, 103, 104]))
    assert not torch.equal(hot.tokens, a.tokens)  # other seeds, other draws (4 x 5 positions)


# ---------------------------------------------------------------- parameter count
def _facts_shapes(cfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """The tensor list of FACTS.md, written out independently of the model code."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    s = {"fc.weight": (h, len(cfg.target_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for n in range(cfg.num_hidden_layers):
        p = f"layers.{n}."
        s.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.num_attention_heads * hd, h),
            p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, h),
            p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, h),
            p + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        })
    s["markov_head.markov_w1.weight"] = (cfg.vocab_size, cfg.markov_rank)
    s["markov_head.markov_w2.weight"] = (cfg.vocab_size, cfg.markov_rank)
    s["confidence_head.proj.weight"] = (1, h + cfg.markov_rank)
    s["confidence_head.proj.bias"] = (1,)
    return s


@pytest.mark.parametrize("cfg", [
    pytest.param(tiny_config(), id="tiny"),
    pytest.param(DSparkConfig.from_json(K3_CONFIG), id="k3"),
    pytest.param(DSparkConfig.from_json(QWEN3_CONFIG), id="qwen3"),
])
def test_parameter_count_equals_named_tensor_shapes(cfg):
    shapes = expected_tensor_shapes(cfg)
    assert shapes == _facts_shapes(cfg)
    assert count_parameters(cfg) == sum(math.prod(s) for s in shapes.values())


def test_k3_and_qwen3_parameter_counts():
    assert count_parameters(DSparkConfig.from_json(K3_CONFIG)) == 2_249_289_601
    assert count_parameters(DSparkConfig.from_json(QWEN3_CONFIG)) == 1_126_422_017


# ---------------------------------------------------------------- RoPE against vLLM
POSITIONS = [0, 1, 7, 100, 4095, 4096, 4097, 10_000, 32_767, 65_535]


def _vllm_rope(head_dim: int, max_pos: int, rope_parameters: dict):
    rot = pytest.importorskip("vllm.model_executor.layers.rotary_embedding")
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # vLLM's CustomOp needs a current config
        return rot.get_rope(head_dim, max_pos, is_neox_style=True, rope_parameters=dict(rope_parameters),
                            dtype=torch.float32)


@pytest.mark.parametrize("src", [K3_CONFIG, QWEN3_CONFIG], ids=["k3-yarn", "qwen3-plain"])
def test_rope_matches_vllm_get_rope(src):
    cfg = DSparkConfig.from_json(src)
    params = {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {"rope_type": "default"})}
    if src == K3_CONFIG:
        assert params == {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 16.0,
                          "original_max_position_embeddings": 4096}
    hd, heads, kv_heads = cfg.head_dim, 4, 2
    ref = _vllm_rope(hd, cfg.max_position_embeddings, params)

    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([p for p in POSITIONS if p < cfg.max_position_embeddings])  # vLLM's cache size
    assert (pos > 4096).sum() >= 3
    q = torch.randn(len(pos), heads * hd, generator=g)
    k = torch.randn(len(pos), kv_heads * hd, generator=g)
    q_vllm, k_vllm = ref.forward_native(pos, q.clone(), k.clone())

    inv_freq, mscale = rope_inv_freq_and_scale(hd, cfg.rope_theta, cfg.rope_scaling)
    q_ours = apply_rope(q.view(len(pos), heads, hd), pos, inv_freq, mscale).reshape(len(pos), -1)
    k_ours = apply_rope(k.view(len(pos), kv_heads, hd), pos, inv_freq, mscale).reshape(len(pos), -1)
    # vLLM's table rounds position x frequency to fp32 (up to 2^-24 relative of the angle); ours takes
    # the angle in fp64, so the two agree to that rounding, which grows with the position.
    angle_err = (pos.double() * 2.0 ** -23)[:, None]  # >= 2 ulps of each angle
    for ours, theirs, x in ((q_ours, q_vllm, q), (k_ours, k_vllm, k)):
        bound = angle_err * x.abs().amax(dim=1, keepdim=True).double() * mscale * 2 + 1e-5
        assert bool(((ours.double() - theirs.double()).abs() <= bound).all())
    small = pos < 64  # where fp32 angle rounding is below 1e-5
    torch.testing.assert_close(q_ours[small], q_vllm[small], atol=1e-5, rtol=1e-5)
    if src == K3_CONFIG:
        assert mscale == pytest.approx(0.1 * math.log(16) + 1)
        assert not torch.allclose(q_ours[-1], q[-1])  # rotation happened at the far position
