"""The default pair: SmolLM2-135M-Instruct (converted by setup) and the drafters shipped in the package.

The shipped DSpark drafter must pass ``vllm-dspark inspect`` on its own and against the
converted target, stay under the 30 MB budget, and have the layout issue 9 asks for (block
7, anchor-first, aux layers spread over the 30 target layers, Markov and confidence heads).
The DFlash-style ablation is the same backbone without a Markov head. ``vllm-dspark default
--json`` names both directories of the pair.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from training.pipeline import ABLATION_DIR
from vllm_dspark.config import DSparkConfig
from vllm_dspark.tools.default_pair import check_target, draft_dir, target_dir

CLI = [sys.executable, "-m", "vllm_dspark.tools.cli"]


@pytest.fixture(scope="module")
def target() -> Path:
    path = target_dir()
    problems = check_target(path, hash_weights=False)
    if problems:  # CI runs scripts/setup_env.sh first, which prepares it
        pytest.skip(f"the default target is not prepared ({problems[0]}); run scripts/setup_env.sh")
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def test_shipped_drafter_has_the_issue_layout_and_budget():
    d = draft_dir("dspark")
    cfg = DSparkConfig.from_json(d / "config.json")
    assert cfg.block_size == 7 and cfg.sample_from_anchor
    assert cfg.markov_rank > 0 and cfg.enable_confidence_head
    ids = list(cfg.target_layer_ids)
    assert len(ids) >= 4 and ids[0] <= 2 and ids[-1] >= 27 and ids == sorted(ids)  # spread over 30 layers
    assert (d / "model.safetensors").stat().st_size < 30e6


def test_ablation_is_the_same_backbone_without_a_markov_head():
    a = DSparkConfig.from_json(ABLATION_DIR / "config.json")
    d = DSparkConfig.from_json(draft_dir("dspark") / "config.json")
    assert a.markov_rank == 0 and d.markov_rank > 0
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "block_size", "target_layer_ids"):
        assert getattr(a, key) == getattr(d, key), key
    # The trained context is the recipe's (its sequence length): alike only once the ablation is
    # retrained with the drafter's recipe; until then the record must say it is not.
    import json

    info = json.loads((draft_dir("dspark").parent / "train_info.json").read_text())
    if a.max_position_embeddings != d.max_position_embeddings:
        assert "dflash" in info.get("shortfalls", {}), "the ablation was trained differently and the record hides it"


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_shipped_drafters_pass_inspect_against_the_target(kind, target):
    r = _cli("inspect", str(draft_dir() if kind == "dspark" else ABLATION_DIR), "--target", str(target))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: no problems found" in r.stdout


def test_default_json_names_the_pair(target):
    r = _cli("default", "--json")
    assert r.returncode == 0, r.stderr
    paths = json.loads(r.stdout)
    assert Path(paths["target"]) == target.resolve() and Path(paths["draft"]) == draft_dir("dspark")
    assert all(Path(p).is_absolute() and Path(p).is_dir() for p in paths.values())
    text = _cli("default")
    assert str(target.resolve()) in text.stdout and str(draft_dir("dspark")) in text.stdout


def test_the_wheel_does_not_carry_the_toy_pair():
    assets = Path(draft_dir("dspark")).parents[1]
    assert not (assets / "default").exists()  # the toy pair moved to tests/fixtures/toy_pair
    total = sum(p.stat().st_size for p in assets.rglob("*") if p.is_file())
    assert total < 60e6, f"{total / 1e6:.1f} MB of package assets"
