"""Start-up validation recognises every checkpoint family and refuses what the V1 runner cannot serve by name.

These run the validation vLLM's SpeculativeConfig patch calls before any engine process exists
(``vllm_dspark.serving.validate``), without vLLM.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import K3_CONFIG, tiny_config
from vllm_dspark.checkpoint.io import save_checkpoint
from vllm_dspark.checkpoint.shapes import required_shapes
from vllm_dspark.config import DSparkConfig
from vllm_dspark.serving.validate import (
    V2_RUNNER,
    DSparkDraftError,
    in_progress_refusals,
    read_dspark_draft,
    v1_runner_refusal,
    validate_draft_for_serving,
)

FAMILIES_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "families"


def save(path: Path, cfg: DSparkConfig) -> Path:
    """A valid tiny checkpoint of ``cfg`` (a draft vocabulary's d2t maps draft id i to target id 2i)."""
    state = {name: torch.zeros(shape) for name, shape in required_shapes(cfg).items()}
    if cfg.draft_vocab_size is not None:
        state["d2t"] = torch.arange(cfg.draft_vocab_size, dtype=torch.int64)
    return save_checkpoint(path, cfg, state)


def draft_dir(tmp_path: Path, config: dict | Path, name: str = "draft") -> Path:
    d = tmp_path / name
    d.mkdir()
    text = config.read_text() if isinstance(config, Path) else json.dumps(config)
    (d / "config.json").write_text(text)
    return d


def serve(path: Path):
    draft = read_dspark_draft(path)
    assert draft is not None, f"{path} was not recognised as a DSpark draft"
    return validate_draft_for_serving(draft, None, num_speculative_tokens=None, served_context=512, environ={})


def refusal(path: Path) -> str:
    with pytest.raises(DSparkDraftError) as info:
        serve(path)
    return str(info.value)


@pytest.mark.parametrize("name", sorted(p.name for p in FAMILIES_DIR.glob("*.json")))
def test_every_family_file_is_recognised_as_a_dspark_draft(tmp_path, name):
    assert read_dspark_draft(draft_dir(tmp_path, FAMILIES_DIR / name)) is not None


def test_a_non_dspark_config_is_left_to_vllm(tmp_path):
    plain = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    assert read_dspark_draft(draft_dir(tmp_path, plain)) is None


@pytest.mark.parametrize("name,arch", [("k3-mla-dspark.constructed.json", "K3DSparkModel"),
                                       ("deepspec-gemma4.constructed.json", "Gemma4DSparkModel")])
def test_other_backbones_are_refused_in_one_line_naming_what_serves_them(tmp_path, name, arch):
    msg = refusal(draft_dir(tmp_path, FAMILIES_DIR / name))
    assert "\n" not in msg
    assert arch in msg and "V1 runner" in msg and V2_RUNNER in msg


def test_specforge_export_named_dflash_is_refused_with_the_rename(tmp_path):
    msg = refusal(draft_dir(tmp_path, FAMILIES_DIR / "specforge-qwen3-4b-dspark.json"))
    assert "DFlashDraftModel" in msg and '"architectures": ["DSparkDraftModel"]' in msg


def test_unknown_architecture_and_causal_exports_are_refused_by_name(tmp_path):
    msg = refusal(draft_dir(tmp_path, FAMILIES_DIR / "specforge-kimi-k3-dspark-5mla.json", "mla"))
    assert "KimiK3DSpark5MLADraftModel" in msg
    msg = refusal(draft_dir(tmp_path, FAMILIES_DIR / "specforge-qwen3-8b-dspark-causal-noconf-b16.json", "c"))
    assert "is_causal: true" in msg


def test_a_draft_vocabulary_checkpoint_validates_for_serving(tmp_path):
    cfg, settings = serve(save(tmp_path / "ckpt", tiny_config(draft_vocab_size=40)))
    assert cfg.draft_vocab_size == 40 and settings.draft_vocab is None  # its own vocabulary, no serve-time one


def _edit(ckpt: Path, fn) -> Path:
    from safetensors.torch import load_file, save_file

    state = load_file(str(ckpt / "model.safetensors"))
    fn(state)
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    return ckpt


def _with_t2d(s):
    t2d = torch.zeros(80, dtype=torch.bool)
    t2d[::2] = True  # the ids d2t maps to (2i)
    s["t2d"] = t2d


# Issue 30 item 6: each refused at start-up, by name, before any engine process.
@pytest.mark.parametrize("corrupt,needles", [
    (lambda s: s["d2t"].__setitem__(5, 200), ("d2t:", "outside the target vocabulary", "draft id 5 -> 205")),
    (lambda s: s["d2t"].__setitem__(1, -1), ("d2t:", "more than one draft id", "target id 0")),
    (lambda s: (_with_t2d(s), s["t2d"].__setitem__(1, True)), ("t2d: disagrees with d2t",)),
    (lambda s: s.pop("lm_head.weight"), ("lm_head.weight: missing", "draft_vocab_size 40", "cannot stand in")),
], ids=["d2t-outside", "d2t-repeated", "t2d-disagrees", "no-lm-head"])
def test_bad_draft_vocabulary_maps_are_refused_at_start_up_by_name(tmp_path, corrupt, needles):
    ckpt = _edit(save(tmp_path / "ckpt", tiny_config(draft_vocab_size=40)), corrupt)
    msg = refusal(ckpt)
    assert any(all(n in line for n in needles) for line in msg.split("\n  - ")), msg


def test_speculative_tokens_that_disagree_with_block_and_layout_are_refused_at_start_up(tmp_path):
    config = json.loads((FAMILIES_DIR / "speculators-qwen3.6-35b-a3b.json").read_text())
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 7  # block 8, anchor-first: 8
    msg = refusal(draft_dir(tmp_path, config))
    assert "speculative_tokens: got 7" in msg and "block_size 8" in msg and "proposes 8" in msg


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_gated_and_rnn_heads_validate_for_serving(tmp_path, head):
    cfg, _ = serve(save(tmp_path / "ckpt", tiny_config(markov_head_type=head)))
    assert cfg.markov_head_type == head


def test_deepspec_and_speculators_layouts_are_no_longer_refused_as_in_progress(tmp_path):
    for i, name in enumerate(("deepspec-qwen3-4b-block7.constructed.json", "speculators-qwen3.6-35b-a3b.json")):
        msg = refusal(draft_dir(tmp_path, FAMILIES_DIR / name, f"d{i}"))  # a bare config: the weights are missing
        assert "model.safetensors: missing" in msg and "not served" not in msg and "SpecForge exports" not in msg


def test_in_progress_refusals_are_one_function_and_empty_for_what_serves():
    assert in_progress_refusals(DSparkConfig.from_json(K3_CONFIG)) == []
    assert v1_runner_refusal(DSparkConfig.from_json(K3_CONFIG)) is None
    for name in ("speculators-glm-5.2-gated-1pn.constructed.json", "deepspec-qwen3-4b-block7.constructed.json",
                 "specforge-qwen3-8b-dspark-draftvocab32k.json"):
        cfg = DSparkConfig.from_json(FAMILIES_DIR / name)
        assert in_progress_refusals(cfg) == [] and v1_runner_refusal(cfg) is None, name


def test_a_servable_specforge_draft_still_validates(tmp_path):
    ckpt = save(tmp_path / "ok", tiny_config())
    cfg, settings = serve(ckpt)
    assert cfg == tiny_config() and settings.num_draft_tokens == cfg.num_draft_tokens
    shutil.rmtree(ckpt)
