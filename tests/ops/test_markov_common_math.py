"""The shared per-element math, checked on the host without torch's extension.

``csrc/markov_common.h`` is what both the CPU twin and the CUDA kernels run;
the CUDA-only parts of it (the fp32 Gumbel bounds of the GPU pruning pass) get
no coverage from the CPU op tests, so a small C++ program
(``tests/ops/cpp/check_markov_math.cpp``) checks them here:

* ``gumbel_bounds`` (GPU) and the CPU twin's bound tables enclose
  ``gumbel_exact`` on every bucket edge, both ends of the range and a stride
  over all 2^32 hashes;
* the C++ hash and noise equal the PyTorch reference's bit for bit.

Skipped when no C++ compiler is on PATH.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from vllm_dspark.ops.markov_reference import gumbel_hash, gumbel_noise

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler on PATH")


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    exe = tmp_path_factory.mktemp("markov_math") / "check_markov_math"
    src = ROOT / "tests" / "ops" / "cpp" / "check_markov_math.cpp"
    subprocess.run([CXX, "-O2", "-std=c++17", f"-I{ROOT / 'csrc'}", str(src), "-o", str(exe)],
                   check=True, timeout=300)
    return exe


def test_gumbel_bounds_enclose_the_exact_noise(checker):
    proc = subprocess.run([str(checker), "bounds"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _, checked, w_cuda, w_table = proc.stdout.split()
    assert int(checked) > 4_000_000
    assert float(w_cuda) < 2e-3  # the GPU bounds stay tight enough to prune
    assert float(w_table) < 0.05  # CPU table buckets in the body of the distribution


def test_cpp_hash_and_noise_equal_the_reference(checker):
    proc = subprocess.run([str(checker), "hashes"], capture_output=True, text=True, timeout=60,
                          check=True)
    rows = [line.split() for line in proc.stdout.strip().splitlines()]
    assert len(rows) > 100
    for seed, pos, j, h, gbits in rows:
        seeds = torch.tensor([int(seed)])
        ref_h = gumbel_hash(seeds, int(pos), int(j) + 1)[0, int(j)].item()
        assert ref_h == int(h), (seed, pos, j)
        g = gumbel_noise(seeds, int(pos), int(j) + 1)[0, int(j)].item()
        assert struct.unpack("<I", struct.pack("<f", g))[0] == int(gbits), (seed, pos, j)
