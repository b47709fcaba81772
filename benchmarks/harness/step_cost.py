"""Step-cost measurements: one target step of vLLM (plain, speculative) against a plain-PyTorch floor.

Three kinds of worker process, each started once per dtype and driven by the
parent over a pipe, so that their cells can be interleaved (A B C A B C ...)
while only one of them runs at a time:

- ``engine`` (``spec=False``): vLLM's V1 engine core, in-process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), no speculation. A cell adds ``batch``
  requests and calls ``EngineCore.step()`` + ``post_step()`` (what the engine's
  busy loop calls) itself; every step is timed with ``perf_counter``.
- ``engine`` (``spec=True``): the same with DSpark (``num_speculative_tokens``
  = the block, ``verification: fixed``). Before a cell the proposer's
  ``settings.max_draft_tokens`` is set to ``k``: every request then sends
  exactly ``k`` drafts (``k = 0``: the proposer takes its no-draft path, the
  one the budget takes when drafting does not pay: the drafter only stores the
  new tokens' context K/V and the target runs a 1-token decode step).
- ``floor``: the same checkpoint as a minimal Llama in plain PyTorch (fused QKV
  and gate/up GEMMs, a preallocated KV cache written in place, SDPA), one
  forward of ``q`` tokens per request on a cache holding ``context`` tokens,
  logits for every one of the ``q`` positions (what a verify step needs).

A *cell* is one (process, batch, tokens per request) point, run for at least
``min_seconds`` and ``min_steps`` steps after ``warmup`` steps; only steps whose
scheduled shape is exactly ``batch x (1 + k)`` tokens count. The cell's value
is the median step time. Prompts are distinct random token sequences of
``prompt_len`` tokens, re-added for every cell; with prefix caching, the
re-added prompt's full blocks hit the cache, so a cell starts with a 1-token
"prefill" and the context stays near ``prompt_len`` (recorded per cell).

Per-phase wall times come from timers wrapped around the scheduler's, the model
runner's and the proposer's methods (instance attributes, nothing in vLLM or
in ``spec_decode/`` is edited); a separate, shorter pass under
``torch.profiler`` splits the target forward by operator class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.step_common import EngineSpec, classify_op, random_prompts, run_until, typical_mean
from benchmarks.harness.step_floor import FloorServer

# ------------------------------------------------------------------ pure helpers


def summarize(values: Sequence[float]) -> dict:
    """Median, min, max and count of a list of numbers (a cell's repeats, or a cell's steps)."""
    v = [float(x) for x in values if x is not None and not math.isnan(float(x))]
    if not v:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def ratio_summary(num: Sequence[float], den: Sequence[float]) -> dict:
    """Ratio of two cells measured in the same repeats: median of the per-repeat ratios and their spread.

    Pairing repeat i of the numerator with repeat i of the denominator keeps a slow
    period of the machine from moving only one side.
    """
    pairs = [a / b for a, b in zip(num, den) if a is not None and b and not math.isnan(a) and not math.isnan(b)]
    return summarize(pairs)


def spread_allows(summary: dict | None, goal: float) -> str:
    """Whether a ratio goal (``<= goal``) is met given the spread: "met", "missed" or "within noise"."""
    if not summary or summary.get("n", 0) == 0 or math.isnan(summary["median"]):
        return "not measured"
    if summary["max"] <= goal:
        return "met"
    if summary["min"] > goal:
        return "missed"
    return "within noise"


def interleaved(cells: Sequence[Any], repeats: int) -> list[tuple[int, Any]]:
    """(repeat, cell) in the order A B C A B C ... (every cell once per round, rounds in sequence)."""
    return [(r, c) for r in range(repeats) for c in cells]


def position_bias(step_s: Sequence[float]) -> float:
    """A lockstep cell's median step in even rounds over its median in odd rounds (its first step left out).

    The group's order reverses every round, so an end cell follows itself every
    other round and a middle cell never does. Near 1 when a step does not depend on
    which cell ran before it.
    """
    even, odd = step_s[2::2], step_s[1::2]
    if not even or not odd:
        return float("nan")
    return statistics.median(even) / statistics.median(odd)


def cell_groups(batches: list[int], ks: list[int], qs: list[int], hf: bool, lockstep: bool) -> list[list[tuple]]:
    """The cells of a repeat, in groups that run together. Without ``lockstep`` every cell is its own group.

    With it, each speculative cell is stepped with the floor at its tokens per request, and the
    no-draft one with the plain decode step too: the ratios the goals are about then come from
    steps taken in the same seconds. The floor's other q and its slower references run alone.
    """
    groups: list[list[tuple]] = []
    for b in batches:
        cells = [("plain", b, 0), *(("spec", b, k) for k in ks), *(("floor", b, q) for q in qs),
                 *(("floor_linear", b, q) for q in (1, 8)), *((("hf", b, q) for q in (1, 8)) if hf else ())]
        if not lockstep:
            groups += [[c] for c in cells]
            continue
        paired = set()
        for k in ks:
            g = [("plain", b, 0), ("spec", b, 0), ("floor", b, 1)] if k == 0 else [("spec", b, k), ("floor", b, 1 + k)]
            groups.append(g)
            paired.update(g)
        if 0 not in ks:
            groups.append([("plain", b, 0), ("floor", b, 1)])
            paired.update(groups[-1])
        groups += [[c] for c in cells if c not in paired]
    return groups


def linear_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs (0 for fewer than two points)."""
    pts = [(float(x), float(y)) for x, y in zip(xs, ys) if y is not None and not math.isnan(float(y))]
    if len(pts) < 2:
        return 0.0
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else 0.0


