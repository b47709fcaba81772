"""Features and the trainer on a tiny Llama target: capture, blocks, the loss, resume-after-kill (no vLLM)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from training.pipeline.drafter import build_drafter_config, init_drafter
from training.pipeline.features import FeatureSet, capture
from training.pipeline.trainer import (
    TrainArgs,
    block_loss,
    eligible_anchors,
    eval_anchors,
    evaluate,
    make_blocks,
    sample_anchors,
    train,
)

VOCAB, N = 97, 6
LENGTHS = [48, 40, 56, 33, 48, 44]  # ragged, as real conversations are


def _rows():
    g = np.random.RandomState(0)
    return [{"ids": g.randint(3, VOCAB, n).tolist(), "gen_spans": [[10, n - 3], [n - 2, n]]} for n in LENGTHS]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("target")
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def features(target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("feat")
    fs = capture(target_dir, _rows(), root / "f", [0, 2], top_k=8, dtype=torch.float32, log=lambda *_: None)
    return fs, root


@pytest.fixture(scope="module")
def embed(target_dir):
    from safetensors import safe_open

    with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.embed_tokens.weight").float()


def _config(target_dir, rank=8):
    from transformers import AutoConfig

    return build_drafter_config(AutoConfig.from_pretrained(str(target_dir)), mask_token_id=1,
                                target_layer_ids=(0, 2), num_hidden_layers=1, markov_rank=rank,
                                block_size=4).replace(max_position_embeddings=64)


def test_capture_matches_a_teacher_forced_forward(features, target_dir):
    from transformers import AutoModelForCausalLM

    fs, _ = features
    assert len(fs) == N and fs.layer_ids == (0, 2) and [fs.length(i) for i in range(N)] == LENGTHS
    row = fs.get(3)
    ids = torch.tensor(_rows()[3]["ids"])
    assert torch.equal(row["ids"], ids)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=ids[None], output_hidden_states=True)
    want = torch.cat([out.hidden_states[1], out.hidden_states[3]], dim=-1)[0]
    torch.testing.assert_close(row["aux"].float(), want.to(torch.bfloat16).float())
    p, top = out.logits[0].softmax(-1).topk(8)
    gen = row["gen"]
    lab = torch.cat([gen[1:], torch.tensor([False])])  # positions whose next token the target wrote
    assert torch.equal(row["topk_ids"][lab], top[lab])  # [:, 0] is the target's argmax: the label
    torch.testing.assert_close(row["topk_p"][lab], p[lab], atol=1e-3, rtol=1e-3)
    assert not bool(row["topk_p"][~lab].any())
    assert bool(gen[10:30].all()) and not bool(gen[:10].any()) and not bool(gen[30])


def test_capture_resumes_and_refuses_other_data(features, target_dir):
    fs, root = features
    done = json.loads((root / "f" / "done.json").read_text())
    assert done["done"] == N and done["meta"]["tokens"] == sum(LENGTHS)
    again = capture(target_dir, _rows(), root / "f", [0, 2], top_k=8, dtype=torch.float32, log=lambda *_: None)
    assert len(again) == N
    with pytest.raises(RuntimeError, match="holds a capture of other data"):
        capture(target_dir, _rows(), root / "f", [0, 1], top_k=8, dtype=torch.float32, log=lambda *_: None)


def test_blocks_anchor_on_target_tokens_and_label_the_argmax(features, target_dir):
    fs, _ = features
    cfg = _config(target_dir)
    k = cfg.block_size
    gen = fs.get(0)["gen"]
    p = eligible_anchors(gen, k)
    assert int(p.min()) == 9 and bool(gen[p + 1].all())
    anchors = [sample_anchors(fs, c, 5, k, torch.Generator().manual_seed(c)) for c in (0, 3)]
    b = make_blocks(cfg, fs, [0, 3], anchors)
    assert b.query_ids.shape == (2, 5 * k) and bool((b.query_ids.view(2, 5, k)[:, :, 1:] == 1).all())
    for r, c in enumerate((0, 3)):
        row = fs.get(c)
        q = b.query_positions[r]
        assert torch.equal(b.labels[r], row["topk_ids"][q, 0])  # the target's argmax, not the text
        assert torch.equal(b.prev_ids[r], row["ids"][q])
        assert torch.equal(b.valid[r], row["gen"][q + 1])
    # Each block sees exactly its own context prefix and its own queries.
    length = b.aux.shape[1]
    ctx, qq = b.mask[:, :, :length], b.mask[:, :, length:]
    anc = b.query_positions[:, ::k].repeat_interleave(k, 1)
    assert torch.equal(ctx.sum(-1), anc)
    assert bool((qq.sum(-1) == k).all())
    w = make_blocks(cfg, fs, [0, 3], anchors, window=3).mask[:, :, :length]
    assert bool((w.sum(-1) == anc.clamp(max=3)).all())


def _model_and_blocks(features, target_dir, convs=(1, 2), k: int = 4):
    """A fresh drafter and ``k`` seeded anchors' blocks of each of ``convs``."""
    fs, _ = features
    cfg = _config(target_dir)
    anchors = [sample_anchors(fs, c, k, cfg.block_size, torch.Generator().manual_seed(c)) for c in convs]
    return init_drafter(cfg, seed=0), make_blocks(cfg, fs, list(convs), anchors)


