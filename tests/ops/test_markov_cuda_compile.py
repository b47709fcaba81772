"""The CUDA sources keep compiling on machines without a GPU or a CUDA torch.

* every ``csrc/*.cu`` compiles to an sm_90 object with nvcc
  (``scripts/compile_cuda.sh``, the same script CI calls);
* the torch glue ``csrc/*_cuda.cpp`` passes a C++ syntax check against the CPU
  torch's headers. torch 2.13.0+cpu lacks ``c10/cuda/impl/cuda_cmake_macros.h``
  (see shared FACTS, "Building CUDA here"); the check supplies an empty stand-in
  for that one generated header and nothing else.

Skipped when nvcc is not on PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")


def test_cu_sources_compile_for_sm90():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "compile_cuda.sh")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled" in proc.stdout


def _cuda_include() -> Path | None:
    nvcc = Path(os.path.realpath(NVCC))
    for cand in (nvcc.parent.parent / "include", Path("/usr/local/cuda/include"),
                 *sorted(Path("/usr/local").glob("cuda-*/include"))):
        if (cand / "cuda_runtime.h").exists():
            return cand
    return None


def test_cuda_glue_passes_syntax_check(tmp_path):
    from torch.utils import cpp_extension

    cuda_inc = _cuda_include()
    cxx = shutil.which("g++") or shutil.which("c++")
    if cuda_inc is None or cxx is None:
        pytest.skip("no cuda_runtime.h or no C++ compiler")
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    glue = sorted((ROOT / "csrc").glob("*_cuda.cpp"))
    assert glue, "no csrc/*_cuda.cpp"
    incs = [f"-I{p}" for p in cpp_extension.include_paths()]
    for src in glue:
        cmd = [cxx, "-std=c++17", "-fsyntax-only", f"-I{tmp_path}", *incs, f"-I{cuda_inc}",
               f"-I{ROOT / 'csrc'}", f"-I{sys.base_prefix}/include", str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
