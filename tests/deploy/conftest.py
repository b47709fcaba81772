"""Shared fixtures of the deployment tests: a tiny target + DSpark drafter, and a local Ray head.

The ``ray`` marker selects the tests that start a Ray cluster (they run in the
default suite; deselect with ``-m "not ray"``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

VOCAB = 384
# What every engine the deployment tests start needs on a small CPU machine.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",          # GiB per worker; the default is far more than needed
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # auto-binding wants one NUMA node per TP rank
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "ray: starts a local Ray cluster and vLLM engines on it (runs in the default suite; "
                   "deselect with -m 'not ray')")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """A near-bigram Qwen3 target (head_dim 64, 4 heads / 2 KV heads) and a DSpark drafter whose
    bigram table is wrong for a quarter of the tokens (so drafts are partly rejected)."""
    import torch

    from vllm_dspark.testing.tiny import drafter_config_for, make_drafter, make_target, random_bigram

    base = tmp_path_factory.mktemp("deploy_models")
    bigram = random_bigram(VOCAB, seed=3)
    target = make_target(base / "target", vocab_size=VOCAB, num_heads=4, num_kv_heads=2, head_dim=64,
                         num_layers=4, bigram=bigram, dtype=torch.float32)
    draft_bigram = bigram.clone()
    wrong = torch.arange(0, VOCAB, 4)
    draft_bigram[wrong] = (bigram[wrong] + 1) % 256
    draft = make_drafter(base / "draft", drafter_config_for(target), mode="oracle", bigram=draft_bigram)
    return {"target": str(target), "draft": str(draft), "bigram": bigram}


@pytest.fixture(scope="session")
def engine_env() -> dict[str, str]:
    return dict(ENGINE_ENV)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_head():
    """``ray start --head --block`` on 127.0.0.1 with two units of the test-only resource.

    Runs in its own session and is killed (that session only, never ``ray stop``,
    which would stop every Ray on the machine) when the tests end. Yields the
    address for ``RAY_ADDRESS``.
    """
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray[default]==2.60.0'")
    from vllm_dspark.deploy.ray_cpu import RAY_CPU_TEST_RESOURCE

    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="rdsp_", dir="/tmp")  # short: Ray's socket paths have a length limit
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    assert ray_bin, "the `ray` command is missing; pip install 'ray[default]==2.60.0'"
    log_path = Path(temp_dir) / "head.log"
    log = open(log_path, "w")
    cmd = [ray_bin, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
           "--num-cpus", "2", "--resources", json.dumps({RAY_CPU_TEST_RESOURCE: 2}),
           "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp_dir]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {proc.returncode}: {log_path.read_text()[-3000:]}")
            r = subprocess.run([ray_bin, "status", "--address", address], capture_output=True, text=True)
            if r.returncode == 0 and RAY_CPU_TEST_RESOURCE in r.stdout:
                break
            if time.time() > deadline:
                raise RuntimeError(f"Ray head at {address} not up after 120 s: {r.stdout[-2000:]}{r.stderr[-2000:]}")
            time.sleep(2)
        yield address
    finally:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # the head's children share its session: none may outlive the tests
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