def step_phases(t: dict) -> dict:
    """Per-step phase times (s) from the raw method timers of one step (see :class:`Timers` names).

    Nested timers are turned into exclusive phases:
    ``scheduler`` (schedule, update_from_output, post_step: handing the drafts to the scheduler),
    ``input_prep`` (execute_model outside the forward and the logits: persistent-batch update,
    input ids/positions, attention metadata), ``forward`` (the target model, aux capture included),
    ``aux_capture`` (the adds that keep the hidden states of the drafter's target layers; inside
    ``forward``, also listed on its own), ``logits``, ``sampler``, ``rejection_sampler``,
    ``drafter`` (DSparkProposer.propose), ``draft_glue`` (the runner's propose_draft_token_ids
    outside propose: the aux hidden states' concat, next-token preparation, the copy of the drafts),
    ``bookkeeping``, ``sample_other`` and ``engine_other`` (the rest of the step).
    """
    g = lambda k: float(t.get(k, 0.0))  # noqa: E731
    out = {
        "scheduler": g("schedule") + g("update_from_output") + g("post_step"),
        "input_prep": max(0.0, g("execute_model") - g("forward") - g("logits")),
        "forward": g("forward"),
        "aux_capture": g("aux_capture"),
        "logits": g("logits"),
        "sampler": g("sampler"),
        "rejection_sampler": g("rejection_sampler"),
        "drafter": g("propose"),
        "draft_glue": max(0.0, g("draft") - g("propose")),
        "bookkeeping": g("bookkeeping"),
    }
    out["sample_other"] = max(0.0, g("sample_tokens") - g("sampler") - g("rejection_sampler") - g("draft")
                              - g("bookkeeping"))
    inner = g("schedule") + g("update_from_output") + g("post_step") + g("execute_model") + g("sample_tokens")
    out["engine_other"] = max(0.0, g("step") - inner)
    out["step"] = g("step")
    out["target_step"] = g("step") - g("propose")
    return out


# ------------------------------------------------------------------ machine record


