"""The gated and rnn Markov heads in the draft path (issue 30): the stage drafts exactly what a
straightforward per-row, per-position loop drafts (float32 inputs; tokens equal, confidences within 1e-5),
with and without a draft vocabulary, greedy rows on the compiled op and sampled rows through the Python
recurrence; the two agree; the reference drafter agrees; the rnn state starts afresh in every block; the
heads change the drafts; a wrong projection is refused by name."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.helpers import tiny_config
from tests.ops.markov_cases import make_case, with_draft_vocab
from tests.tiny_pair import random_drafter
from vllm_dspark.checkpoint.shapes import required_shapes
from vllm_dspark.model.markov_weights import MarkovWeights
from vllm_dspark.model.reference import expected_tensor_shapes
from vllm_dspark.ops.markov_reference import gumbel_noise
from vllm_dspark.spec_decode.common.drafts import DraftBatch, GatedHead, MarkovStage, RnnHead, VanillaHead

V, VT, H, RANK, N = 111, 300, 16, 8, 5  # VT: the target vocabulary of the draft-vocabulary cases
HEADS = ["gated", "rnn"]


def _projection(head: str, g: torch.Generator, scale: float = 0.4) -> dict:
    if head == "gated":
        return dict(gate_weight=torch.randn(RANK, H + RANK, generator=g) * scale,
                    gate_bias=torch.randn(RANK, generator=g) * scale)
    if head == "rnn":
        return dict(joint_weight=torch.randn(3 * RANK, 2 * RANK + H, generator=g) * scale,
                    joint_bias=torch.randn(3 * RANK, generator=g) * scale)
    return {}


def _weights(head: str, *, draft_vocab: bool = False, seed: int = 0, proj: dict | None = None):
    """(MarkovWeights, anchors [4] target ids): a full-vocabulary or a draft-vocabulary (Vd = V) head."""
    case = make_case(4, N, V, RANK, seed=seed, w_std=0.5)
    if draft_vocab:
        case = with_draft_vocab(case, VT, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    proj = _projection(head, g) if proj is None else proj
    w = MarkovWeights.build(vocab=VT if draft_vocab else V, markov_w1=case["markov_w1"], markov_w2=case["markov_w2"],
                            conf_weight=torch.randn(H + RANK, generator=g) * 0.3, conf_bias=0.2, hidden_size=H,
                            conf_with_markov=True, d2t=case.get("d2t"), **proj)
    return w, case["anchor_ids"]


def _stage(w: MarkovWeights, seed: int = 0):
    lm = torch.randn(V, H, generator=torch.Generator().manual_seed(seed + 200)) * 0.8
    return MarkovStage(w, lambda h: h.float() @ lm.T), lm


def _batch(anchors, rows, sampled, seed=1, temps=(0.7, 1.0, 1.3, 0.9)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(rows) * N, H, generator=g)
    temperature = torch.where(torch.from_numpy(sampled), torch.tensor(temps), torch.tensor(0.0))
    return DraftBatch(rows=rows, anchors=anchors, num_tokens=N, sampled=sampled, hidden=hidden,
                      temperature=temperature, seeds=lambda rr: torch.tensor([11 + 5 * x for x in rr]))


# ---------------------------------------------------------------- the oracle
def oracle(w: MarkovWeights, base, hidden, anchors, temps, seeds):
    """One row, one position at a time, from the definitions: the head in fp64 with the op's two
    rounding points (the hidden part, bias included, and v rounded once to fp32), fp32 logits.

    base [R, N, Vd], hidden [R, N, H], anchors [R] target ids, temps [R] (0: greedy), seeds [R].
    Returns tokens [R, N] (target ids), conf [R, N], q [R, N, VT or V] (zero for greedy rows)."""
    r_, n_, vd = base.shape
    vt = w.markov_w1.shape[0]
    w1, w2 = w.markov_w1.double(), w.markov_w2.double()
    tgt = torch.arange(vd) if w.d2t is None else torch.arange(vd) + w.d2t
    tokens = torch.zeros(r_, n_, dtype=torch.int64)
    conf = torch.zeros(r_, n_, dtype=torch.float64)
    q = torch.zeros(r_, n_, vt)
    for r in range(r_):
        prev = int(anchors[r])
        rank = w.rank
        s = torch.zeros(rank, dtype=torch.float64)
        for k in range(n_):
            h = hidden[r, k].double()
            e = w1[prev] if 0 <= prev < vt else torch.zeros(rank, dtype=torch.float64)
            if w.head_type == "gated":
                wg = w.gate_weight.double()
                hd = h.shape[0]
                gh = (wg[:, :hd] @ h + w.gate_bias.double()).float().double()
                g = torch.sigmoid(gh + wg[:, hd:] @ e)
                v = (g * e).float().double()
            elif w.head_type == "rnn":
                wj = w.joint_weight.double()
                jh = (wj[:, 2 * rank:] @ h + w.joint_bias.double()).float().double()
                a, c, o = (jh + wj[:, :2 * rank] @ torch.cat([s, e])).chunk(3)
                s = torch.sigmoid(a) * s + (1 - torch.sigmoid(a)) * torch.tanh(c)
                v = torch.tanh(o).float().double()
            else:
                v = e
            logits = base[r, k].float() + (w2 @ v).float()
            t = float(temps[r])
            if t > 0:
                z = logits / t
                tok = int(torch.argmax(z + gumbel_noise(seeds[r:r + 1], k, vd)[0]))
                q[r, k, tgt] = torch.softmax(z, dim=-1)
            else:
                tok = int(torch.argmax(logits))
            if w.conf_w_hidden is not None and w.conf_w_markov is not None:
                conf[r, k] = torch.sigmoid(w.conf_w_hidden.double() @ h + w.conf_bias + w.conf_w_markov.double() @ e)
            else:
                conf[r, k] = 1.0
            prev = int(tgt[tok])
            tokens[r, k] = prev
    return tokens, conf.float(), q


def _check(d, tokens, conf, q, sampled):
    assert torch.equal(d.tokens, tokens)
    torch.testing.assert_close(d.confidence, conf, atol=1e-5, rtol=0)
    if sampled.any():
        torch.testing.assert_close(d.probs, q, atol=1e-6, rtol=1e-5)
    else:
        assert d.probs is None


# ---------------------------------------------------------------- the stage against the oracle
@pytest.mark.parametrize("draft_vocab", [False, True], ids=["full", "d2t"])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("head", HEADS)
def test_stage_drafts_what_the_oracle_drafts(head, mode, draft_vocab):
    w, anchors = _weights(head, draft_vocab=draft_vocab, seed=3)
    stage, lm = _stage(w)
    assert stage.head.kind == head and w.head_type == head
    sampled = {"greedy": np.zeros(4, bool), "sampled": np.ones(4, bool),
               "mixed": np.array([False, True, True, False])}[mode]
    rows = [0, 1, 2, 3]
    b = _batch(anchors, rows, sampled)
    d = stage.draft(b)
    hidden = b.hidden.view(4, N, H)
    temps = b.temperature
    tokens, conf, q = oracle(w, (b.hidden @ lm.T).view(4, N, V), hidden, anchors, temps, b.seeds(rows))
    _check(d, tokens, conf, q, sampled)
    if mode != "sampled":
        assert d.path == stage.last_path == "compiled"  # greedy rows on the op, with the head's v


@pytest.mark.parametrize("head", HEADS)
def test_a_subset_of_rows_reads_its_own_hidden_rows(head):
    w, anchors = _weights(head, seed=5)
    stage, lm = _stage(w, seed=5)
    rows = [3, 1]
    sampled = np.array([True, False, False, True])
    b = _batch(anchors, rows, sampled, seed=2)
    d = stage.draft(b)
    sel = torch.tensor(rows)
    tokens, conf, q = oracle(w, (b.hidden @ lm.T).view(2, N, V), b.hidden.view(2, N, H), anchors[sel],
                             b.temperature[sel], b.seeds(rows))
    _check(d, tokens, conf, q, sampled[rows])


@pytest.mark.parametrize("head", HEADS)
def test_each_block_alone_drafts_what_it_drafts_in_a_batch(head):
    """The rnn state (and the gated head's hidden rows) belong to one block: two requests drafted
    together give what each gives alone, greedy and sampled, and drafting twice gives the same."""
    w, anchors = _weights(head, seed=7)
    stage, _ = _stage(w, seed=7)
    for sampled in (np.zeros(4, bool), np.ones(4, bool)):
        both = stage.draft(_batch(anchors, [0, 2], sampled, seed=4))
        again = stage.draft(_batch(anchors, [0, 2], sampled, seed=4))
        hidden = _batch(anchors, [0, 2], sampled, seed=4).hidden.view(2, N * H)
        for i, row in enumerate((0, 2)):
            one = _batch(anchors, [row], sampled, seed=4)
            one = DraftBatch(**{**one.__dict__, "hidden": hidden[i].view(N, H)})
            alone = stage.draft(one)
            assert torch.equal(alone.tokens[0], both.tokens[i])
            # (the confidence's parallel GEMV may round differently with another row count)
            torch.testing.assert_close(alone.confidence[0], both.confidence[i], atol=1e-6, rtol=0)
            if sampled.any():
                assert alone.probs is not None and both.probs is not None
                torch.testing.assert_close(alone.probs[0], both.probs[i], atol=1e-7, rtol=1e-6)
        assert torch.equal(again.tokens, both.tokens)


def test_rnn_state_carries_along_the_block():
    """With the state's weights zeroed the rnn drafts differently: the state is really read."""
    w, anchors = _weights("rnn", seed=9)
    jw = w.joint_weight.clone()
    jw[:, :RANK] *= 8.0  # a state that matters
    stage, lm = _stage(MarkovWeights.build(vocab=V, markov_w1=w.markov_w1, markov_w2=w.markov_w2 * 4,
                                           joint_weight=jw, joint_bias=w.joint_bias))
    stateless = jw.clone()
    stateless[:, :RANK] = 0
    flat, _ = _stage(MarkovWeights.build(vocab=V, markov_w1=w.markov_w1, markov_w2=w.markov_w2 * 4,
                                         joint_weight=stateless, joint_bias=w.joint_bias))
    b = _batch(anchors, [0, 1, 2, 3], np.zeros(4, bool), seed=6)
    d = stage.draft(b)
    assert torch.equal(d.tokens, oracle(stage.weights, (b.hidden @ lm.T).view(4, N, V), b.hidden.view(4, N, H),
                                        anchors, torch.zeros(4), b.seeds([0, 1, 2, 3]))[0])
    assert torch.equal(d.tokens[:, 0], flat.draft(b).tokens[:, 0])  # s_{-1} = 0: position 0 cannot tell
    assert not torch.equal(d.tokens, flat.draft(b).tokens)


@pytest.mark.parametrize("draft_vocab", [False, True], ids=["full", "d2t"])
@pytest.mark.parametrize("head", HEADS)
def test_greedy_rows_run_on_the_op_and_equal_the_python_recurrence(head, draft_vocab, monkeypatch):
    """The stage's greedy rows take the compiled op (path "compiled") and give exactly what the Python
    recurrence gives with the head's own bias (``head.start``); when the op cannot take the call, the
    fallback says which head it ran."""
    from vllm_dspark.ops import markov as M
    from vllm_dspark.ops.markov_reference import markov_draft_reference

    assert M.is_compiled_available("cpu")
    w, anchors = _weights(head, draft_vocab=draft_vocab, seed=11)
    stage, lm = _stage(w, seed=11)
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(4, N, H, generator=g)
    base = (hidden @ lm.T).view(4, N, V)
    conf_base = w.confidence_base(hidden.reshape(4 * N, H)).view(4, N)
    tokens, conf, path = stage.greedy(base, anchors, conf_base, hidden=hidden)
    assert path == "compiled"
    ref_tokens, ref_conf = markov_draft_reference(base, anchors, w.markov_w1, w.markov_w2, conf_base, w.conf_w_markov,
                                                  d2t=w.d2t, head_bias=stage.head.start(hidden))
    assert torch.equal(tokens, stage.vocab.to_target(ref_tokens))
    torch.testing.assert_close(conf, ref_conf, atol=1e-6, rtol=0)
    o_tokens, o_conf, _ = oracle(w, base, hidden, anchors, torch.zeros(4), torch.zeros(4, dtype=torch.int64))
    assert torch.equal(tokens, o_tokens)
    monkeypatch.setattr(M, "_why_not", lambda *a, **k: "test: no compiled op")
    fb_tokens, fb_conf, fb_path = stage.greedy(base, anchors, conf_base, hidden=hidden)
    assert fb_path == f"reference-{head}"
    assert torch.equal(fb_tokens, tokens)
    torch.testing.assert_close(fb_conf, conf, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- the heads matter
def test_gated_and_rnn_heads_draft_differently_from_vanilla_with_the_same_w1_w2():
    """Constructed: W2 W1 is a strong bigram the vanilla head follows. A closed gate (bg = -40)
    silences it, so the gated head proposes the base argmax; an rnn head whose output is a fixed
    tanh(o) adds one constant bias, whatever the previous token."""
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(V, RANK, generator=g), torch.randn(V, RANK, generator=g) * 3.0
    vanilla = MarkovWeights.build(vocab=V, markov_w1=w1, markov_w2=w2)
    gated = MarkovWeights.build(vocab=V, markov_w1=w1, markov_w2=w2, gate_weight=torch.zeros(RANK, H + RANK),
                                gate_bias=torch.full((RANK,), -40.0))
    o = torch.randn(RANK, generator=g)
    rnn = MarkovWeights.build(vocab=V, markov_w1=w1, markov_w2=w2, joint_weight=torch.zeros(3 * RANK, 2 * RANK + H),
                              joint_bias=torch.cat([torch.zeros(2 * RANK), o]))
    lm = torch.randn(V, H, generator=g)
    anchors = torch.arange(4) * 13
    b = _batch(anchors, [0, 1, 2, 3], np.zeros(4, bool))
    base = (b.hidden @ lm.T).view(4, N, V)
    drafts = {k: MarkovStage(mw, lambda h: h @ lm.T).draft(b) for k, mw in
              (("vanilla", vanilla), ("gated", gated), ("rnn", rnn))}
    assert drafts["vanilla"].path == "compiled"
    assert torch.equal(drafts["gated"].tokens, base.argmax(-1))  # g ~ 1e-18: no bias
    const = (torch.tanh(o.double()).float().double() @ w2.double().T).float()
    assert torch.equal(drafts["rnn"].tokens, (base + const).argmax(-1))
    assert not torch.equal(drafts["gated"].tokens, drafts["vanilla"].tokens)
    assert not torch.equal(drafts["rnn"].tokens, drafts["vanilla"].tokens)


# ---------------------------------------------------------------- the reference drafter
@pytest.mark.parametrize("head", HEADS)
def test_reference_drafter_and_stage_agree(head):
    cfg = tiny_config(markov_head_type=head, vocab_size=80)
    model = random_drafter(cfg, seed=2, scale=0.3).eval()
    assert required_shapes(cfg) == expected_tensor_shapes(cfg)  # gate_proj / joint_proj named as stored
    g = torch.Generator().manual_seed(3)
    n, ctx = 4, 6
    aux = torch.randn(n, ctx, cfg.aux_hidden_size, generator=g)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    lm = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) / math.sqrt(cfg.hidden_size) * 4
    anchors = torch.tensor([5, 17, 40, 79])
    temps = torch.tensor([0.0, 0.8, 0.0, 1.2])
    seeds = torch.tensor([3, 4, 5, 6])
    out = model.draft(aux, torch.full((n,), ctx), anchors, embed, lm, temperature=temps, seeds=seeds)
    mw = model.markov_weights()
    assert mw.head_type == head
    stage = MarkovStage(mw, lambda h: h.float() @ lm.float().T)
    b = DraftBatch(rows=list(range(n)), anchors=anchors, num_tokens=cfg.block_size,
                   sampled=(temps > 0).numpy(), hidden=out.hidden.reshape(n * cfg.block_size, -1),
                   temperature=temps, seeds=lambda rr: seeds[rr])
    d = stage.draft(b)
    assert torch.equal(d.tokens, out.tokens)
    torch.testing.assert_close(d.confidence, out.confidence, atol=1e-5, rtol=0)
    tokens, conf, _ = oracle(mw, out.base_logits, out.hidden, anchors, temps, seeds)
    assert torch.equal(out.tokens, tokens)
    torch.testing.assert_close(out.confidence, conf, atol=1e-5, rtol=0)
    # The Markov ablation turns every head off alike.
    plain = model.draft(aux, torch.full((n,), ctx), anchors, embed, lm, use_markov=False)
    assert torch.equal(plain.tokens, plain.base_logits.argmax(-1))


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("kw,match", [
    (dict(gate_weight=torch.zeros(RANK + 1, H + RANK), gate_bias=torch.zeros(RANK)), r"markov_head\.gate_proj\.weight"),
    (dict(gate_weight=torch.zeros(RANK, H + RANK - 2), gate_bias=torch.zeros(RANK)), r"markov_head\.gate_proj\.weight"),
    (dict(gate_weight=torch.zeros(RANK, H + RANK), gate_bias=torch.zeros(RANK, 1)), r"markov_head\.gate_proj\.bias"),
    (dict(gate_weight=torch.zeros(RANK, H + RANK)), r"markov_head\.gate_proj\.bias: missing"),
    (dict(joint_weight=torch.zeros(2 * RANK, 2 * RANK + H), joint_bias=torch.zeros(3 * RANK)),
     r"markov_head\.joint_proj\.weight"),
    (dict(joint_weight=torch.zeros(3 * RANK, RANK + H), joint_bias=torch.zeros(3 * RANK)),
     r"markov_head\.joint_proj\.weight"),
    (dict(joint_weight=torch.zeros(3 * RANK, 2 * RANK + H), joint_bias=torch.zeros(RANK)),
     r"markov_head\.joint_proj\.bias"),
    (dict(markov_head_type="rnn"), r"markov_head\.joint_proj\.weight: missing"),
    (dict(markov_head_type="gated", joint_weight=torch.zeros(3 * RANK, 2 * RANK + H), joint_bias=torch.zeros(3 * RANK)),
     r"markov_head\.joint_proj was given but markov_head_type is 'gated'"),
], ids=["gate-rows", "gate-cols", "gate-bias", "gate-no-bias", "joint-rows", "joint-cols", "joint-bias",
        "rnn-missing", "wrong-head"])
def test_a_wrong_projection_is_refused_by_name(kw, match):
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=match):
        MarkovWeights.build(vocab=V, markov_w1=torch.randn(V, RANK, generator=g),
                            markov_w2=torch.randn(V, RANK, generator=g), hidden_size=H, **kw)


def test_the_op_path_refuses_a_head_it_does_not_take():
    w, anchors = _weights("gated")
    stage, _ = _stage(w)
    # Without the block's hidden rows a gated head is refused, never drafted as a vanilla one.
    with pytest.raises(ValueError, match="reads the backbone's hidden row"):
        stage.draft_into(torch.zeros(1, N, V), anchors[:1], None, torch.zeros(1), torch.zeros(1, dtype=torch.int64),
                         torch.empty(1, N, dtype=torch.int64), torch.empty(1, N), None)
    with pytest.raises(ValueError, match="reads the backbone's hidden row"):
        stage.greedy(torch.zeros(1, N, V), anchors[:1], None)


def test_head_classes_and_vanilla_default():
    w, _ = _weights("vanilla")
    assert w.head_type == "vanilla" and type(MarkovStage(w, lambda h: h).head) is VanillaHead
    assert isinstance(_stage(_weights("gated")[0])[0].head, GatedHead)
    assert isinstance(_stage(_weights("rnn")[0])[0].head, RnnHead)
    moved = _weights("rnn")[0].to("cpu")
    assert moved.joint_weight is not None and moved.head_type == "rnn"
