"""Ray listens only where it is told.

1. The test cluster (``ray_cluster`` in ``conftest.py``: ``--node-ip-address 127.0.0.1``,
   ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, token authentication) opens no listener on
   0.0.0.0 / :: or on any address but 127.0.0.1: GCS, raylet (node manager, object
   manager), runtime-env agent, Ray client server, autoscaler metrics, and the core-worker
   ports of a driver and an actor are each checked.

2. What Ray 2.60 does with a node address that is not loopback (what a deployment passes:
   ``--node-ip-address 10.0.0.11``), shown precisely with 127.0.0.2, which Ray does not
   treat as localhost. It runs in a private network namespace (``unshare -rn``) when the
   kernel allows one, so nothing is exposed; otherwise in this one, with token
   authentication on, for the few seconds it takes. The GCS, the raylet's two ports and every
   core worker (drivers, actors) listen on all interfaces whatever the options, and so does
   the autoscaler's metrics endpoint: ``docs/deployment.md`` gives the firewall rule. The
   runtime-env agent and the Ray client server bind to the node address.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.conftest import _free_port, ray_auth_env
from tests.deploy.ray_bind_probe import start_driver, stop_driver
from tests.listeners import WILDCARDS, listeners, session_pids

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray[default]==2.60.0'")
ROOT = Path(__file__).resolve().parents[2]


def _table(found: list[dict]) -> str:
    return "\n".join(f"  {x['process']:<28} pid {x['pid']:<7} {x['address']}:{x['port']}" for x in found)


def test_test_cluster_listens_on_loopback_only(ray_cluster):
    proc, driver_pid, actor_pid = start_driver(ray_cluster["address"], dict(os.environ))
    try:
        pids = sorted(set(session_pids(ray_cluster["proc"].pid)) | {driver_pid, actor_pid})
        found = listeners(pids, {driver_pid: "driver", actor_pid: "actor"})
    finally:
        stop_driver(proc)
    table = _table(found)
    wrong = [x for x in found if x["address"] != "127.0.0.1"]
    assert not wrong, f"Ray listeners not on 127.0.0.1:\n{_table(wrong)}\nall:\n{table}"
    # Not vacuous: every kind of listener is there.
    by = {}
    for x in found:
        by.setdefault(x["process"], []).append(x["port"])
    assert ray_cluster["port"] in by.get("gcs_server", []), table
    assert len(by.get("raylet", [])) >= 2, table  # node manager + object manager
    assert by.get("driver") and by.get("actor"), table  # core-worker gRPC ports
    assert by.get("ray::RuntimeEnvAgent"), table
    assert any(p.startswith("ray.util.client") for p in by), table  # Ray client server
    assert any(p == "monitor.py" for p in by), table  # autoscaler metrics (44217)


def _probe_non_loopback(node_ip: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    env.update(ray_auth_env())
    env["AUTOSCALER_METRIC_PORT"] = str(_free_port())  # not the fixed 44217 another cluster may hold
    env["DASHBOARD_METRIC_PORT"] = str(_free_port())
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "tests.deploy.ray_bind_probe", "--node-ip", node_ip]
    where = "this network namespace (token authentication on)"
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0:
        cmd = [unshare, "-rn", *cmd, "--lo-up"]
        where = "a private network namespace (unshare -rn)"
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), where


def test_non_loopback_node_ip_what_ray_260_binds():
    node_ip = "127.0.0.2"  # not "localhost" to Ray, so it behaves as with a real node address
    res, where = _probe_non_loopback(node_ip)
    found = res["listeners"]
    table = _table(found)
    note = f"(node address {node_ip}, run in {where})\n{table}"
    assert all(x["address"] in WILDCARDS | {node_ip, "127.0.0.1"} for x in found), note

    def addrs(pred) -> set[str]:
        return {x["address"] for x in found if pred(x)}

    # Bound to the node address (and 127.0.0.1): what the docs need no firewall rule for.
    assert addrs(lambda x: x["process"] == "ray::RuntimeEnvAgent") == {node_ip}, note
    assert addrs(lambda x: x["process"].startswith("ray.util.client")) == {node_ip, "127.0.0.1"}, note
    # On every interface whatever the options (Ray 2.60's limitation; docs/deployment.md gives the
    # firewall rule). If one of these now binds the node address, update that section.
    gcs = [x for x in found if x["process"] == "gcs_server"]
    assert res["gcs_port"] in {x["port"] for x in gcs} and {x["address"] for x in gcs} <= WILDCARDS, note
    raylet = [x for x in found if x["process"] == "raylet"]
    assert len(raylet) == 2 and {x["address"] for x in raylet} <= WILDCARDS, note
    for role in ("driver", "actor", "monitor.py"):  # core workers; the autoscaler's metrics endpoint
        got = addrs(lambda x, r=role: x["process"] == r)
        assert got and got <= WILDCARDS, f"{role}: {got}\n{note}"
