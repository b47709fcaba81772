"""Fast checks of the training pipeline (the training itself does not run in CI)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from training.pipeline.capture import greedy_generate, target_pass
from training.pipeline.drafter import build_drafter_config, init_drafter
from training.pipeline.evaluate import simulate_acceptance
from training.pipeline.export import export_drafter
from vllm_dspark.checkpoint import load_reference_model, validate_checkpoint

ASSETS = Path(__file__).resolve().parents[1] / "fixtures" / "toy_pair"
VOCAB = 111  # odd on purpose
MASK = 2


def tiny_target(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def drafter_config(target):
    return build_drafter_config(target.config, mask_token_id=MASK, target_layer_ids=(0, 2),
                                markov_rank=8)


def test_target_step_reduces_loss():
    from training.pipeline.target import TargetTrainArgs, train_target

    model = tiny_target(seed=1)
    for p in model.parameters():
        p.requires_grad_(True)
    model.train()
    stream = np.tile(np.arange(3, 40, dtype=np.int32), 40)
    args = TargetTrainArgs(steps=12, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2,
                           eval_every=12, eval_batches=1, log_every=1)
    curve = train_target(model, stream, stream, args, log=lambda *_: None)
    assert curve[-1]["loss"] < 0.7 * curve[0]["loss"]


def test_export_round_trip_and_outputs(tmp_path, target, drafter_config):
    """The exported BF16 drafter loads back and drafts what the in-memory model drafts."""
    cfg = drafter_config
    model = init_drafter(cfg, seed=3)
    torch.nn.init.normal_(model.markov_head.markov_w2.weight, std=0.05)
    with torch.no_grad():  # the values a BF16 export can hold (buffers such as RoPE stay fp32)
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.eval()
    path = export_drafter(model, tmp_path / "drafter", bos_token_id=0, eos_token_id=0, pad_token_id=1)
    d = json.loads((path / "config.json").read_text())
    assert d["architectures"] == ["DSparkDraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"]["mask_token_id"] == MASK
    assert d["dflash_config"]["markov_head_type"] == "vanilla"
    assert d["num_target_layers"] == 4 and d["block_size"] == 7
    report = validate_checkpoint(path)
    assert report.ok, report.problems
    assert {e.dtype for e in report.tensors.values()} == {"bfloat16"}
    assert not any(n in report.tensors for n in ("embed_tokens.weight", "lm_head.weight"))
    loaded = load_reference_model(path).eval()
    for name, p in model.state_dict().items():
        assert torch.equal(p, loaded.state_dict()[name]), name
    ids = torch.randint(3, VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))
    aux = target_pass(target, ids, cfg.target_layer_ids).aux
    embed = target.get_input_embeddings().weight
    lm_head = target.get_output_embeddings().weight
    ctx = torch.tensor([17, 29])
    a = model.draft(aux, ctx, ids[torch.arange(2), ctx], embed, lm_head)
    b = loaded.draft(aux, ctx, ids[torch.arange(2), ctx], embed, lm_head)
    assert torch.equal(a.tokens, b.tokens)
    # Same weights; fp32 BLAS may sum in another order for differently laid-out buffers.
    torch.testing.assert_close(a.confidence, b.confidence, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.base_logits, b.base_logits, atol=1e-5, rtol=1e-5)


def test_simulated_acceptance_is_exact_with_an_oracle(target, drafter_config):
    """The offline simulator counts accepted prefixes correctly (a perfect drafter gets 8)."""
    cfg = drafter_config
    chains = [greedy_generate(target, torch.tensor([[5, 6, 7, 8]]), 30)[0]]
    model = init_drafter(cfg, seed=0).eval()

    class Oracle:
        config = cfg

        def draft(self, aux, ctx, anchors, embed, lm_head, **kw):
            out = model.draft(aux, ctx, anchors, embed, lm_head, **kw)
            out.tokens = torch.stack([chains[0][p + 1:p + 1 + cfg.block_size] for p in ctx.tolist()])
            return out

    res = simulate_acceptance(target, Oracle(), chains, [4])
    assert res.mean_acceptance_length == 8.0
    assert res.per_position == [1.0] * cfg.block_size
    res = simulate_acceptance(target, model, chains, [4])
    assert 1.0 <= res.mean_acceptance_length <= 8.0


@pytest.mark.skipif(not (ASSETS / "drafter" / "config.json").exists(), reason="no bundled drafter")
def test_bundled_pair_is_consistent():
    """The shipped drafter validates and fits the shipped target and tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    report = validate_checkpoint(ASSETS / "drafter")
    assert report.ok, report.problems
    cfg = report.config
    tcfg = AutoConfig.from_pretrained(str(ASSETS / "target"))
    tok = AutoTokenizer.from_pretrained(str(ASSETS / "target"))
    assert cfg.hidden_size == tcfg.hidden_size and cfg.vocab_size == tcfg.vocab_size
    assert cfg.num_target_layers == tcfg.num_hidden_layers
    assert max(cfg.target_layer_ids) < tcfg.num_hidden_layers - 1
    assert tok.convert_ids_to_tokens(cfg.mask_token_id) == "<|mask|>"
    assert tcfg.head_dim in (32, 64, 80, 96, 112, 128)
    total = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert total <= 50 * 10**6


