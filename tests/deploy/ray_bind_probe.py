"""Which TCP listeners a Ray cluster opens, and on which addresses.

Helpers for ``test_ray_listeners.py``, and a script: ``python -m tests.deploy.ray_bind_probe
--node-ip 127.0.0.2`` starts a Ray head with that node address (plus a driver with an actor,
so core-worker ports are open too), prints every listener of those processes as JSON and
stops the head. Run under ``unshare -rn`` (a private network namespace with only a loopback
interface), a listener on every interface is exposed to nobody.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time

from tests.listeners import WILDCARDS, listeners, session_pids  # noqa: F401  (re-exported)

DRIVER = r"""
import os, sys, ray
kw = {"_node_ip_address": sys.argv[2]} if len(sys.argv) > 2 else {}
ray.init(address=sys.argv[1], log_to_driver=False, **kw)

@ray.remote(num_cpus=0)
class Probe:
    def pid(self):
        return os.getpid()

actor = Probe.remote()
print("READY", os.getpid(), ray.get(actor.pid.remote()), flush=True)
sys.stdin.read()  # until the test closes stdin
"""


def start_driver(address: str, env: dict[str, str], node_ip: str | None = None,
                 timeout: float = 120.0) -> tuple[subprocess.Popen, int, int]:
    """A Ray driver with one actor; returns (process, driver pid, actor pid). Close its stdin to end it."""
    cmd = [sys.executable, "-c", DRIVER, address] + ([node_ip] if node_ip else [])
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    buf = ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            stop_driver(proc)
            raise RuntimeError(f"the Ray driver did not get its actor up (rc {proc.returncode}): "
                               f"{buf[-2000:]}{proc.stderr.read()[-3000:]}")
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
        if ready:
            line = proc.stdout.readline()
            buf += line
            if line.startswith("READY"):
                _, driver_pid, actor_pid = line.split()
                return proc, int(driver_pid), int(actor_pid)


def stop_driver(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
        proc.wait(timeout=30)
    except (subprocess.TimeoutExpired, OSError, ValueError):
        pass
    if proc.poll() is None:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def probe(node_ip: str, env: dict[str, str], extra: tuple[str, ...] = ()) -> dict:
    """Start a head on ``node_ip`` and a driver with an actor; return every listener they opened."""
    from tests.deploy.conftest import start_ray_head, stop_ray_head

    head = start_ray_head(node_ip, env, extra=extra)
    try:
        proc, driver_pid, actor_pid = start_driver(head["address"], env, node_ip)
        try:
            time.sleep(2)  # the workers Ray pre-starts open their ports a moment later
            pids = sorted(set(session_pids(head["proc"].pid)) | {driver_pid, actor_pid})
            found = listeners(pids, {driver_pid: "driver", actor_pid: "actor"})
        finally:
            stop_driver(proc)
    finally:
        stop_ray_head(head)
    return {"node_ip": node_ip, "gcs_port": head["port"], "listeners": found}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--node-ip", required=True)
    p.add_argument("--lo-up", action="store_true", help="bring the loopback interface up first (new netns)")
    args, extra = p.parse_known_args(argv)
    if args.lo_up:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    print(json.dumps(probe(args.node_ip, dict(os.environ), tuple(extra))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
