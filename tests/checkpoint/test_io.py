"""Checkpoint I/O: a tiny checkpoint in the real layout loads; every corruption is named."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import tiny_config
from vllm_dspark.checkpoint.io import (
    LEGACY_PREFIXES,
    CheckpointError,
    canonical_name,
    load_checkpoint,
    load_reference_model,
    save_checkpoint,
    validate_checkpoint,
)
from vllm_dspark.model.reference import expected_tensor_shapes

WEIGHTS = "model.safetensors"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(ckpt: Path, dst: Path, edit) -> Path:
    """Copy ``ckpt`` to ``dst`` with its state dict passed through ``edit`` (in place)."""
    out = _copy(ckpt, dst)
    state = load_file(str(out / WEIGHTS))
    edit(state)
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    return out


def _header(path: Path) -> tuple[dict, int]:
    raw = (path / WEIGHTS).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), n


def _refused(path: Path, *needles: str) -> list[str]:
    """Validation reports a problem containing every needle, and load_checkpoint refuses."""
    problems = validate_checkpoint(path).problems
    assert any(all(s in p for s in needles) for p in problems), problems
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert info.value.problems == problems
    return problems


# ---------------------------------------------------------------- happy paths
def test_tiny_checkpoint_in_the_real_layout_loads(tiny_ckpt):
    cfg = tiny_config()
    header, _ = _header(tiny_ckpt)
    names = {k for k in header if k != "__metadata__"}
    expected = expected_tensor_shapes(cfg)
    assert names == set(expected)  # no `model.` prefix, no embed_tokens / lm_head
    assert all(header[k]["dtype"] == "BF16" for k in names)
    assert all(tuple(header[k]["shape"]) == expected[k] for k in names)

    report = validate_checkpoint(tiny_ckpt)
    assert report.ok, report.problems
    loaded_cfg, state = load_checkpoint(tiny_ckpt)
    assert loaded_cfg == cfg
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    assert all(v.dtype == torch.bfloat16 for v in state.values())

    model = load_reference_model(tiny_ckpt)
    assert torch.equal(model.fc.weight, state["fc.weight"].float())
    assert torch.equal(model.markov_head.markov_w2.weight, state["markov_head.markov_w2.weight"].float())
    assert model.rope_inv_freq.device.type == "cpu"


def test_save_then_load_round_trips_values(tmp_path):
    cfg = tiny_config(num_hidden_layers=1)
    g = torch.Generator().manual_seed(3)
    state = {k: torch.randn(s, generator=g) for k, s in expected_tensor_shapes(cfg).items()}
    save_checkpoint(tmp_path / "ck", cfg, state)
    cfg2, loaded = load_checkpoint(tmp_path / "ck")
    assert cfg2 == cfg
    for k, v in state.items():
        assert torch.equal(loaded[k], v.to(torch.bfloat16)), k


# ---------------------------------------------------------------- corruptions
def test_missing_tensor_is_named(tiny_ckpt, tmp_path):
    bad = _rewrite(tiny_ckpt, tmp_path / "c", lambda s: s.pop("layers.1.mlp.up_proj.weight"))
    _refused(bad, "layers.1.mlp.up_proj.weight", "missing", "[96, 64]")


def test_wrong_shape_is_named_with_expected_and_found(tiny_ckpt, tmp_path):
    def edit(s):
        s["fc.weight"] = torch.zeros(64, 100, dtype=torch.bfloat16)

    bad = _rewrite(tiny_ckpt, tmp_path / "c", edit)
    _refused(bad, "fc.weight", "[64, 100]", "[64, 128]")


def test_wrong_dtype_is_named(tiny_ckpt, tmp_path):
    name = "layers.0.self_attn.q_proj.weight"

    def edit(s):
        s[name] = s[name].to(torch.float16)

    bad = _rewrite(tiny_ckpt, tmp_path / "c", edit)
    _refused(bad, name, "float16", "bfloat16")


def test_fp32_confidence_head_is_accepted(tiny_ckpt, tmp_path):
    def edit(s):
        for k in ("confidence_head.proj.weight", "confidence_head.proj.bias"):
            s[k] = s[k].float()

    ok = _rewrite(tiny_ckpt, tmp_path / "c", edit)
    assert validate_checkpoint(ok).ok


def test_unexpected_tensor_is_named(tiny_ckpt, tmp_path):
    def edit(s):
        s["layers.2.mlp.gate_proj.weight"] = torch.zeros(96, 64, dtype=torch.bfloat16)  # config has 2 layers

    bad = _rewrite(tiny_ckpt, tmp_path / "c", edit)
    _refused(bad, "layers.2.mlp.gate_proj.weight", "unexpected tensor")


def test_nan_and_inf_are_named_and_counted(tiny_ckpt, tmp_path):
    def edit(s):
        s["markov_head.markov_w2.weight"][3, 1] = float("nan")
        s["norm.weight"][0] = float("inf")
        s["norm.weight"][5] = float("-inf")

    bad = _rewrite(tiny_ckpt, tmp_path / "c", edit)
    problems = _refused(bad, "markov_head.markov_w2.weight", "1 NaN and 0 Inf")
    assert any("norm.weight: contains 0 NaN and 2 Inf" in p for p in problems), problems
    # --no-scan's path skips exactly the value scan.
    assert validate_checkpoint(bad, scan_values=False).ok


def test_truncated_file_names_the_cut_tensor(tiny_ckpt, tmp_path):
    bad = _copy(tiny_ckpt, tmp_path / "c")
    header, _ = _header(bad)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    f = bad / WEIGHTS
    f.write_bytes(f.read_bytes()[:-10])
    _refused(bad, last, "truncated")


def test_corrupt_header_json_is_refused(tiny_ckpt, tmp_path):
    bad = _copy(tiny_ckpt, tmp_path / "c")
    f = bad / WEIGHTS
    raw = bytearray(f.read_bytes())
    raw[8:20] = b"\xff" * 12
    f.write_bytes(bytes(raw))
    _refused(bad, WEIGHTS, "corrupt")


def test_header_length_past_end_of_file_is_refused(tiny_ckpt, tmp_path):
    bad = _copy(tiny_ckpt, tmp_path / "c")
    f = bad / WEIGHTS
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    _refused(bad, WEIGHTS, "runs past the end")


def test_tiny_file_is_refused(tiny_ckpt, tmp_path):
    bad = _copy(tiny_ckpt, tmp_path / "c")
    (bad / WEIGHTS).write_bytes(b"\x01\x02")
    _refused(bad, WEIGHTS, "too short")


def _with_header(ckpt: Path, dst: Path, edit) -> Path:
    """Copy with the safetensors header JSON replaced by ``edit(header)`` (data bytes unchanged)."""
    out = _copy(ckpt, dst)
    raw = (out / WEIGHTS).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    new = json.dumps(edit(json.loads(raw[8:8 + n]))).encode()
    (out / WEIGHTS).write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    return out


@pytest.mark.parametrize("edit", [
    lambda h: list(h),  # not a JSON object
    lambda h: {**h, "norm.weight": "oops"},  # entry not an object
    lambda h: {**h, "norm.weight": {**h["norm.weight"], "data_offsets": "xx"}},
], ids=["header-list", "entry-string", "offsets-string"])
def test_malformed_header_structure_is_reported_not_raised(tiny_ckpt, tmp_path, edit):
    bad = _with_header(tiny_ckpt, tmp_path / "c", edit)
    problems = validate_checkpoint(bad).problems
    assert problems and any("corrupt" in p for p in problems), problems


def test_header_byte_range_inconsistent_with_shape_is_named(tiny_ckpt, tmp_path):
    def edit(h):
        h["norm.weight"] = {**h["norm.weight"], "shape": [32]}  # bytes still hold 64 bf16 values
        return h

    bad = _with_header(tiny_ckpt, tmp_path / "c", edit)
    problems = validate_checkpoint(bad).problems
    assert any(p.startswith("norm.weight:") and "corrupt" in p for p in problems), problems


def test_inconsistent_shared_embedding_is_named(tiny_ckpt, tmp_path):
    def edit(s):
        s["embed_tokens.weight"] = torch.zeros(80, 32, dtype=torch.bfloat16)  # hidden is 64

    bad = _rewrite(tiny_ckpt, tmp_path / "c", edit)
    _refused(bad, "embed_tokens.weight", "[80, 32]", "[80, 64]")


def test_consistent_shared_embedding_and_lm_head_are_accepted_and_dropped(tiny_ckpt, tmp_path):
    def edit(s):
        s["embed_tokens.weight"] = torch.zeros(80, 64, dtype=torch.bfloat16)
        s["model.lm_head.weight"] = torch.zeros(80, 64, dtype=torch.bfloat16)

    ok = _rewrite(tiny_ckpt, tmp_path / "c", edit)
    assert validate_checkpoint(ok).ok, validate_checkpoint(ok).problems
    _, state = load_checkpoint(ok)
    assert set(state) == set(expected_tensor_shapes(tiny_config()))


def test_weights_file_missing_is_reported(tiny_ckpt, tmp_path):
    bad = _copy(tiny_ckpt, tmp_path / "c")
    (bad / WEIGHTS).rename(bad / "model-00001-of-00002.safetensors")
    _refused(bad, WEIGHTS, "missing", "model-00001-of-00002.safetensors")


def test_every_problem_is_listed(tiny_ckpt, tmp_path):
    def edit(s):
        s.pop("norm.weight")
        s["fc.weight"] = torch.zeros(64, 100, dtype=torch.bfloat16)
        s["extra.weight"] = torch.zeros(3, dtype=torch.bfloat16)

    bad = _rewrite(tiny_ckpt, tmp_path / "c", edit)
    problems = validate_checkpoint(bad).problems
    assert len(problems) == 3, problems
    for name in ("norm.weight", "fc.weight", "extra.weight"):
        assert any(p.startswith(name + ":") for p in problems), (name, problems)


# ---------------------------------------------------------------- legacy names
def test_canonical_name_maps_every_legacy_prefix():
    for old, new in LEGACY_PREFIXES.items():
        assert canonical_name(old + "weight") == new + "weight"
    assert canonical_name("model.layers.0.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert canonical_name("logit_head.confidence_head.proj.bias") == "confidence_head.proj.bias"
    assert canonical_name("fc.weight") == "fc.weight"


def test_legacy_logit_head_names_load(tmp_path):
    from tests.tiny_pair import make_drafter

    cfg = tiny_config(num_hidden_layers=1)
    new = make_drafter(tmp_path / "new", cfg, seed=5)
    old = make_drafter(tmp_path / "old", cfg, seed=5, legacy_names=True)
    header, _ = _header(old)
    stored = {k for k in header if k != "__metadata__"}
    assert any(k.startswith("logit_head.") for k in stored)
    assert not any(k.startswith(("markov_head.", "confidence_head.")) for k in stored)

    assert validate_checkpoint(old).ok, validate_checkpoint(old).problems
    _, s_old = load_checkpoint(old)
    _, s_new = load_checkpoint(new)
    assert set(s_old) == set(s_new)
    for k in s_new:
        assert torch.equal(s_old[k], s_new[k]), k
    load_reference_model(old)  # strict load_state_dict accepts the canonical names


# ---------------------------------------------------------------- atomic save
def _state(cfg):
    return {k: torch.zeros(s) for k, s in expected_tensor_shapes(cfg).items()}


def _boom(*args, **kwargs):
    raise RuntimeError("disk full (simulated)")


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", _boom)
    target = tmp_path / "out" / "ck"
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(target, tiny_config(), _state(tiny_config()))
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # no half-written temp directory either


def test_failed_save_keeps_the_old_checkpoint_intact(tiny_ckpt, tmp_path, monkeypatch):
    target = _copy(tiny_ckpt, tmp_path / "ck")
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    from vllm_dspark.config import DSparkConfig

    # Fail after the weights were written, while writing config.json.
    monkeypatch.setattr(DSparkConfig, "to_hf_dict", _boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(target, tiny_config(), _state(tiny_config()))
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert validate_checkpoint(target).ok


def test_save_over_an_existing_checkpoint_replaces_it(tiny_ckpt, tmp_path):
    target = _copy(tiny_ckpt, tmp_path / "ck")
    cfg = tiny_config()
    save_checkpoint(target, cfg, _state(cfg))
    _, state = load_checkpoint(target)
    assert all(not v.any() for v in state.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # the `.ck.old` copy is gone


def test_save_refuses_an_incomplete_state(tmp_path):
    cfg = tiny_config()
    state = _state(cfg)
    state.pop("fc.weight")
    with pytest.raises(ValueError, match="fc.weight"):
        save_checkpoint(tmp_path / "ck", cfg, state)
    assert not (tmp_path / "ck").exists()