def test_greedy_continuations_become_features_the_trainer_reads(tmp_path, target, drafter_config):
    """The toy pipeline's path (training/train_tiny.py): greedy text -> captured features -> the one trainer."""
    from training.pipeline.capture import generate_distill_set
    from training.pipeline.features import capture
    from training.pipeline.trainer import TrainArgs, eval_anchors, train

    cfg = drafter_config
    stream = np.random.RandomState(0).randint(3, VOCAB, 500).astype(np.int32)
    ids, plens = generate_distill_set(target, stream, num_seqs=6, batch_size=4, seq_len=32,
                                      min_prompt=4, max_prompt=8, seed=0, log=lambda *_: None)
    assert ids.shape == (6, 32) and plens.min() >= 4
    # Greedy text: past the prompt each token is the target's argmax of the previous position.
    p = int(plens[0])
    tf = target(input_ids=torch.from_numpy(ids[:1]).long()).logits.argmax(-1)[0]
    assert (tf[p - 1:-1] == torch.from_numpy(ids[0, p:]).long()).float().mean() > 0.9
    target.save_pretrained(str(tmp_path / "target"))
    rows = [{"ids": [int(t) for t in seq], "gen_spans": [[int(q), len(seq)]]} for seq, q in zip(ids, plens)]
    fs = capture(tmp_path / "target", rows, tmp_path / "f", cfg.target_layer_ids, top_k=8, dtype=torch.float32,
                 log=lambda *_: None)
    assert len(fs) == 6 and bool(fs.get(0)["gen"][p:].all()) and not bool(fs.get(0)["gen"][:p].any())
    embed = target.get_input_embeddings().weight.detach()
    model = init_drafter(cfg, seed=0)
    rec = train(model, embed, target.get_output_embeddings().weight.detach(), fs,
                {"heldout": (fs, eval_anchors(fs, cfg.block_size, 12, seed=1))},
                TrainArgs(steps=3, seqs_per_step=2, anchors_per_seq=3, log_every=1, eval_every=3),
                tmp_path / "run", log=lambda *_: None)
    assert rec["finished"] and len(rec["curve"]) == 3 and "eval" in rec["curve"][-1]


@pytest.mark.skipif(not (ASSETS / "drafter" / "config.json").exists(), reason="no bundled drafter")
def test_bundled_pair_drafts_well():
    """The shipped drafter beats its Markov-off ablation on held-out prompts (offline, greedy)."""
    from training.pipeline.capture import load_target
    from training.pipeline.corpus import read_jsonl
    from training.pipeline.evaluate import greedy_chains
    from training.pipeline.tokenizer import load_tokenizer

    tok = load_tokenizer(ASSETS / "target")
    target = load_target(ASSETS / "target")
    drafter = load_reference_model(ASSETS / "drafter").eval()
    prompts = [r["prompt"] for r in read_jsonl(ASSETS / "prompts_heldout.jsonl")[:4]]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    chains = greedy_chains(target, ids, 48)
    lens = [len(i) for i in ids]
    with_markov = simulate_acceptance(target, drafter, chains, lens)
    without = simulate_acceptance(target, drafter, chains, lens, use_markov=False)
    # 3.33 here with 4 prompts x 48 tokens; margin for other BLAS / thread counts.
    assert with_markov.mean_acceptance_length >= 2.5, with_markov
    assert with_markov.mean_acceptance_length > without.mean_acceptance_length + 1.0, (with_markov, without)