def machine_record() -> dict:
    """CPU model and flags (the bf16 ones in particular), load, and what else is running."""
    rec: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = {}
        for line in out.splitlines():
            if ":" in line:
                k, v = line.split(":", 1)
                fields[k.strip()] = v.strip()
        flags = fields.get("Flags", "").split()
        rec["cpu"] = {k: fields.get(k) for k in ("Model name", "Vendor ID", "CPU family", "Model", "CPU(s)",
                                                   "Thread(s) per core", "Core(s) per socket", "L2 cache",
                                                   "L3 cache", "Hypervisor vendor")}
        rec["cpu"]["bf16_flags"] = sorted(f for f in flags if "bf16" in f or "amx" in f)
        rec["cpu"]["avx512_flags"] = sorted(f for f in flags if f.startswith("avx512"))
        rec["cpu"]["avx512_bf16"] = "avx512_bf16" in flags
        rec["lscpu_flags"] = " ".join(flags)
    except (OSError, subprocess.SubprocessError) as exc:
        rec["cpu"] = {"error": str(exc)}
    rec["load"] = load_snapshot()
    return rec


def load_snapshot(exclude_pids: Iterable[int] = ()) -> dict:
    """Load average and the busiest processes (``ps``), to show whether the machine was quiet."""
    snap: dict[str, Any] = {}
    with contextlib.suppress(OSError):
        snap["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    try:
        ps = subprocess.run(["ps", "-eo", "pid,stat,pcpu,etime,comm", "--sort=-pcpu"], capture_output=True,
                            text=True, timeout=10).stdout.splitlines()
        ex = {str(p) for p in exclude_pids}
        snap["top"] = [ln.strip() for ln in ps[1:8] if ln.split()[0] not in ex]
    except (OSError, subprocess.SubprocessError):
        pass
    return snap


def cpu_jiffies(pids: Iterable[int]) -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of ``pids`` and their threads) from /proc.

    The difference over a cell, machine minus ours, is the CPU time other processes took
    while the cell ran: the record keeps it per cell, so a disturbed cell can be seen.
    """
    busy = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        busy = sum(f) - f[3] - (f[4] if len(f) > 4 else 0)  # all but idle and iowait
    mine = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            st = Path(f"/proc/{pid}/stat").read_text()
            fields = st[st.rindex(")") + 2:].split()
            mine += int(fields[11]) + int(fields[12])  # utime + stime (all threads)
    return busy, mine


class ForeignCPU:
    """CPU seconds other processes used while a block ran (see :func:`cpu_jiffies`)."""

    def __init__(self, pids: Iterable[int]):
        self.pids = [p for p in pids if p]
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @contextlib.contextmanager
    def measure(self, out: dict):
        b0, m0 = cpu_jiffies(self.pids)
        t0 = time.monotonic()
        try:
            yield
        finally:
            b1, m1 = cpu_jiffies(self.pids)
            wall = time.monotonic() - t0
            foreign = max(0, (b1 - b0) - (m1 - m0)) / self.tick
            out["foreign_cpu_s"] = foreign
            out["wall_s"] = wall
            out["foreign_cpu_share"] = foreign / wall if wall > 0 else 0.0  # in CPUs (0..ncpu)


# ------------------------------------------------------------------ timers (engine side)


class Timers:
    """Wall-clock timers around bound methods, accumulated per step.

    ``wrap(obj, attr, name)`` replaces ``obj.attr`` (an instance attribute shadowing
    the class method) by a timed call (two ``perf_counter`` reads). While
    ``profiling`` is set, the call also opens a ``record_function`` scope
    ``bench: name``, so the profiler pass attributes operators to the same phases;
    timed cells run without it (a scope costs microseconds).
    """

    def __init__(self) -> None:
        self.cur: dict[str, float] = {}
        self.profiling = False
        self._undo: list[Callable[[], None]] = []

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        import torch

        fn = getattr(obj, attr, None)
        if fn is None:
            return
        cur = self.cur
        record = torch.profiler.record_function
        scope = f"bench: {name}"

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                if self.profiling:
                    with record(scope):
                        return fn(*a, **kw)
                return fn(*a, **kw)
            finally:
                cur[name] = cur.get(name, 0.0) + time.perf_counter() - t0

        had = attr in vars(obj)
        old = vars(obj).get(attr)
        setattr(obj, attr, timed)

        def undo():
            if had:
                setattr(obj, attr, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, attr)
        self._undo.append(undo)

    def take(self) -> dict[str, float]:
        out = dict(self.cur)
        self.cur.clear()
        return out

    def unwrap(self) -> None:
        while self._undo:
            self._undo.pop()()


# ------------------------------------------------------------------ worker processes


def _serve(conn, spec: EngineSpec, env: dict) -> None:
    """Child process main: build the engine (or the floor), then answer commands until "quit"."""
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
        server: Any = {"floor": FloorServer, "pair": PairServer}.get(spec.kind, EngineServer)(spec)
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


class PairServer:
    """The plain and the speculative engine in one process, the second reading the first's target weights.

    In separate processes, the speculative engine's forward ran 0.96-1.18x the plain
    one's over 4 builds x 3 lockstep repeats (a throwaway run; ~1.0 in one build,
    1.04-1.18 in the other three): each process's weights land somewhere else in
    memory (:mod:`.shared_weights`). The no-draft step is
    compared with the plain decode step, so the two engines share one copy of the
    weights; their KV caches, activations and the drafter stay their own.
    """

    def __init__(self, spec: EngineSpec):
        from benchmarks.harness.shared_weights import share_weights, target_model  # imports torch

        if sorted(n for n in spec.order if n != "floor") != ["plain", "spec"] or spec.order.count("floor") > 1:
            raise ValueError(f"PairServer: order must name 'plain' and 'spec' once each (and 'floor' at most once), "
                             f"got {spec.order}")
        # The floor (lockstep --floor-in-pair) keeps its own weights, read from the checkpoint, and the
        # threads vLLM's worker bound (threads=None), so that the three time on the same OpenMP pool.
        self.engines: dict[str, Any] = {
            name: FloorServer(dataclasses.replace(spec, kind=name, threads=None)) if name == "floor"
            else EngineServer(dataclasses.replace(spec, kind=name)) for name in spec.order}
        self.weights = [n for n in spec.order if n != "floor"]  # [owner, reader] of the target's weights
        owner, reader = (self.engines[n] for n in self.weights)
        self.shared = share_weights(target_model(reader.llm), target_model(owner.llm))

    def info(self) -> dict:
        engines = {n: e.info() for n, e in self.engines.items()}
        return {"kind": "pair", "order": list(self.engines), "weights": self.weights, "shared_tensors": self.shared,
                "pid": os.getpid(), "threads": engines["plain"]["threads"], "engines": engines}


class EngineProxy:
    """One engine of a :class:`PairServer`'s worker, called like a worker of its own."""

    def __init__(self, worker: Worker, name: str):
        self.worker, self.name = worker, name
        self.spec = dataclasses.replace(worker.spec, kind=name)
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

    def close(self) -> None:  # the pair's worker is closed once, by its owner
        pass


