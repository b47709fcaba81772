"""The step-cost benchmark's worker: both engines and the floor in one child process, driven over a pipe.

One process, because where each process's weights land in memory biased every repeat of a
start alike: in separate processes the speculative engine's forward ran 0.96-1.18x the plain
one's over 4 builds x 3 lockstep repeats (a throwaway run; ~1.0 in one build, 1.04-1.18 in
the other three; :mod:`.shared_weights`). So the speculative engine reads the plain one's
target weights (or the other way round: builds rotate which is built first), and the floor
times on the same OpenMP threads. A child process, so that each build starts in a fresh one:
a start's weight placement biases all its repeats alike, and the record's spread covers the
builds (``step_cost.measure_dtype``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

from benchmarks.harness.step_common import EngineSpec
from benchmarks.harness.step_engine import EngineServer
from benchmarks.harness.step_floor import FloorServer

PARTS = ("plain", "spec", "floor")


class PairServer:
    """The plain and the speculative engine, the second built reading the first's target weights, and the
    floor; built in ``spec.order``. Their KV caches, activations and the drafter stay their own."""

    def __init__(self, spec: EngineSpec):
        from benchmarks.harness.shared_weights import share_weights, target_model  # imports torch

        if sorted(spec.order) != sorted(PARTS):
            raise ValueError(f"PairServer: order must name 'plain', 'spec' and 'floor' once each, got {spec.order}")
        # The floor keeps its own weights, read from the checkpoint, and the threads vLLM's worker bound.
        self.engines: dict[str, Any] = {
            name: (FloorServer if name == "floor" else EngineServer)(dataclasses.replace(spec, kind=name))
            for name in spec.order}
        self.weights = [n for n in spec.order if n != "floor"]  # [owner, reader] of the target's weights
        owner, reader = (self.engines[n] for n in self.weights)
        self.shared = share_weights(target_model(reader.llm), target_model(owner.llm))

    def info(self) -> dict:
        engines = {n: e.info() for n, e in self.engines.items()}
        return {"kind": "pair", "order": list(self.engines), "weights": self.weights, "shared_tensors": self.shared,
                "pid": os.getpid(), "threads": engines["plain"]["threads"], "engines": engines}


def _serve(conn, spec: EngineSpec, env: dict) -> None:
    """Child process main: build the :class:`PairServer`, then answer commands until "quit"."""
    import threading

    os.environ.update({k: str(v) for k, v in env.items()})
    parent = os.getppid()

    def orphan_watch() -> None:  # the parent died (killed): do not outlive it
        while True:
            time.sleep(2.0)
            if os.getppid() != parent:
                os._exit(3)
    threading.Thread(target=orphan_watch, daemon=True, name="orphan-watch").start()
    try:
        server = PairServer(spec)
        conn.send(("ok", server.info()))
    except Exception:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            cmd, kw = conn.recv()
        except EOFError:
            return
        if cmd == "quit":
            conn.send(("ok", None))
            return
        try:
            target = server.engines[kw.pop("engine")] if "engine" in kw else server
            conn.send(("ok", getattr(target, cmd)(**kw)))
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


class Worker:
    """The child process running a :class:`PairServer`."""

    def __init__(self, spec: EngineSpec, env: dict, log: Callable[[str], None] = print,
                 start_timeout: float = 900.0):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, spec, env), name=f"step-cost-{spec.kind}")
        t0 = time.monotonic()
        self.proc.start()
        if not self.conn.poll(start_timeout):
            self.proc.kill()
            raise RuntimeError(f"{spec.kind} worker did not start in {start_timeout:.0f} s")
        status, info = self.conn.recv()
        if status != "ok":
            self.proc.join(5)
            raise RuntimeError(f"{spec.kind} worker failed to start:\n{info}")
        self.info = {**info, "start_seconds": time.monotonic() - t0}
        log(f"[{spec.kind}/{spec.dtype}] up in {self.info['start_seconds']:.0f} s, "
            f"{self.info.get('threads')} threads")

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def call(self, cmd: str, **kw) -> Any:
        self.conn.send((cmd, kw))
        status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.spec.kind} worker: {cmd} failed:\n{out}")
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("quit")
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


class EngineProxy:
    """One part of the worker (an engine or the floor), called like a worker of its own."""

    def __init__(self, worker: Worker, name: str):
        self.worker, self.name = worker, name
        owner, reader = worker.info["weights"]
        self.info = {**worker.info["engines"][name], "start_seconds": worker.info["start_seconds"],
                     "built": worker.info["order"].index(name),
                     "shares_weights_with": {owner: reader, reader: owner}.get(name),
                     "weights_owner": owner == name}

    @property
    def pid(self) -> int | None:
        return self.worker.pid

    def call(self, cmd: str, **kw) -> Any:
        return self.worker.call(cmd, engine=self.name, **kw)