def test_candidate_loss_equals_the_full_vocabulary_loss_when_the_candidates_cover_it(features, target_dir, embed):
    model, b = _model_and_blocks(features, target_dir)
    torch.nn.init.normal_(model.markov_head.markov_w2.weight, std=0.05)
    # top_k 8 of a 97-token vocabulary: with cand_k = 8 the candidates are the union, a strict subset.
    args = TrainArgs(cand_k=8)
    full, mf = block_loss(model, b, embed, embed, args, None, full_vocab=True)
    part, mp = block_loss(model, b, embed, embed, args, None, full_vocab=False)
    assert mp["candidates"] < VOCAB and mf["candidates"] == VOCAB
    assert torch.isfinite(full) and torch.isfinite(part) and float(part) != float(full)
    # Candidates that cover the vocabulary give exactly the full-vocabulary loss.
    wide = TrainArgs(cand_k=8)
    b.topk_ids[..., :] = torch.arange(8)
    b.labels[:] = 0
    b.topk_p[:] = 1 / 8
    f2, _ = block_loss(model, b, embed, embed, wide, None, full_vocab=True)
    b.topk_ids = torch.arange(VOCAB).expand(*b.labels.shape, -1).clone()
    b.topk_p = torch.cat([torch.full((*b.labels.shape, 8), 1 / 8), torch.zeros(*b.labels.shape, VOCAB - 8)], -1)
    f3, _ = block_loss(model, b, embed, embed, TrainArgs(cand_k=VOCAB), None, full_vocab=False)
    torch.testing.assert_close(f2, f3, atol=2e-3, rtol=2e-3)


def _eval_sets(fs, cfg):
    return {"heldout": (fs, eval_anchors(fs, cfg.block_size, 30, seed=1))}