class Worker:
    """A child process running an :class:`EngineServer`, a :class:`PairServer` or a
    :class:`~benchmarks.harness.step_floor.FloorServer`."""

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


def run_lockstep(cells: Sequence[tuple[Any, dict]], min_seconds: float, min_steps: int,
                 max_rounds: int = 400, gap_s: float = 0.0) -> tuple[list[dict], int]:
    """Cells of different workers stepped in turn, one step each per round; (their results, rounds).

    Cells run back to back see different seconds of this machine, whose memory
    bandwidth drifts by 10-20% from one second to the next (see
    :mod:`benchmarks.harness.lockstep`): a ratio of two such cells carries
    that drift. Here every round runs one step of every cell, in reversed order
    on odd rounds, so the cells of a group share the same seconds; one worker
    runs at a time, the others wait on their pipes. Rounds go on until every
    cell has met ``min_seconds`` and ``min_steps`` (or ``max_rounds``).

    ``gap_s``: a pause before every step. Without it, a process's step ran slower
    right after another process's step than after its own: 5-7 ms of a 30 ms step
    at batch 1. libgomp's worker threads spin for a while after a parallel region
    (``GOMP_SPINCOUNT``, 300,000 by default), so the process that has just
    finished keeps both cores busy into the next process's step. A pause of a few
    milliseconds lets them go to sleep; it is not timed, and a serving engine (one
    process) never pays this.
    """
    workers = [w for w, _ in cells]
    if len({id(w) for w in workers}) != len(workers):
        raise ValueError("run_lockstep: one cell per worker (a worker holds one open cell)")
    opened: list[Worker] = []
    elapsed = [0.0] * len(cells)
    counted = [0] * len(cells)
    rounds = 0
    try:
        for w, kw in cells:
            w.call("open_cell", **kw)
            opened.append(w)
        while rounds < max_rounds and any(e < min_seconds or c < min_steps for e, c in zip(elapsed, counted)):
            order = range(len(cells)) if rounds % 2 == 0 else range(len(cells) - 1, -1, -1)
            for i in order:
                if gap_s > 0.0:
                    time.sleep(gap_s)
                dt = workers[i].call("step_cell")
                if dt > 0.0:
                    elapsed[i] += dt
                    counted[i] += 1
            rounds += 1
    finally:
        results = [w.call("close_cell") for w in opened]
    return results, rounds


