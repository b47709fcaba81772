"""Read, validate and write DSpark checkpoints of every family.

A checkpoint directory holds ``config.json`` and one ``model.safetensors``
(SpecForge: BF16, no ``model.`` prefix, no ``embed_tokens`` / ``lm_head``;
DeepSpec and speculators also save copies of the target's embedding and LM
head, and a draft vocabulary brings its own ``lm_head`` and ``d2t`` / ``t2d``).
Names of every generation map to one canonical set (:func:`canonical_name`), and
:mod:`vllm_dspark.checkpoint.shapes` gives the shape each must have. Validation
reads the safetensors header first (names, shapes, dtypes, byte ranges against
the file size), checks a draft vocabulary's id maps (small: always read), and
then streams the tensors one at a time from a memory map for the NaN/Inf scan,
so a 4.5 GB export is never held in memory twice.
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

from vllm_dspark.checkpoint.shapes import TensorSpec, drafter_tensors, required_shapes
from vllm_dspark.checkpoint.vocab_map import d2t_problems, t2d_problems
from vllm_dspark.config import DSparkConfig, DSparkConfigError
from vllm_dspark.model.rope import rope_inv_freq_and_scale

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

# Older SpecForge exports kept both DSpark heads under one `logit_head.` module (SpecForge's
# normalize_draft_head_checkpoint_keys maps the same names).
LEGACY_PREFIXES = {
    "logit_head.markov_head.": "markov_head.",
    "logit_head.markov_w1.": "markov_head.markov_w1.",
    "logit_head.markov_w2.": "markov_head.markov_w2.",
    "logit_head.confidence_head.": "confidence_head.",
    "logit_head.proj.": "confidence_head.proj.",
    "logit_head.confidence_proj.": "confidence_head.proj.",
}
# The drafter borrows these from the target; an export may still carry copies (full vocabulary only:
# a draft vocabulary's lm_head is the drafter's own).
OPTIONAL_SHARED = {"embed_tokens.weight", "lm_head.weight"}
# Other integer dtypes a map may be stored in and still load into vLLM's int64 parameter.
_INTEGER_DTYPES = {"int64", "int32"}

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

    Problems name the tensor and give expected vs found, with the fix where
    the cause is known (a head type or draft vocabulary that the config and the
    tensors disagree on). A draft vocabulary's ``d2t`` / ``t2d`` values are
    always checked (they are small); ``scan_values`` streams every tensor once
    to look for NaN/Inf.
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
    specs = drafter_tensors(cfg)
    report.problems += _tensor_problems(cfg, specs, report.tensors)
    corrupt = any("truncated" in p or "corrupt" in p for p in report.problems)
    if not corrupt:
        report.problems += _vocab_map_problems(path, cfg, specs, report.tensors)
    if scan_values and not corrupt:
        report.problems += _non_finite_problems(path, list(report.tensors))
    return report


def _tensor_problems(cfg: DSparkConfig, specs: dict[str, TensorSpec],
                     tensors: dict[str, HeaderEntry]) -> list[str]:
    """Missing, misshapen, mistyped and unexpected tensors, each named with what was expected."""
    problems: list[str] = []
    for name, spec in specs.items():
        entry = tensors.get(name)
        if entry is None:
            if spec.required:
                problems.append(_missing(cfg, name, spec))
            continue
        if entry.shape != spec.shape:
            problems.append(_misshapen(cfg, name, spec, entry))
        problems += _dtype_problems(cfg, name, spec, entry)
    for name, entry in tensors.items():
        if name not in specs:
            problems.append(_unexpected(cfg, entry))
    return problems


def _missing(cfg: DSparkConfig, name: str, spec: TensorSpec) -> str:
    shape = f"expected shape {list(spec.shape)}, dtype {spec.dtype or cfg.dtype}"
    if name == "lm_head.weight":
        return (f"lm_head.weight: missing ({shape}); a draft-vocabulary drafter (draft_vocab_size "
                f"{cfg.draft_vocab_size}) scores with its own LM head over those ids, and the target's "
                f"[{cfg.vocab_size}, {cfg.hidden_size}] head cannot stand in for it: re-export the checkpoint with "
                "its lm_head, or drop draft_vocab_size if the drafter was trained on the full vocabulary")
    if name == "d2t":
        return (f"d2t: missing ({shape}); a draft-vocabulary drafter needs it to turn drafted ids into target "
                "ids (target id = draft id + d2t[draft id]): re-export the checkpoint with d2t")
    if name.startswith(("markov_head.gate_proj.", "markov_head.joint_proj.")):
        return (f"{name}: missing ({shape}: {spec.what}); markov_head_type is {cfg.markov_head_type!r}, whose "
                f"head needs it: check {cfg.key('markov_head_type')} against how the drafter was trained")
    return f"{name}: missing ({shape})"


def _misshapen(cfg: DSparkConfig, name: str, spec: TensorSpec, entry: HeaderEntry) -> str:
    if name in OPTIONAL_SHARED and not spec.parameter:
        return (f"{entry.stored_name}: shape {list(entry.shape)} is inconsistent with the target-shared shape "
                f"{list(spec.shape)} (vocab_size x hidden_size)")
    what = f" ({spec.what})" if spec.what else ""
    return f"{name}: shape {list(entry.shape)} but the config implies {list(spec.shape)}{what}"


def _dtype_problems(cfg: DSparkConfig, name: str, spec: TensorSpec, entry: HeaderEntry) -> list[str]:
    if spec.dtype is not None:
        allowed = _INTEGER_DTYPES if spec.dtype == "int64" else {spec.dtype}
        if entry.dtype not in allowed:
            return [f"{name}: dtype {entry.dtype}, expected {spec.dtype} ({spec.what})"]
        return []
    # The confidence head is kept in fp32 by some exports; every other tensor follows the config.
    allowed = {cfg.dtype} | ({"float32"} if name.startswith("confidence_head.") else set())
    if name in OPTIONAL_SHARED and not spec.parameter:
        allowed |= {"bfloat16", "float16", "float32"}  # a copy of the target's, only ever dropped
    if entry.dtype not in allowed:
        return [f"{name}: dtype {entry.dtype} but the config says {cfg.dtype}"]
    return []


def _unexpected(cfg: DSparkConfig, entry: HeaderEntry) -> str:
    name = entry.name
    for prefix, head in (("markov_head.gate_proj.", "gated"), ("markov_head.joint_proj.", "rnn")):
        if name.startswith(prefix):
            return (f"{entry.stored_name}: present, but markov_head_type is {cfg.markov_head_type!r}; this is a "
                    f"{head!r} head's tensor: set {cfg.key('markov_head_type')} to {head!r} if the drafter was "
                    "trained with it")
    if name in ("d2t", "t2d"):
        return (f"{entry.stored_name}: present, but the config has no draft vocabulary (draft_vocab_size absent): "
                f"set draft_vocab_size to the drafter's (d2t has {entry.shape[0] if entry.shape else '?'} entries)")
    return (f"{entry.stored_name}: unexpected tensor (shape {list(entry.shape)}); "
            "not part of a DSpark drafter with this config")


def _vocab_map_problems(path: Path, cfg: DSparkConfig, specs: dict[str, TensorSpec],
                        tensors: dict[str, HeaderEntry]) -> list[str]:
    """``d2t`` / ``t2d`` values against the target vocabulary (when both are present and well-shaped)."""
    if cfg.draft_vocab_size is None or "d2t" not in tensors:
        return []
    names: list[str] = [n for n in ("d2t", "t2d") if n in tensors and tensors[n].shape == specs[n].shape]
    if "d2t" not in names:
        return []
    maps = dict(iter_tensors(path, names=names))
    problems = d2t_problems(maps["d2t"], cfg.vocab_size)
    if "t2d" in maps:
        problems += t2d_problems(maps["t2d"], maps["d2t"], cfg.vocab_size)
    return problems


def _non_finite_problems(path: Path, names: list[str]) -> list[str]:
    problems = []
    for name, tensor in iter_tensors(path, names=names):
        if tensor.is_floating_point():
            bad = ~torch.isfinite(tensor)
            if bool(bad.any()):
                nan = int(torch.isnan(tensor).sum())
                inf = int(bad.sum()) - nan
                problems.append(f"{name}: contains {nan} NaN and {inf} Inf values")
    return problems


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
    shared = _shared_copies(cfg)
    state = {name: t for name, t in iter_tensors(path, device=device) if name not in shared}
    return cfg, state


def _shared_copies(cfg: DSparkConfig) -> set[str]:
    """Names that are only copies of the target's tensors (dropped at load: the target's are shared)."""
    return {name for name, spec in drafter_tensors(cfg).items()
            if name in OPTIONAL_SHARED and not spec.parameter}


def load_reference_model(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A ``DSparkDraftModel`` with the checkpoint's weights."""
    from vllm_dspark.model.reference import DSparkDraftModel

    cfg, state = load_checkpoint(path, device=device)
    with torch.device("meta"):
        model = DSparkDraftModel(cfg)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"load_reference_model: the reference drafter does not hold this checkpoint's tensors "
                         f"({cfg.family} family, {cfg.backbone} layers, markov_head_type {cfg.markov_head_type!r}, "
                         f"draft_vocab_size {cfg.draft_vocab_size}): {exc}") from None
    # Non-persistent buffers were created on the meta device with the module.
    model.rope_inv_freq = rope_inv_freq_and_scale(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)[0].to(device)
    return model.to(dtype=dtype)


def _export(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t.detach().to("cpu")
    return (t.to(dtype) if t.is_floating_point() else t).contiguous()


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
    expected = required_shapes(config)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"save_checkpoint: state dict lacks {missing}")
    # Float tensors in the export dtype; a draft vocabulary's id maps keep theirs (int64 d2t, bool t2d).
    optional = [k for k in ("t2d",) if k in state and k in drafter_tensors(config)]
    tensors = {k: _export(state[k], dtype) for k in [*expected, *optional]}
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
