"""Tensors of every family: canonical names, expected shapes from the config, and bad input refused by name.

Tiny checkpoints in each layout (SpecForge, DeepSpec, speculators; vanilla, gated and rnn heads; a draft
vocabulary with its d2t / t2d maps), each corruption named with the fix, every problem listed at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import tiny_config
from vllm_dspark.checkpoint.io import (
    CheckpointError,
    canonical_name,
    load_checkpoint,
    save_checkpoint,
    validate_checkpoint,
)
from vllm_dspark.checkpoint.shapes import drafter_tensors, required_shapes
from vllm_dspark.checkpoint.vocab_map import d2t_problems, t2d_problems
from vllm_dspark.config import DSparkConfig

WEIGHTS = "model.safetensors"
V, VD = 80, 40  # tiny_config's vocabulary; a draft vocabulary of the even target ids


def even_d2t() -> torch.Tensor:
    """[VD] offsets: draft id i -> target id 2i."""
    return torch.arange(VD, dtype=torch.int64)


def even_t2d() -> torch.Tensor:
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[::2] = True
    return t2d


def state_for(cfg: DSparkConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random values for every tensor the checkpoint must hold (and a consistent t2d for a draft vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    out = {name: torch.randn(shape, generator=g) * 0.02 for name, shape in required_shapes(cfg).items()}
    if cfg.draft_vocab_size is not None:
        out["d2t"], out["t2d"] = even_d2t(), even_t2d()
    return out


def save(path: Path, cfg: DSparkConfig, **changes) -> Path:
    return save_checkpoint(path, cfg, state_for(cfg), **changes)


def write_raw(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / WEIGHTS), metadata={"format": "pt"})
    return path


def edit(ckpt: Path, fn) -> Path:
    state = load_file(str(ckpt / WEIGHTS))
    fn(state)
    save_file(state, str(ckpt / WEIGHTS), metadata={"format": "pt"})
    return ckpt


def problems_of(path: Path, *needles: str) -> list[str]:
    """The problems, one of which holds every needle; load_checkpoint refuses with the same list."""
    problems = validate_checkpoint(path).problems
    assert any(all(n in p for n in needles) for p in problems), problems
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert info.value.problems == problems
    return problems


@pytest.fixture
def draft_vocab_ckpt(tmp_path) -> Path:
    return save(tmp_path / "dv", tiny_config(draft_vocab_size=VD))


# ---------------------------------------------------------------- names
def test_specforge_logit_head_markov_head_names_are_canonical():
    assert canonical_name("logit_head.markov_head.markov_w1.weight") == "markov_head.markov_w1.weight"
    assert canonical_name("logit_head.markov_head.gate_proj.bias") == "markov_head.gate_proj.bias"
    assert canonical_name("logit_head.confidence_head.proj.weight") == "confidence_head.proj.weight"
    assert canonical_name("model.d2t") == "d2t"


def test_early_specforge_export_with_logit_head_modules_loads(tmp_path):
    cfg = tiny_config()
    new = save(tmp_path / "new", cfg)
    old = save(tmp_path / "old", cfg)

    def rename(s):
        for k in [k for k in s if k.startswith(("markov_head.", "confidence_head."))]:
            s["logit_head." + k] = s.pop(k)

    edit(old, rename)
    assert validate_checkpoint(old).ok, validate_checkpoint(old).problems
    s_old, s_new = load_checkpoint(old)[1], load_checkpoint(new)[1]
    assert set(s_old) == set(s_new) and all(torch.equal(s_old[k], s_new[k]) for k in s_new)


# ---------------------------------------------------------------- a draft vocabulary
def test_draft_vocabulary_checkpoint_loads_with_its_own_head_and_maps(draft_vocab_ckpt):
    report = validate_checkpoint(draft_vocab_ckpt)
    assert report.ok, report.problems
    cfg, state = load_checkpoint(draft_vocab_ckpt)
    assert cfg.draft_vocab_size == VD
    assert state["lm_head.weight"].shape == (VD, 64)  # the drafter's own, kept
    assert state["markov_head.markov_w2.weight"].shape == (VD, 8)
    assert state["markov_head.markov_w1.weight"].shape == (V, 8)  # the previous token is a target id
    assert state["d2t"].dtype == torch.int64 and torch.equal(state["d2t"], even_d2t())
    assert state["t2d"].dtype == torch.bool


def test_d2t_outside_the_target_vocabulary_is_refused(draft_vocab_ckpt):
    edit(draft_vocab_ckpt, lambda s: s["d2t"].__setitem__(5, 200))
    problems_of(draft_vocab_ckpt, "d2t:", "outside the target vocabulary (0..79)", "draft id 5 -> 205",
                "re-export d2t")


def test_d2t_of_absolute_ids_is_named_as_such(draft_vocab_ckpt):
    edit(draft_vocab_ckpt, lambda s: s.__setitem__("d2t", 2 * even_d2t()))  # target ids, not offsets
    problems_of(draft_vocab_ckpt, "d2t:", "looks like absolute target ids", "OFFSETS")


def test_d2t_mapping_two_draft_ids_to_one_target_id_is_refused(draft_vocab_ckpt):
    edit(draft_vocab_ckpt, lambda s: s["d2t"].__setitem__(1, -1))  # draft 1 -> target 0, as draft 0
    problems = problems_of(draft_vocab_ckpt, "d2t:", "more than one draft id", "target id 0", "[0, 1]")
    assert any(p.startswith("t2d: disagrees") for p in problems)  # t2d still marks target 2


def test_t2d_disagreeing_with_d2t_is_refused(draft_vocab_ckpt):
    edit(draft_vocab_ckpt, lambda s: s["t2d"].__setitem__(1, True))
    problems = problems_of(draft_vocab_ckpt, "t2d: disagrees with d2t", "first: 1", "drop it")
    assert len(problems) == 1


def test_draft_vocabulary_without_its_lm_head_is_refused(draft_vocab_ckpt):
    edit(draft_vocab_ckpt, lambda s: s.pop("lm_head.weight"))
    problems_of(draft_vocab_ckpt, "lm_head.weight: missing", "draft_vocab_size 40", "[80, 64] head cannot stand in")


def test_draft_vocabulary_without_d2t_is_refused(draft_vocab_ckpt):
    edit(draft_vocab_ckpt, lambda s: s.pop("d2t"))
    problems_of(draft_vocab_ckpt, "d2t: missing", "target id = draft id + d2t[draft id]")


def test_d2t_of_floats_is_refused(draft_vocab_ckpt):
    edit(draft_vocab_ckpt, lambda s: s.__setitem__("d2t", s["d2t"].float()))
    problems_of(draft_vocab_ckpt, "d2t: dtype float32, expected int64")


def test_maps_without_a_draft_vocabulary_in_the_config_are_named(tmp_path):
    ckpt = save(tmp_path / "c", tiny_config())
    edit(ckpt, lambda s: s.__setitem__("d2t", even_d2t()))
    problems_of(ckpt, "d2t: present", "set draft_vocab_size")


def test_vocab_map_checks_directly():
    assert d2t_problems(even_d2t(), V) == []
    assert t2d_problems(even_t2d(), even_d2t(), V) == []
    shifted = even_d2t() + 1  # every draft id one target id off: valid ids, wrong tokens (t2d catches it)
    assert d2t_problems(shifted, V) == []
    assert t2d_problems(even_t2d(), shifted, V)


# ---------------------------------------------------------------- gated and rnn heads
@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_gated_and_rnn_checkpoints_validate(tmp_path, head):
    cfg = tiny_config(markov_head_type=head)
    ckpt = save(tmp_path / head, cfg)
    assert validate_checkpoint(ckpt).ok, validate_checkpoint(ckpt).problems
    assert DSparkConfig.from_json(ckpt) == cfg


def test_gated_head_without_gate_proj_is_refused(tmp_path):
    ckpt = save(tmp_path / "g", tiny_config(markov_head_type="gated"))
    edit(ckpt, lambda s: s.pop("markov_head.gate_proj.weight"))
    problems_of(ckpt, "markov_head.gate_proj.weight: missing", "[8, 72]", "markov_head_type is 'gated'")


def test_rnn_joint_proj_of_the_wrong_shape_is_refused(tmp_path):
    ckpt = save(tmp_path / "r", tiny_config(markov_head_type="rnn"))
    edit(ckpt, lambda s: s.__setitem__("markov_head.joint_proj.weight", torch.zeros(24, 72)))
    problems_of(ckpt, "markov_head.joint_proj.weight: shape [24, 72]", "implies [24, 80]", "Wj [3r, 2r + H]")


def test_gate_proj_in_a_vanilla_config_names_the_head_type(tmp_path):
    ckpt = save(tmp_path / "v", tiny_config())
    edit(ckpt, lambda s: s.__setitem__("markov_head.gate_proj.weight", torch.zeros(8, 72)))
    problems_of(ckpt, "present, but markov_head_type is 'vanilla'", "'gated'")


def test_every_problem_is_listed_at_once(tmp_path):
    ckpt = save(tmp_path / "all", tiny_config(markov_head_type="gated", draft_vocab_size=VD))

    def corrupt(s):
        s["d2t"][3] = 500  # draft 3 -> 503, outside
        s["t2d"][6] = False  # t2d agrees with the ids d2t still maps into the vocabulary
        s.pop("markov_head.gate_proj.bias")
        s.pop("lm_head.weight")

    edit(ckpt, corrupt)
    problems = validate_checkpoint(ckpt).problems
    assert len(problems) == 3, problems
    for start in ("d2t:", "markov_head.gate_proj.bias: missing", "lm_head.weight: missing"):
        assert any(p.startswith(start) for p in problems), (start, problems)


# ---------------------------------------------------------------- the other families' layouts
def _tiny_backbone() -> dict:
    return dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=96, vocab_size=V, max_position_embeddings=512)


def test_deepspec_layout_with_target_copies_loads_and_drops_them(tmp_path):
    config = {"architectures": ["Qwen3DSparkModel"], **_tiny_backbone(), "rope_theta": 10000.0, "block_size": 5,
              "target_layer_ids": [0, 2], "num_target_layers": 4, "mask_token_id": 79, "markov_rank": 8,
              "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
              "torch_dtype": "bfloat16"}
    cfg = DSparkConfig.from_dict(config)
    assert cfg.family == "deepspec" and cfg.replace(family="specforge", architecture="DSparkDraftModel") == \
        tiny_config()
    tensors = {f"model.{k}": v.to(torch.bfloat16) for k, v in state_for(cfg).items()}
    tensors["model.embed_tokens.weight"] = torch.zeros(V, 64, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = torch.zeros(V, 64, dtype=torch.bfloat16)
    ckpt = write_raw(tmp_path / "deepspec", config, tensors)
    assert validate_checkpoint(ckpt).ok, validate_checkpoint(ckpt).problems
    _, state = load_checkpoint(ckpt)
    assert "embed_tokens.weight" not in state and "lm_head.weight" not in state  # the target's are shared
    assert set(state) == set(required_shapes(cfg))


def _speculators_config(head: str = "rnn") -> dict:
    return {"speculators_model_type": "dspark", "architectures": ["DSparkDraftModel"],
            "transformer_layer_config": {**_tiny_backbone(), "rope_parameters": {"rope_theta": 10000.0,
                                                                                 "rope_type": "default"}},
            "aux_hidden_state_layer_ids": [1, 3], "block_size": 5, "sample_from_anchor": True, "draft_vocab_size": VD,
            "markov_rank": 8, "markov_head_type": head, "enable_confidence_head": True,
            "confidence_head_with_markov": True, "mask_token_id": 79, "torch_dtype": "bfloat16",
            "speculators_config": {"algorithm": "dspark",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}]}}


def test_speculators_layout_with_draft_vocabulary_and_rnn_head_validates(tmp_path):
    config = _speculators_config()
    cfg = DSparkConfig.from_dict(config)
    assert (cfg.family, cfg.target_layer_ids, cfg.draft_vocab_size) == ("speculators", (0, 2), VD)
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in state_for(cfg).items()}
    tensors["embed_tokens.weight"] = torch.zeros(V, 64, dtype=torch.bfloat16)
    ckpt = write_raw(tmp_path / "spec", config, tensors)
    assert validate_checkpoint(ckpt).ok, validate_checkpoint(ckpt).problems
    assert "markov_head.joint_proj.bias" in drafter_tensors(cfg)