class EngineServer:
    """vLLM's engine core in this process, with timers around the methods a step goes through."""

    def __init__(self, spec: EngineSpec):
        import torch
        from vllm import LLM

        self.spec = spec
        kw: dict[str, Any] = dict(dtype=spec.dtype, max_model_len=spec.max_model_len, enforce_eager=True,
                                  max_num_seqs=spec.max_num_seqs, seed=0, enable_prefix_caching=True)
        if spec.kind == "spec":
            from vllm_dspark.config import DSparkConfig

            assert spec.draft is not None
            block = DSparkConfig.from_json(Path(spec.draft) / "config.json").num_draft_tokens
            kw["speculative_config"] = {"method": "dspark", "model": spec.draft, "num_speculative_tokens": block,
                                        "dspark": {"verification": "fixed"}}
        self.llm = LLM(model=spec.target, **kw)
        eng = self.llm.llm_engine
        self.engine = eng
        self.core = eng.engine_core.engine_core
        worker = self.core.model_executor.driver_worker
        worker = getattr(worker, "worker", worker)
        self.runner = worker.model_runner
        self.drafter = getattr(self.runner, "drafter", None) if spec.kind == "spec" else None
        self.vocab = int(eng.vllm_config.model_config.get_vocab_size())
        self.block_size = int(eng.vllm_config.cache_config.block_size)
        self.timers = Timers()
        self._install_timers()
        self._cell = 0
        self._prompts: dict[tuple[int, int], list[list[int]]] = {}
        self.threads = torch.get_num_threads()

    def info(self) -> dict:
        d = self.drafter
        return {"kind": self.spec.kind, "dtype": self.spec.dtype, "threads": self.threads, "pid": os.getpid(),
                "block_size": self.block_size, "vocab": self.vocab,
                "max_draft_tokens": None if d is None else int(d.settings.max_draft_tokens),
                "drafter_block": None if d is None else int(d.block),
                "prefix_caching": bool(self.engine.vllm_config.cache_config.enable_prefix_caching),
                "max_num_batched_tokens": int(self.engine.vllm_config.scheduler_config.max_num_batched_tokens),
                "attention_backend": type(getattr(self.runner, "attn_groups", [[None]])[0][0].backend).__name__
                if getattr(self.runner, "attn_groups", None) else None,
                "vllm": __import__("vllm").__version__, "torch": __import__("torch").__version__,
                "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE",
                                                       "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                                                       "LD_PRELOAD")}}

    def _install_timers(self) -> None:
        t, s, r = self.timers, self.core.scheduler, self.runner
        t.wrap(s, "schedule", "schedule")
        t.wrap(s, "update_from_output", "update_from_output")
        t.wrap(s, "update_draft_token_ids", "update_draft_token_ids")
        t.wrap(r, "execute_model", "execute_model")
        t.wrap(r, "_model_forward", "forward")
        t.wrap(r.model, "compute_logits", "logits")
        t.wrap(r, "sample_tokens", "sample_tokens")
        t.wrap(r.sampler, "forward", "sampler")
        if getattr(r, "rejection_sampler", None) is not None:
            t.wrap(r.rejection_sampler, "forward", "rejection_sampler")
        t.wrap(r, "propose_draft_token_ids", "draft")
        t.wrap(r, "_bookkeeping_sync", "bookkeeping")
        if self.drafter is not None:
            t.wrap(self.drafter, "propose", "propose")

    def _set_k(self, k: int) -> None:
        if self.drafter is None:
            if k:
                raise ValueError("the plain engine verifies no drafts")
            return
        block = int(self.drafter.n_draft)
        if not 0 <= k <= block:
            raise ValueError(f"k = {k} outside 0..{block}")
        self.drafter.settings = dataclasses.replace(self.drafter.settings, max_draft_tokens=int(k))

    def _prompts_for(self, batch: int, prompt_len: int) -> list[list[int]]:
        key = (batch, prompt_len)
        if key not in self._prompts:
            self._prompts[key] = random_prompts(batch, prompt_len, self.vocab, seed=1000 + batch)
        return self._prompts[key]

    def _add(self, batch: int, prompt_len: int, max_tokens: int) -> list[str]:
        from vllm import SamplingParams

        self._cell += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        ids = [f"c{self._cell}-{i}" for i in range(batch)]
        for rid, p in zip(ids, self._prompts_for(batch, prompt_len)):
            self.engine.add_request(rid, {"prompt_token_ids": p}, params)
        return ids

    def _finish(self, ids: list[str]) -> None:
        self.engine.abort_request(ids)
        # One step lets the runner drop the aborted requests (the scheduler tells it next step).
        while self.core.scheduler.has_requests():
            out, ran = self.core.step()
            self.core.post_step(ran)

    def _step(self) -> tuple[float, dict, dict]:
        """One engine step as the busy loop runs it: step() then post_step(); (seconds, timers, shape)."""
        sched = self.core.scheduler
        self.timers.take()
        d0 = dict(self.drafter.timings) if self.drafter is not None else None
        t0 = time.perf_counter()
        out, ran = self.core.step()
        t1 = time.perf_counter()
        self.core.post_step(ran)
        t2 = time.perf_counter()
        tm = self.timers.take()
        tm["step"] = t2 - t0
        tm["post_step"] = t2 - t1
        if d0 is not None:
            assert self.drafter is not None
            for k, v in self.drafter.timings.items():
                tm[f"drafter.{k}"] = v - d0.get(k, 0.0)
        so = getattr(sched, "_bench_last", None)
        shape = so or {}
        return t2 - t0, tm, shape

    def _shape_hook(self) -> None:
        sched = self.core.scheduler
        if getattr(sched, "_bench_shape_hooked", False):
            return
        fn = sched.schedule

        def schedule(*a, **kw):
            so = fn(*a, **kw)
            n = list(so.num_scheduled_tokens.values())
            sched._bench_last = {"reqs": len(n), "total": int(so.total_num_scheduled_tokens),
                                 "min": min(n) if n else 0, "max": max(n) if n else 0}
            return so
        sched.schedule = schedule
        sched._bench_shape_hooked = True

    def cell(self, batch: int, k: int = 0, prompt_len: int = 257, min_seconds: float = 0.5, min_steps: int = 5,
             warmup: int = 2, max_steps: int = 400) -> dict:
        """Run ``batch`` requests with ``k`` drafts each; time every step of the uniform shape."""
        self.open_cell(batch, k, prompt_len, warmup)
        try:
            run_until(self.step_cell, min_seconds, min_steps, max_steps)
        finally:
            out = self.close_cell()
        return out

    def open_cell(self, batch: int, k: int = 0, prompt_len: int = 257, warmup: int = 2) -> None:
        """Add the cell's requests and run its warm-up steps; :meth:`step_cell` then times one step a call."""
        self._shape_hook()
        self._set_k(k)
        ids = self._add(batch, prompt_len, max_tokens=self.spec.max_model_len - prompt_len - 16)
        self._run: dict = {"batch": batch, "k": k, "ids": ids, "skipped": 0, "step_s": [], "target_s": [],
                           "model_s": [], "phases": [], "ctx": []}
        try:
            for _ in range(warmup):
                self._step()
        except BaseException:
            self._finish(ids)
            raise

    def step_cell(self) -> float:
        """One step of the open cell: its seconds, or 0.0 when its shape was not the cell's (not counted)."""
        run = self._run
        batch, k = run["batch"], run["k"]
        dt, tm, shape = self._step()
        if shape.get("reqs") != batch or shape.get("total") != batch * (1 + k) or shape.get("min") != 1 + k:
            run["skipped"] += 1
            return 0.0
        run["step_s"].append(dt)
        run["target_s"].append(dt - tm.get("propose", 0.0))  # the step minus the drafter (DSparkProposer.propose)
        run["model_s"].append(tm.get("forward", 0.0) + tm.get("logits", 0.0))  # the target's forward + logits
        run["phases"].append(tm)
        reqs = self.core.scheduler.requests
        run["ctx"].append(statistics.mean(r.num_computed_tokens for r in reqs.values()) if reqs else 0)
        return dt

    def close_cell(self) -> dict:
        run, self._run = self._run, {}
        self._finish(run["ids"])
        times, ctx = run["step_s"], run["ctx"]
        mean_t = typical_mean(run["phases"], times)
        return {"batch": run["batch"], "k": run["k"], "tokens_per_request": 1 + run["k"], "steps": len(times),
                "skipped": run["skipped"], "step_s": times, "target_s": run["target_s"], "model_s": run["model_s"],
                "median_s": statistics.median(times) if times else float("nan"),
                "timers_mean_s": mean_t, "phases_mean_s": step_phases(mean_t) if mean_t else {},
                "context_mean": statistics.mean(ctx) if ctx else None,
                "context_range": [min(ctx), max(ctx)] if ctx else None}

    def capture_logits(self, prompt: list[int], k: int, steps: int = 3) -> list[dict]:
        return capture_vllm_logits(self, prompt, k, steps)

    def profile(self, batch: int, k: int = 0, prompt_len: int = 257, steps: int = 4, warmup: int = 2) -> dict:
        """``steps`` uniform steps under torch.profiler: operator self times by phase and operator class."""
        from torch.profiler import ProfilerActivity, profile

        self._shape_hook()
        self._set_k(k)
        ids = self._add(batch, prompt_len, max_tokens=self.spec.max_model_len - prompt_len - 16)
        inner = getattr(self.runner.model, "model", None)
        extra = Timers()  # per-layer and aux-capture scopes: profiler pass only (31 calls a step)
        extra.profiling = True
        for layer in getattr(inner, "layers", None) or []:
            extra.wrap(layer, "forward", "layer")
        if inner is not None and getattr(inner, "aux_hidden_state_layers", None):
            extra.wrap(inner, "_maybe_add_hidden_state", "aux_capture")
        want = batch * (1 + k)
        per_step: list[dict] = []
        walls: list[float] = []
        try:
            for _ in range(warmup):
                self._step()
            self.timers.profiling = True
            for _ in range(steps * 3):  # one profiler session per step: a stalled step is left out
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    dt, tm, shape = self._step()
                if shape.get("total") == want and shape.get("reqs") == batch:
                    per_step.append(attribute_events(prof.events(), 1))
                    walls.append(dt)
                if len(per_step) >= steps:
                    break
        finally:
            self.timers.profiling = False
            extra.unwrap()
            self._finish(ids)
        return {"batch": batch, "k": k, "steps": len(per_step),
                "profiled_step_s": statistics.median(walls) if walls else float("nan"),
                "ops": typical_mean(per_step, walls)}


SCOPE_PREFIXES = ("bench: ", "gpu_model_runner:", "schedule:")


def attribute_events(events, steps: int) -> dict:
    """Self CPU time (s per step) of the profiler's events, by innermost ``bench:`` scope and operator class.

    Keys are ``scope/class``: the scope is the innermost timer of :class:`Timers` around the
    event (``layer`` for the target's decoder layers, ``forward`` for the rest of the target
    forward: embedding, aux hidden-state adds, final norm), the class that of
    :func:`classify_op`, or ``python`` for time inside a scope but in no operator. Self
    times: an operator's children are not counted twice.
    """
    out: dict[str, float] = {}
    for ev in events:
        if getattr(ev, "device_type", None) is not None and "CPU" not in str(ev.device_type):
            continue
        scope = None
        p = ev
        while p is not None:
            if p.name.startswith("bench: "):
                scope = p.name[len("bench: "):]
                break
            p = p.cpu_parent
        cls = "python" if ev.name.startswith(SCOPE_PREFIXES) else classify_op(ev.name)
        key = f"{scope or 'engine'}/{cls}"
        out[key] = out.get(key, 0.0) + ev.self_cpu_time_total * 1e-6 / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------ vLLM logits for the floor check


def capture_vllm_logits(server: EngineServer, prompt: list[int], k: int, steps: int = 3) -> list[dict]:
    """Batch 1: run ``prompt`` and capture, for ``steps`` uniform steps of 1 + k tokens, the step's input
    ids, its first position, the request's tokens before it, and the target's logits."""
    import torch

    server._shape_hook()
    server._set_k(k)
    runner = server.runner
    got: list[dict] = []
    seen: dict[str, Any] = {}
    fwd, logits_fn = runner._model_forward, runner.model.compute_logits

    def cap_forward(*a, **kw):
        ids = kw.get("input_ids")
        pos = kw.get("positions")
        n = int(server.core.scheduler._bench_last["total"]) if getattr(server.core.scheduler, "_bench_last",
                                                                       None) else 0
        seen["ids"] = None if ids is None else ids[:n].tolist()
        seen["pos"] = None if pos is None else pos[:n].tolist()
        return fwd(*a, **kw)

    def cap_logits(h):
        out = logits_fn(h)
        seen["logits"] = out.float().clone()
        return out

    runner._model_forward = cap_forward
    runner.model.compute_logits = cap_logits
    from vllm import SamplingParams

    server._cell += 1
    rid = f"logits{server._cell}"
    server.engine.add_request(rid, {"prompt_token_ids": prompt},
                              SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, detokenize=False))
    try:
        for _ in range(40):
            if len(got) >= steps:
                break
            req = next(iter(server.core.scheduler.requests.values()), None)
            before = list(req.all_token_ids) if req is not None else []
            seen.clear()
            server._step()
            shape = getattr(server.core.scheduler, "_bench_last", {})
            if shape.get("total") == 1 + k and seen.get("pos") and len(seen["pos"]) == 1 + k \
                    and seen["pos"][0] >= len(prompt):
                p0 = int(seen["pos"][0])
                got.append({"position": p0, "context": before[:p0], "ids": seen["ids"],
                            "logits": seen["logits"][: 1 + k].tolist()})
    finally:
        runner._model_forward = fwd
        runner.model.compute_logits = logits_fn
        server._finish([rid])
    del torch
    return got
