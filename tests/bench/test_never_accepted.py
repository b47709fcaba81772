"""The benchmark's worst-case drafter: the shapes of the one it imitates, noise weights, a head that says 0.9."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.harness.never_accepted import never_accepted_drafter
from vllm_dspark.checkpoint.io import load_checkpoint, load_reference_model

TOY_DRAFTER = Path(__file__).resolve().parents[1] / "fixtures" / "toy_pair" / "drafter"


def test_same_shapes_noise_weights_and_a_confident_head(tmp_path):
    out = never_accepted_drafter(TOY_DRAFTER, tmp_path / "na", confidence=0.9, seed=3)
    cfg0, s0 = load_checkpoint(TOY_DRAFTER)
    cfg1, s1 = load_checkpoint(out)
    assert cfg1 == cfg0 and {k: v.shape for k, v in s1.items()} == {k: v.shape for k, v in s0.items()}
    assert not torch.equal(s1["fc.weight"].float(), s0["fc.weight"].float())
    m = load_reference_model(out)
    x = torch.randn(5, m.confidence_head.proj.in_features)
    conf = torch.sigmoid(m.confidence_head.proj(x)).flatten()
    torch.testing.assert_close(conf, torch.full_like(conf, 0.9), atol=2e-3, rtol=0)
    # Reused as it is when asked again with the same recipe; rewritten for another.
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert never_accepted_drafter(TOY_DRAFTER, tmp_path / "na", confidence=0.9, seed=3) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    never_accepted_drafter(TOY_DRAFTER, tmp_path / "na", confidence=0.8, seed=3)
    assert "confidence=0.8" in (out / "RECIPE").read_text()


def test_bad_confidence_is_refused(tmp_path):
    with pytest.raises(ValueError, match="confidence must be in"):
        never_accepted_drafter(TOY_DRAFTER, tmp_path / "na", confidence=1.0)


def test_rebuilt_when_the_drafter_it_imitates_changes(tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(TOY_DRAFTER, src)
    out = never_accepted_drafter(src, tmp_path / "na")
    cfg = load_checkpoint(out)[0]
    text = (src / "config.json").read_text()
    key = '"max_position_embeddings": '
    old = int(text.split(key, 1)[1].split(",", 1)[0])
    (src / "config.json").write_text(text.replace(f"{key}{old}", f"{key}{old * 2}", 1))
    never_accepted_drafter(src, tmp_path / "na")
    assert load_checkpoint(out)[0].max_position_embeddings == 2 * old != cfg.max_position_embeddings