def test_training_resumes_after_a_kill_with_the_same_result(features, target_dir, embed, tmp_path):
    fs, _ = features
    cfg = _config(target_dir)
    args = TrainArgs(steps=6, seqs_per_step=2, anchors_per_seq=4, ckpt_every_s=0.0, eval_every=3, log_every=1,
                     full_vocab_every=2)
    sets = _eval_sets(fs, cfg)
    assert sum(len(a) for a in sets["heldout"][1].values()) >= 30

    straight = init_drafter(cfg, seed=0)
    rec = train(straight, embed, embed, fs, sets, args, tmp_path / "a", log=lambda *_: None)
    assert len(rec["curve"]) == 6 and "eval" in rec["curve"][-1] and rec["finished"]
    assert rec["blocks"] == 6 * 2 * 4

    import training.pipeline.trainer as T

    class Killed(Exception):
        pass

    real_save = T._save_atomic

    def save_then_die(obj, path):
        real_save(obj, path)
        if obj["step"] == 4:
            raise Killed

    T._save_atomic = save_then_die
    try:
        with pytest.raises(Killed):
            train(init_drafter(cfg, seed=0), embed, embed, fs, sets, args, tmp_path / "b", log=lambda *_: None)
    finally:
        T._save_atomic = real_save
    resumed = init_drafter(cfg, seed=0)  # a new process: fresh weights, the checkpoint restores them
    rec2 = train(resumed, embed, embed, fs, sets, args, tmp_path / "b", log=lambda *_: None)
    assert rec2["curve"][-1]["step"] == 6
    for (n, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_eval_counts_accepted_prefixes(features, target_dir, embed):
    fs, _ = features
    cfg = _config(target_dir)
    model = init_drafter(cfg, seed=0)
    anc = eval_anchors(fs, cfg.block_size, 20, seed=0)
    r = evaluate(model, fs, anc, embed, embed, None)
    assert r["blocks"] >= 20 and 1.0 <= r["tf_accept_len"] <= 1 + cfg.block_size
    acc = r["acc_per_pos"]
    assert all(0 <= a <= 1 for a in acc)
    none = evaluate(model, fs, anc, embed, embed, None, window=0)
    assert none["blocks"] == r["blocks"]


def test_ablation_without_markov_head_trains(features, target_dir, embed, tmp_path):
    fs, _ = features
    cfg = _config(target_dir, rank=0)
    model = init_drafter(cfg, seed=0)
    assert model.markov_head is None and model.confidence_head is not None
    rec = train(model, embed, embed, fs, _eval_sets(fs, cfg), TrainArgs(steps=2, seqs_per_step=2, anchors_per_seq=3,
                                                                        eval_every=2, log_every=1),
                tmp_path / "c", log=lambda *_: None)
    assert np.isfinite(rec["curve"][-1]["loss"])
    with pytest.raises(FileNotFoundError):
        FeatureSet(tmp_path / "nothing")


def test_packed_blocks_match_single_block_drafting(features, target_dir, embed):
    """Training packs many blocks per conversation into one pass; each must equal drafting that block alone."""
    fs, _ = features
    cfg = _config(target_dir)
    model = init_drafter(cfg, seed=0).eval()
    anchors = sample_anchors(fs, 2, 4, cfg.block_size, torch.Generator().manual_seed(0))
    blk = make_blocks(cfg, fs, [2], [anchors])
    row = fs.get(2)
    with torch.no_grad():
        packed = model.backbone(blk.aux.float(), blk.ctx_positions, embed[blk.query_ids], blk.query_positions,
                                blk.mask)
        b = cfg.block_size
        for k, p in enumerate(anchors.tolist()):
            alone = model.draft(row["aux"][None, :p].float(), torch.tensor([p]), row["ids"][p:p + 1], embed, embed)
            torch.testing.assert_close(alone.hidden.float(), packed[:, k * b:(k + 1) * b].float(),
                                       atol=1e-5, rtol=1e-5)


def test_a_few_steps_lower_the_loss_on_a_fixed_batch(features, target_dir, embed):
    fs, _ = features
    cfg = _config(target_dir)
    model = init_drafter(cfg, seed=0)
    anchors = [sample_anchors(fs, c, 6, cfg.block_size, torch.Generator().manual_seed(c)) for c in (0, 1)]
    blk = make_blocks(cfg, fs, [0, 1], anchors)
    args = TrainArgs()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first, _ = block_loss(model, blk, embed, embed, args, None, True)
    for _ in range(40):
        loss, _ = block_loss(model, blk, embed, embed, args, None, True)
        opt.zero_grad()
        loss.backward()
        opt.step()
    last, metrics = block_loss(model, blk, embed, embed, args, None, True)
    assert last.item() < 0.8 * first.item(), (first.item(), last.item())
    assert {"loss", "tv"} <= set(metrics)


def test_a_draft_vocabulary_loss_scores_its_tokens_only_and_drops_labels_outside_it(features, target_dir, embed):
    model, b = _model_and_blocks(features, target_dir)
    args = TrainArgs(cand_k=8)
    # The whole vocabulary as the "draft vocabulary" is the full-vocabulary loss.
    full, _ = block_loss(model, b, embed, embed, args, None, full_vocab=True)
    every, m = block_loss(model, b, embed, embed, args, None, full_vocab=False, draft_ids=torch.arange(VOCAB))
    assert m["candidates"] == VOCAB
    torch.testing.assert_close(full, every)
    # A vocabulary that leaves every label out has no CE term: its CE is zero, not the log of nothing.
    labels = set(b.labels[b.valid].tolist())
    outside = torch.tensor([t for t in range(VOCAB) if t not in labels])
    loss, m = block_loss(model, b, embed, embed, args, None, full_vocab=False, draft_ids=outside)
    assert m["candidates"] == len(outside) and m["ce"] == 0.0 and torch.isfinite(loss)


def test_training_on_a_subset_draws_only_its_conversations(features, target_dir, embed, tmp_path, monkeypatch):
    import training.pipeline.trainer as T

    fs, _ = features
    cfg = _config(target_dir)
    seen: list[int] = []
    real = T.make_blocks

    def spy(c, d, convs, *a, **k):
        seen.extend(convs)
        return real(c, d, convs, *a, **k)

    monkeypatch.setattr(T, "make_blocks", spy)
    args = TrainArgs(steps=4, seqs_per_step=2, anchors_per_seq=3, eval_every=100, log_every=1)
    train(init_drafter(cfg, seed=0), embed, embed, fs, {}, args, tmp_path / "s", log=lambda *_: None,
          conversations=[1, 4])
    assert len(seen) == 8 and set(seen) == {1, 4}
    with pytest.raises(ValueError, match="no conversations"):
        train(init_drafter(cfg, seed=0), embed, embed, fs, {}, args, tmp_path / "e", log=lambda *_: None,
              conversations=[])
