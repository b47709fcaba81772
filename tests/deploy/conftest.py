"""Shared fixtures of the deployment tests: a tiny target + DSpark drafter, and a local Ray head.

The ``ray`` marker selects the tests that start a Ray cluster (they run in the
default suite; deselect with ``-m "not ray"``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import free_port as _free_port  # test_ray_listeners imports it from here too

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

    from tests.helpers import tiny_pair
    from tests.tiny_pair import random_bigram

    draft_bigram = random_bigram(VOCAB, seed=3)
    wrong = torch.arange(0, VOCAB, 4)
    draft_bigram[wrong] = (draft_bigram[wrong] + 1) % 256
    pair = tiny_pair(tmp_path_factory.mktemp("deploy_models"), vocab=VOCAB, seed=3, draft_bigram=draft_bigram,
                     target={"num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "num_layers": 4,
                             "dtype": torch.float32})
    return {"target": pair.target, "draft": pair.draft, "bigram": pair.bigram}


@pytest.fixture(scope="session")
def engine_env() -> dict[str, str]:
    return dict(ENGINE_ENV)


# Environment of the test cluster: set in this process for the whole session (so ``ray start``,
# ``ray status``, the engines' Ray drivers and every worker get it) and restored afterwards.
#
# * RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: on Linux, Ray 2.60 replaces ``--node-ip-address
#   127.0.0.1`` by the machine's outward address (``services.resolve_ip_for_localhost``), and
#   then its GCS, raylet, object manager, agents and workers listen on every interface. With
#   this switch off, Ray keeps 127.0.0.1 as the node address, and every listener binds to it
#   (``tests/deploy/test_ray_listeners.py`` checks each one). Clients need it too: they
#   resolve a 127.0.0.1 address the same way, and would then knock on the outward address.
# * RAY_AUTH_MODE=token with a random token: Ray's token authentication, on for every process
#   of the cluster and every client of it.
# VLLM_HOST_IP: vLLM's Ray executor pins its first placement-group bundle to the driver's node
# ("node:<VLLM_HOST_IP or the machine's primary address>"); the test cluster's only node is
# 127.0.0.1, as the deployment scripts set it to the address the node was started with.
RAY_ENV_LOCAL = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "VLLM_HOST_IP": "127.0.0.1"}


def ray_auth_env() -> dict[str, str]:
    import secrets

    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def _refresh_imported_ray(enable_cluster: bool | None) -> bool | None:
    """Make a Ray already imported in this process see the environment just set.

    ``ray_constants.ENABLE_RAY_CLUSTER`` is read once at import, and Ray's C++ config caches
    ``RAY_AUTH_MODE``; engine processes forked from this one inherit both. Returns the
    previous ``ENABLE_RAY_CLUSTER`` (None: Ray not imported yet).
    """
    consts = sys.modules.get("ray._private.ray_constants")
    previous = None
    if consts is not None:
        previous = consts.ENABLE_RAY_CLUSTER
        if enable_cluster is not None:
            consts.ENABLE_RAY_CLUSTER = enable_cluster
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None and hasattr(raylet, "Config"):
        raylet.Config.initialize("")
    return previous


def ray_bin() -> str:
    path = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    assert path, "the `ray` command is missing; pip install 'ray[default]==2.60.0'"
    return path


def start_ray_head(node_ip: str, env: dict[str, str], *, resources: dict | None = None,
                   extra: tuple[str, ...] = ()) -> dict:
    """``ray start --head --block`` in its own session; returns {address, proc, temp_dir, log_path}.

    Waits until ``ray status`` answers (and lists ``resources`` when given). Stop it with
    :func:`stop_ray_head` (kills that session only, never ``ray stop``, which would stop
    every Ray on the machine).
    """
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="rdsp_", dir="/tmp")  # short: Ray's socket paths have a length limit
    log_path = Path(temp_dir) / "head.log"
    log = open(log_path, "w")  # noqa: SIM115  (closed by stop_ray_head)
    cmd = [ray_bin(), "start", "--head", "--block", "--node-ip-address", node_ip, "--port", str(port),
           "--num-cpus", "2", "--include-dashboard", "false", "--dashboard-host", node_ip,
           "--disable-usage-stats", "--temp-dir", temp_dir, *extra]
    if resources:
        cmd += ["--resources", json.dumps(resources)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    head = {"address": f"{node_ip}:{port}", "port": port, "proc": proc, "temp_dir": temp_dir,
            "log_path": log_path, "log": log, "node_ip": node_ip}
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {proc.returncode}: {log_path.read_text()[-3000:]}")
            r = subprocess.run([ray_bin(), "status", "--address", head["address"]], capture_output=True,
                               text=True, env=env, timeout=60)
            if r.returncode == 0 and all(k in r.stdout for k in (resources or {})):
                break
            if time.time() > deadline:
                raise RuntimeError(f"Ray head at {head['address']} not up after 120 s: "
                                   f"{r.stdout[-2000:]}{r.stderr[-2000:]}")
            time.sleep(2)
    except BaseException:
        stop_ray_head(head)
        raise
    return head


def stop_ray_head(head: dict) -> None:
    proc = head["proc"]
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            break
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # the head's children share its session: none may outlive it
        os.killpg(proc.pid, signal.SIGKILL)
    head["log"].close()
    shutil.rmtree(head["temp_dir"], ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray head on 127.0.0.1 only, with token authentication and two units of the
    test-only resource; the environment its clients need is set in ``os.environ`` meanwhile.

    Yields ``{"address", "port", "proc", "temp_dir", "env", ...}``.
    """
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray[default]==2.60.0'")
    from tests.deploy.ray_cpu import RAY_CPU_TEST_RESOURCE

    # The checkout on the workers' path: the test-only executor's functions (tests/deploy/ray_cpu.py)
    # reach the Ray actors by reference, and tests/ is not installed.
    checkout = str(Path(__file__).resolve().parents[2])
    pythonpath = os.pathsep.join(p for p in (checkout, os.environ.get("PYTHONPATH", "")) if p)
    added = {**RAY_ENV_LOCAL, **ray_auth_env(), "PYTHONPATH": pythonpath}
    saved = {k: os.environ.get(k) for k in added}
    os.environ.update(added)
    previous = _refresh_imported_ray(False)
    try:
        head = start_ray_head("127.0.0.1", dict(os.environ), resources={RAY_CPU_TEST_RESOURCE: 2})
        try:
            yield {**head, "env": added}
        finally:
            stop_ray_head(head)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _refresh_imported_ray(previous)


@pytest.fixture(scope="session")
def ray_head(ray_cluster):
    """The test cluster's address, for ``RAY_ADDRESS`` (see ``ray_cluster``)."""
    return ray_cluster["address"]
