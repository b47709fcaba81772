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


@pytest.mark.parametrize("changes,needle", [
    ({"draft_vocab_size": 40}, "draft_vocab_size: 40"),
])
def test_draft_vocabularies_parse_but_wait_for_the_markov_stage(tmp_path, changes, needle):
    ckpt = save(tmp_path / "ckpt", tiny_config(**changes))
    msg = refusal(ckpt)
    assert needle in msg and "Markov stage does not serve it yet" in msg
    assert msg.count("\n  - ") == 1  # the checkpoint itself is valid: that is the only problem


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_gated_and_rnn_heads_validate_for_serving(tmp_path, head):
    cfg, _ = serve(save(tmp_path / "ckpt", tiny_config(markov_head_type=head)))
    assert cfg.markov_head_type == head


def test_deepspec_and_speculators_layouts_wait_for_the_v1_loader(tmp_path):
    for i, name in enumerate(("deepspec-qwen3-4b-block7.constructed.json", "speculators-qwen3.6-35b-a3b.json")):
        msg = refusal(draft_dir(tmp_path, FAMILIES_DIR / name, f"d{i}"))
        assert "loader reads SpecForge exports" in msg and V2_RUNNER in msg


def test_in_progress_refusals_are_one_function_and_empty_for_what_serves():
    assert in_progress_refusals(DSparkConfig.from_json(K3_CONFIG)) == []
    assert v1_runner_refusal(DSparkConfig.from_json(K3_CONFIG)) is None
    gated = DSparkConfig.from_json(FAMILIES_DIR / "speculators-glm-5.2-gated-1pn.constructed.json")
    lines = in_progress_refusals(gated)
    assert len(lines) == 2  # the draft vocabulary, the speculators layout (gated heads are served)


def test_a_servable_specforge_draft_still_validates(tmp_path):
    ckpt = save(tmp_path / "ok", tiny_config())
    cfg, settings = serve(ckpt)
    assert cfg == tiny_config() and settings.num_draft_tokens == cfg.num_draft_tokens
    shutil.rmtree(ckpt)
