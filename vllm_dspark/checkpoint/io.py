"""Read, validate and write DSpark checkpoints in SpecForge's export layout.

A checkpoint directory holds ``config.json`` and one ``model.safetensors`` (BF16,
no ``model.`` prefix, no ``embed_tokens`` / ``lm_head``). Validation reads the
safetensors header first (names, shapes, dtypes, byte ranges against the file
size) and then streams the tensors one at a time from a memory map for the
NaN/Inf scan, so a 4.5 GB export is never held in memory twice.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from vllm_dspark.config import DSparkConfig, DSparkConfigError
from vllm_dspark.model.reference import expected_tensor_shapes
from vllm_dspark.model.rope import rope_inv_freq_and_scale

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

# Older SpecForge exports kept both DSpark heads under one `logit_head.` module.
LEGACY_PREFIXES = {
    "logit_head.markov_w1.": "markov_head.markov_w1.",
    "logit_head.markov_w2.": "markov_head.markov_w2.",
    "logit_head.confidence_head.": "confidence_head.",
    "logit_head.proj.": "confidence_head.proj.",
    "logit_head.confidence_proj.": "confidence_head.proj.",
}
# The drafter borrows these from the target; an export may still carry copies.
OPTIONAL_SHARED = {"embed_tokens.weight", "lm_head.weight"}

_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
              "I64": "int64", "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_DTYPE_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4,
               "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def canonical_name(name: str) -> str:
    """Map a tensor name of any known export generation to the current one."""
    if name.startswith("model."):
        name = name[len("model."):]
    for old, new in LEGACY_PREFIXES.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


@dataclass
class HeaderEntry:
    name: str  # canonical name
    stored_name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class CheckpointReport:
    """Everything ``inspect`` and the loaders need to know about one checkpoint."""

    path: Path
    config: DSparkConfig | None
    problems: list[str] = field(default_factory=list)
    tensors: dict[str, HeaderEntry] = field(default_factory=dict)
    file_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """Return (header dict, data offset). Raises ValueError on a corrupt file."""
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"{path.name}: {size} bytes, too short to hold a safetensors header (truncated?)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n <= 0 or 8 + n > size:
            raise ValueError(f"{path.name}: header length {n} runs past the end of the {size}-byte file "
                             "(truncated or not a safetensors file)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path.name}: header is not valid JSON ({exc}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: header is a JSON {type(header).__name__}, not an object of tensors; "
                         "the file is corrupt")
    return header, 8 + n


def _parse_entry(stored: str, meta) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry; ValueError when malformed."""
    if not isinstance(meta, dict):
        raise ValueError(f"entry is a {type(meta).__name__}, not an object")
    shape_raw, offsets = meta.get("shape", []), meta.get("data_offsets")
    if not isinstance(shape_raw, list) or not all(isinstance(x, int) and x >= 0 for x in shape_raw):
        raise ValueError(f"shape {shape_raw!r} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(x, int) and x >= 0 for x in offsets) or offsets[1] < offsets[0]):
        raise ValueError(f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    dtype = _ST_DTYPES.get(cast(str, meta.get("dtype")), str(meta.get("dtype")))
    return dtype, tuple(shape_raw), offsets[0], offsets[1]


def _header_entries(path: Path, problems: list[str]) -> dict[str, HeaderEntry]:
    try:
        header, data_start = read_safetensors_header(path)
    except ValueError as exc:
        problems.append(str(exc))
        return {}
    size = path.stat().st_size
    entries: dict[str, HeaderEntry] = {}
    for stored, meta in header.items():
        if stored == "__metadata__":
            continue
        name = canonical_name(stored)
        try:
            dtype, shape, begin, end = _parse_entry(stored, meta)
        except ValueError as exc:
            problems.append(f"{stored}: malformed header entry ({exc}); the file is corrupt")
            continue
        if name in entries:
            problems.append(f"{stored}: duplicates {entries[name].stored_name} (same tensor under two names)")
            continue
        numel = 1
        for s in shape:
            numel *= s
        expect_bytes = numel * _DTYPE_SIZE.get(dtype, 0)
        if _DTYPE_SIZE.get(dtype) and end - begin != expect_bytes:
            problems.append(f"{stored}: header says {end - begin} bytes but shape {list(shape)} of {dtype} "
                            f"needs {expect_bytes}; the file is corrupt")
        if data_start + end > size:
            problems.append(f"{stored}: data ends at byte {data_start + end} but the file has {size} bytes "
                            "(truncated file; re-export or re-download it)")
        entries[name] = HeaderEntry(name, stored, dtype, shape, begin, end)
    return entries


def validate_checkpoint(path: str | Path, *, scan_values: bool = True,
                        config: DSparkConfig | None = None) -> CheckpointReport:
    """Check a checkpoint directory (or a bare config.json) and report every problem.

    Problems name the tensor and give expected vs found. ``scan_values`` streams
    every tensor once to look for NaN/Inf.
    """
    path = Path(path)
    cfg_path = path / CONFIG_NAME if path.is_dir() else path
    report = CheckpointReport(path=path, config=config)
    if report.config is None:
        try:
            report.config = DSparkConfig.from_json(cfg_path)
        except DSparkConfigError as exc:
            report.problems.extend(exc.problems)
            return report
    if not path.is_dir():
        return report  # a bare config: nothing more to check
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        shards = sorted(path.glob("*.safetensors"))
        hint = f" (found {[s.name for s in shards]}; SpecForge exports one file)" if shards else ""
        report.problems.append(f"{WEIGHTS_NAME}: missing in {path}{hint}")
        return report
    report.file_bytes = weights.stat().st_size
    report.tensors = _header_entries(weights, report.problems)
    if not report.tensors:
        if not report.problems:
            report.problems.append(f"{WEIGHTS_NAME}: holds no tensors")
        return report
    cfg = report.config
    expected = expected_tensor_shapes(cfg)
    for name, shape in expected.items():
        entry = report.tensors.get(name)
        if entry is None:
            report.problems.append(f"{name}: missing (expected shape {list(shape)}, dtype {cfg.dtype})")
            continue
        if entry.shape != shape:
            report.problems.append(f"{name}: shape {list(entry.shape)} but the config implies {list(shape)}")
        # The confidence head is kept in fp32 by some exports; every other tensor follows the config.
        allowed = {cfg.dtype} | ({"float32"} if name.startswith("confidence_head.") else set())
        if entry.dtype not in allowed:
            report.problems.append(f"{name}: dtype {entry.dtype} but the config says {cfg.dtype}")
    for name, entry in report.tensors.items():
        if name in expected:
            continue
        if name in OPTIONAL_SHARED:
            want = (cfg.vocab_size, cfg.hidden_size)
            if entry.shape != want:
                report.problems.append(f"{entry.stored_name}: shape {list(entry.shape)} is inconsistent with the "
                                       f"target-shared shape {list(want)} (vocab_size x hidden_size)")
            continue
        report.problems.append(f"{entry.stored_name}: unexpected tensor (shape {list(entry.shape)}); "
                               "not part of a DSpark drafter with this config")
    if scan_values and not any("truncated" in p or "corrupt" in p for p in report.problems):
        for name, tensor in iter_tensors(path, names=list(report.tensors)):
            if tensor.is_floating_point():
                bad = ~torch.isfinite(tensor)
                if bool(bad.any()):
                    nan = int(torch.isnan(tensor).sum())
                    inf = int(bad.sum()) - nan
                    report.problems.append(f"{name}: contains {nan} NaN and {inf} Inf values")
    return report


def iter_tensors(path: str | Path, names: list[str] | None = None,
                 device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (canonical name, tensor) one at a time from the memory-mapped file."""
    from safetensors import safe_open

    weights = Path(path) / WEIGHTS_NAME if Path(path).is_dir() else Path(path)
    with safe_open(str(weights), framework="pt", device=device) as f:
        stored = {canonical_name(k): k for k in f.keys()}  # noqa: SIM118 (safetensors handle, not a dict)
        for name in names if names is not None else list(stored):
            yield name, f.get_tensor(stored[name])


def load_checkpoint(path: str | Path, *, device: str = "cpu", validate: bool = True,
                    scan_values: bool = True) -> tuple[DSparkConfig, dict[str, torch.Tensor]]:
    """Validate, then load (config, state dict with canonical names).

    Raises ``CheckpointError`` listing every problem when the checkpoint is unusable.
    """
    if validate:
        report = validate_checkpoint(path, scan_values=scan_values)
        if not report.ok:
            raise CheckpointError(Path(path), report.problems)
        cfg = report.config
        assert cfg is not None  # an ok report always carries its config
    else:
        cfg = DSparkConfig.from_json(path)
    state = {name: t for name, t in iter_tensors(path, device=device) if name not in OPTIONAL_SHARED}
    return cfg, state


def load_reference_model(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A ``DSparkDraftModel`` with the checkpoint's weights."""
    from vllm_dspark.model.reference import DSparkDraftModel

    cfg, state = load_checkpoint(path, device=device)
    with torch.device("meta"):
        model = DSparkDraftModel(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers were created on the meta device with the module.
    model.rope_inv_freq = rope_inv_freq_and_scale(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)[0].to(device)
    return model.to(dtype=dtype)


class CheckpointError(ValueError):
    def __init__(self, path: Path, problems: list[str]):
        self.problems = list(problems)
        lines = "\n  - ".join(problems)
        super().__init__(f"DSpark checkpoint {path} is not usable:\n  - {lines}")


def save_checkpoint(path: str | Path, config: DSparkConfig, state: dict[str, torch.Tensor],
                    *, dtype: torch.dtype = torch.bfloat16, extra_config: dict | None = None) -> Path:
    """Write ``config.json`` + one ``model.safetensors`` atomically (a temp dir renamed into place)."""
    from safetensors.torch import save_file

    path = Path(path)
    expected = expected_tensor_shapes(config)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"save_checkpoint: state dict lacks {missing}")
    tensors = {k: state[k].detach().to("cpu", dtype).contiguous() for k in expected}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        cfg_dict = config.to_hf_dict()
        if extra_config:
            cfg_dict.update(extra_config)
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg_dict, indent=2) + "\n")
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
