"""The wheel users install holds the runtime package, and nothing of the workshop beside it.

Built as ``pip wheel .`` builds it, from a copy of the checkout's files (what git tracks or would
track: no stale ``build/`` folder leaks into it), with the compiled op left out
(``VLLM_DSPARK_NO_EXT=1``: the op is a build product, not a file list question).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What serving and users' commands need (a sample: the plugin, the CLI, deployment, the drafter).
REQUIRED = ("vllm_dspark/plugin.py", "vllm_dspark/tools/cli.py", "vllm_dspark/tools/cpu_setup.py",
            "vllm_dspark/tools/prompt_record.py", "vllm_dspark/tools/deploy/batch.py",
            "vllm_dspark/spec_decode/v1/proposer.py", "vllm_dspark/assets/smollm2/dspark/model.safetensors",
            "vllm_dspark/assets/smollm2/dspark/token_frequency.json",
            "vllm_dspark/assets/smollm2/dspark/copy_prior.json")
# The workshop, wherever it once lived in the package.
FORBIDDEN = ("benchmarks/", "training/", "tests/", "scripts/", "vllm_dspark/tools/bench/",
             "vllm_dspark/tools/training/", "vllm_dspark/tools/tiny_pair.py", "vllm_dspark/tools/deploy/ray_cpu.py",
             "vllm_dspark/assets/smollm2/dflash/")


def _checkout_copy(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know the tree's files")
    src = _checkout_copy(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("wheel")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(out), str(src)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "VLLM_DSPARK_NO_EXT": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    (wheel,) = out.glob("vllm_dspark-*.whl")
    return zipfile.ZipFile(wheel).namelist()


def test_the_wheel_holds_what_serving_and_the_cli_need(wheel_names):
    missing = [n for n in REQUIRED if n not in wheel_names]
    assert not missing, missing
    tops = {n.split("/")[0] for n in wheel_names}
    assert tops == {"vllm_dspark", "vllm_dspark-0.1.0.dist-info"}, tops


def test_the_wheel_holds_no_benchmark_training_or_test_module(wheel_names):
    leaked = [n for n in wheel_names if n.startswith(FORBIDDEN)]
    assert not leaked, leaked
