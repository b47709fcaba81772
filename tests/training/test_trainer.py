"""The self-distillation trainer on a tiny Llama target: features, the loss, resume-after-kill (no vLLM)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vllm_dspark.training.drafter import build_drafter_config, init_drafter
from vllm_dspark.training.selfdistill import FeatureSet, capture_features
from vllm_dspark.training.trainer import TrainArgs, eligible_anchors, make_blocks, train

VOCAB, L, N = 97, 48, 6


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
    g = np.random.RandomState(0)
    ids = g.randint(3, VOCAB, (N, L)).astype(np.int32)
    gen = np.zeros((N, L), dtype=np.uint8)
    gen[:, 10:] = 1  # the "assistant" part
    np.savez(root / "conv.npz", ids=ids, gen_mask=gen, temperature=np.zeros(N), kind=np.array(["chat"] * N))
    fs = capture_features(target_dir, root / "conv.npz", root / "f", [0, 2], batch_size=4, log=lambda *_: None)
    return fs, root


def _config(target_dir, rank=8):
    from transformers import AutoConfig

    return build_drafter_config(AutoConfig.from_pretrained(str(target_dir)), mask_token_id=1,
                                target_layer_ids=(0, 2), num_hidden_layers=1, markov_rank=rank,
                                block_size=4).replace(max_position_embeddings=L)


def test_capture_matches_a_teacher_forced_forward(features, target_dir):
    from transformers import AutoModelForCausalLM

    fs, _ = features
    assert len(fs) == N and fs.layer_ids == (0, 2)
    ids, gen, aux, final = fs.get([4, 1])
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.model(input_ids=ids, output_hidden_states=True)
    want = torch.cat([out.hidden_states[1], out.hidden_states[3]], dim=-1)
    torch.testing.assert_close(aux, want.to(torch.bfloat16).float())
    torch.testing.assert_close(final, out.last_hidden_state)
    assert bool(gen[:, 10:].all()) and not bool(gen[:, :10].any())


def test_capture_resumes_and_refuses_other_data(features, target_dir):
    fs, root = features
    done = json.loads((root / "f" / "done.json").read_text())
    assert done == {"done": N, "total": N, "target_layer_ids": [0, 2]}
    again = capture_features(target_dir, root / "conv.npz", root / "f", [0, 2], log=lambda *_: None)
    assert len(again) == N  # nothing recomputed: done.json says so
    with pytest.raises(RuntimeError, match="holds a capture of other data"):
        capture_features(target_dir, root / "conv.npz", root / "f", [0, 1], log=lambda *_: None)


def test_blocks_anchor_only_on_generated_tokens(features, target_dir):
    fs, _ = features
    cfg = _config(target_dir)
    _, gen, _, _ = fs.get([0])
    p = eligible_anchors(gen[0], cfg.block_size)
    assert int(p.min()) == 9 and bool(gen[0][p + 1].all())
    b = make_blocks(cfg, fs, [0, 1], 5, torch.Generator().manual_seed(0), window_share=1.0, min_window=4)
    k = cfg.block_size
    assert b.query_ids.shape == (2, 5 * k) and bool((b.query_ids.view(2, 5, k)[:, :, 1:] == 1).all())
    # Query i predicts ids[p+i+1]; the Markov head is teacher-forced with ids[p+i].
    ids = fs.get([0, 1])[0]
    torch.testing.assert_close(b.labels, torch.gather(ids, 1, b.query_positions + 1))
    torch.testing.assert_close(b.prev_ids, torch.gather(ids, 1, b.query_positions))
    # Window augmentation: every block sees a recent window, never position 0 when its anchor is far.
    ctx = b.mask[:, :, :L]
    anchors = b.query_positions[:, ::k]
    assert bool((ctx.sum(-1) <= b.query_positions).all())
    far = anchors > 20
    assert bool((~ctx[:, ::k, 0][far]).all())


def test_training_resumes_after_a_kill_with_the_same_result(features, target_dir, tmp_path):
    from safetensors import safe_open

    fs, _ = features
    with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
    cfg = _config(target_dir)
    args = TrainArgs(steps=6, batch_size=2, anchors_per_seq=4, ckpt_every=2, eval_every=3, log_every=1,
                     warmup_steps=1)

    straight = init_drafter(cfg, seed=0)
    rec = train(straight, embed, embed, fs, fs, args, tmp_path / "a", log=lambda *_: None)
    assert len(rec["curve"]) == 6 and "eval" in rec["curve"][-1]

    killed = init_drafter(cfg, seed=0)
    short = TrainArgs(**{**args.__dict__, "steps": 6})
    # Simulate a kill after step 4: run to 4 with the 6-step schedule, then a fresh process resumes.
    orig_steps = short.steps
    import vllm_dspark.training.trainer as T

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
            train(killed, embed, embed, fs, fs, short, tmp_path / "b", log=lambda *_: None)
    finally:
        T._save_atomic = real_save
    resumed = init_drafter(cfg, seed=0)  # a new process: fresh weights, the checkpoint restores them
    rec2 = train(resumed, embed, embed, fs, fs, short, tmp_path / "b", log=lambda *_: None)
    assert orig_steps == 6 and rec2["curve"][-1]["step"] == 6
    for (n, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_ablation_without_markov_head_trains(features, target_dir, tmp_path):
    from safetensors import safe_open

    fs, _ = features
    with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
    cfg = _config(target_dir, rank=0)
    model = init_drafter(cfg, seed=0)
    assert model.markov_head is None and model.confidence_head is not None
    rec = train(model, embed, embed, fs, fs, TrainArgs(steps=2, batch_size=2, anchors_per_seq=3, eval_every=2,
                                                       log_every=1, warmup_steps=1), tmp_path / "c",
                log=lambda *_: None)
    assert np.isfinite(rec["curve"][-1]["loss"])
    assert FeatureSet  # the public reader of captured features
