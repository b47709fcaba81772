"""The step-cost benchmark's run: what is timed and how (``benchmarks/bench_step_cost.py`` is its command line).

**What is timed.** One child process (:mod:`.step_worker`) holds the plain engine, the
speculative engine and the floor: in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
eager mode (the project's setting), prefix caching on, ``max_num_seqs`` 32. One step is
``EngineCore.step()`` followed by ``EngineCore.post_step()``, exactly what the engine's busy
loop runs per iteration: schedule, the runner's execute_model (input preparation, target
forward, logits) and sample_tokens (sampler or rejection sampler, bookkeeping, the drafter),
update_from_output, and handing the drafts to the scheduler. Not timed: the frontend
(detokenisation, output processing) and inter-process transfers of a multiprocess engine.
``target step`` is that step minus ``DSparkProposer.propose`` (the drafter). For a k-draft step
the proposer's ``settings.max_draft_tokens`` is set to k from the benchmark (``verification:
fixed``), so every request sends exactly k drafts; only steps whose scheduled shape is exactly
batch x (1 + k) tokens are counted (:mod:`.step_engine`). The floor (:mod:`.step_floor`) is one
forward of q tokens per request, logits at all q positions.

**Noise.** Cells run for at least ``--min-seconds`` and ``--min-steps`` steps; every cell of a
dtype is repeated ``--repeats`` times interleaved (all cells, then all cells again, ...) in each
of ``--builds`` starts of the worker; a cell's value is the median of its steps, the record
gives the median over repeats and the spread (min, max); ratios are taken per repeat (both
sides measured in the same round). The cells a goal compares are stepped in turn, one step
each per round (:func:`run_lockstep`): the speculative cell with k drafts and the floor at
1 + k tokens; the no-draft cell, the plain decode cell and the floor at 1 token. Back to back,
their ratio carried the machine's second-to-second drift (the floor alone ranged 22-33 ms over
9 repeats in a record git keeps: ``step-cost-k7-batch1-9-repeats``).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.step_common import EngineSpec, random_prompts
from benchmarks.harness.step_cost_report import analyse, int_keys, json_default, write_outputs


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------ the machine


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


def load_snapshot() -> dict:
    """Load average and the busiest processes (``ps``), to show whether the machine was quiet."""
    snap: dict[str, Any] = {}
    with contextlib.suppress(OSError):
        snap["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    try:
        ps = subprocess.run(["ps", "-eo", "pid,stat,pcpu,etime,comm", "--sort=-pcpu"], capture_output=True,
                            text=True, timeout=10).stdout.splitlines()
        snap["top"] = [ln.strip() for ln in ps[1:8]]
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


def interleaved(cells: Sequence[Any], repeats: int) -> list[tuple[int, Any]]:
    """(repeat, cell) in the order A B C A B C ... (every cell once per round, rounds in sequence)."""
    return [(r, c) for r in range(repeats) for c in cells]


def floor_qs(ks: list[int]) -> list[int]:
    return sorted({1 + k for k in ks} | {1, 8})


def cell_groups(batches: list[int], ks: list[int], qs: list[int]) -> list[list[tuple]]:
    """The cells of a repeat, in groups stepped together (:func:`run_lockstep`).

    Each speculative cell is stepped with the floor at its tokens per request, and the no-draft
    one with the plain decode step too: the ratios the goals are about then come from steps
    taken in the same seconds. The floor's other q and its slower reference run alone.
    """
    groups: list[list[tuple]] = []
    for b in batches:
        cells = [("plain", b, 0), *(("spec", b, k) for k in ks), *(("floor", b, q) for q in qs),
                 *(("floor_linear", b, q) for q in (1, 8))]
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


def run_lockstep(cells: Sequence[tuple[Any, dict]], min_seconds: float, min_steps: int,
                 max_rounds: int = 400, gap_s: float = 0.0) -> tuple[list[dict], int]:
    """Cells of different parts (engines, floor) stepped in turn, one step each per round; (their results, rounds).

    Cells run back to back see different seconds of this machine, whose memory
    bandwidth drifts by 10-20% from one second to the next (see
    :mod:`benchmarks.harness.lockstep`): a ratio of two such cells carries
    that drift. Here every round runs one step of every cell, in reversed order
    on odd rounds, so the cells of a group share the same seconds. Rounds go on
    until every cell has met ``min_seconds`` and ``min_steps`` (or ``max_rounds``).

    ``gap_s``: an untimed pause before every step. When the parts ran in separate
    processes, a process's step ran 5-7 ms (of 30 ms at batch 1) slower right after
    another process's step than after its own: libgomp's worker threads spin for a
    while after a parallel region (``GOMP_SPINCOUNT``, 300,000 by default), so the
    process that had just finished kept both cores busy into the next one's step.
    The parts now share one process and its threads; the committed record still
    paused (20 ms), and a serving engine never pays this.
    """
    workers = [w for w, _ in cells]
    if len({id(w) for w in workers}) != len(workers):
        raise ValueError("run_lockstep: one cell per worker (a worker holds one open cell)")
    opened: list[Any] = []
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


# ------------------------------------------------------------------ one dtype


def start_pair(args, dtype: str, paths: dict, build: int):
    """The worker of one build, and its parts by name (plain, spec, floor)."""
    from benchmarks.harness.step_worker import EngineProxy, Worker

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false"}
    # Builds alternate which engine is built first (and owns the weights), and put the floor first,
    # second or third in turn: what was built later in one process ran faster (harness/lockstep.py).
    order: tuple[str, ...] = ("plain", "spec") if build % 2 == 0 else ("spec", "plain")
    at = build % 3
    order = (*order[:at], "floor", *order[at:])
    worker = Worker(EngineSpec("pair", paths["target"], paths["draft"], dtype, order=order), env, log)
    owner, reader = worker.info["weights"]
    log(f"[pair/{dtype}] {reader} reads {owner}'s target weights ({worker.info['shared_tensors']} "
        f"tensors and packed linears shared); built in the order {', '.join(worker.info['order'])}")
    return worker, {name: EngineProxy(worker, name) for name in ("plain", "spec", "floor")}


def logits_check(plain, spec, floor, prompt: list[int], block: int) -> dict:
    """Max abs logit difference: floor vs vLLM (plain decode steps, a DSpark verify step), and the floor's
    q-token forward vs its q one-token forwards."""
    import torch

    out: dict = {}
    cases = [("plain decode (q=1)", plain, 0, 3), (f"DSpark verify (q={1 + block})", spec, block, 2)]
    for name, eng, k, steps in cases:
        caps = eng.call("capture_logits", prompt=prompt, k=k, steps=steps)
        diffs, top1, scale = [], [], []
        for c in caps:
            ref = torch.tensor(c["logits"])
            got = torch.tensor(floor.call("logits", context_ids=c["context"], ids=c["ids"]))
            diffs.append(float((got - ref).abs().max()))
            top1.append(float((got.argmax(-1) == ref.argmax(-1)).float().mean()))
            scale.append(float(ref.abs().max()))
        out[name] = {"steps": len(caps), "max_abs_diff": max(diffs) if diffs else None,
                     "top1_agreement": min(top1) if top1 else None, "max_abs_logit": max(scale) if scale else None,
                     "positions": [c["position"] for c in caps]}
    if caps:
        c = caps[0]
        a = torch.tensor(floor.call("logits", context_ids=c["context"], ids=c["ids"]))
        b = torch.tensor(floor.call("logits", context_ids=c["context"], ids=c["ids"], one_at_a_time=True))
        out["floor q=8 vs floor q=1 x 8"] = {"max_abs_diff": float((a - b).abs().max())}
    return out


def open_args(parts: dict, kind: str, b: int, x: int, args) -> tuple:
    """(part, open_cell keywords) of a cell."""
    if kind in ("plain", "spec"):
        return parts[kind], dict(batch=b, k=x, prompt_len=args.prompt_len)
    kw = dict(batch=b, q=x, context=args.floor_context)
    return parts["floor"], kw if kind == "floor" else dict(kw, gemm="linear")


def run_group(parts: dict, group: list[tuple], args) -> tuple[list[dict], int | None]:
    """A group's cells, several in lockstep or one alone; (results in group order, lockstep rounds)."""
    cells = [open_args(parts, kind, b, x, args) for kind, b, x in group]
    if len(cells) == 1:
        part, kw = cells[0]
        return [part.call("cell", **kw, min_seconds=args.min_seconds, min_steps=args.min_steps)], None
    return run_lockstep(cells, args.min_seconds, args.min_steps, gap_s=args.lockstep_gap_ms / 1e3)


def measure_dtype(args, dtype: str, paths: dict) -> dict:
    """Every build of the dtype's worker: ``--builds`` times, its parts built in a rotated order.

    Two identical engines in separate processes run apart by a few percent, alike in
    every repeat of one start: mostly where each process's weights landed in memory
    (``benchmarks/harness/shared_weights.py``). That bias survives any number of repeats
    within one start, so each build starts the worker anew, and its repeats are
    numbered after the previous build's: the record's spread covers the builds.
    """
    rec: dict = {"dtype": dtype, "load_before": load_snapshot(), "builds": args.builds, "cells": []}
    t0 = time.monotonic()
    for build in range(args.builds):
        measure_build(args, dtype, paths, rec, build)
    rec["load_after"] = load_snapshot()
    rec["seconds"] = time.monotonic() - t0
    with contextlib.suppress(OSError):
        (args.out / f"cells-{dtype}.partial.json").unlink()
    return rec


def measure_build(args, dtype: str, paths: dict, rec: dict, build: int) -> None:
    t0 = time.monotonic()
    worker = None
    try:
        worker, parts = start_pair(args, dtype, paths, build)
        rec.setdefault("workers_per_build", []).append({k: p.info for k, p in parts.items()})
        rec["workers"] = rec["workers_per_build"][0]
        plain, spec, floor = parts["plain"], parts["spec"], parts["floor"]
        if plain.info["threads"] != args.threads:
            log(f"[{dtype}] warning: the engines run {plain.info['threads']} torch threads, not --threads "
                f"{args.threads}")
        block = int(spec.info["drafter_block"])
        ks = [k for k in args.ks if 0 <= k <= block]
        rec["start_seconds"] = time.monotonic() - t0

        # Warm-up: first prefill of every batch's prompts (fills the prefix cache) and the floor's caches.
        for b in args.batches:
            plain.call("cell", batch=b, k=0, prompt_len=args.prompt_len, min_seconds=0.0, min_steps=2)
            spec.call("cell", batch=b, k=max(ks), prompt_len=args.prompt_len, min_seconds=0.0, min_steps=2)
            floor.call("cell", batch=b, q=1, context=args.floor_context, min_seconds=0.0, min_steps=1)

        watch = ForeignCPU([os.getpid(), worker.pid])
        if build == 0:
            prompt = random_prompts(1, args.prompt_len, int(plain.info["vocab"]), seed=7)[0]
            log(f"[{dtype}] logits check")
            rec["logits_check"] = logits_check(plain, spec, floor, prompt, block)
            rec["tolerance"] = args.tol.get(dtype)
            for name, c in rec["logits_check"].items():
                log(f"[{dtype}]   {name}: {c}")
        rec["lockstep"] = True
        timed_cells(args, dtype, parts, rec, build, ks, watch)
        # The timed cells are kept even if the profiler pass fails or is interrupted.
        (args.out / f"cells-{dtype}.partial.json").write_text(json.dumps(rec, indent=1, default=json_default))
        rec["profiles"] = []
        if args.profile_steps > 0 and build == args.builds - 1:
            rec["profiles"] = profile_pass(args, dtype, parts, ks, watch)
    finally:
        if worker is not None:
            worker.close()
    rec.setdefault("build_seconds", []).append(time.monotonic() - t0)


def timed_cells(args, dtype: str, parts: dict, rec: dict, build: int, ks: list[int], watch: ForeignCPU) -> None:
    """Every group of cells ``--repeats`` times, interleaved; the cells go into ``rec["cells"]``."""
    for r, group in interleaved(cell_groups(args.batches, ks, floor_qs(ks)), args.repeats):
        r += build * args.repeats
        # A group during which other processes took more than --max-foreign CPUs is run again (a
        # 2-thread OpenMP region waits a whole time slice for a descheduled thread), up to
        # --retries times; the least disturbed attempt is kept, the others are recorded.
        attempts: list[tuple[list[dict], dict]] = []
        for _ in range(1 + args.retries):
            noise: dict = {}
            with watch.measure(noise):
                res, rounds = run_group(parts, group, args)
            for c, (kind, _, x) in zip(res, group):
                c.update(kind=kind, repeat=r, x=x, lockstep_rounds=rounds, **noise)
            attempts.append((res, noise))
            if noise["foreign_cpu_share"] <= args.max_foreign:
                break
            time.sleep(2.0)  # let the disturbance pass
        best, noise = min(attempts, key=lambda a: a[1]["foreign_cpu_share"])
        for i, c in enumerate(best):
            c["discarded_attempts"] = [{"median_s": a[0][i]["median_s"], "foreign_cpu_share": a[1]["foreign_cpu_share"]}
                                       for a in attempts if a[0] is not best]
        rec["cells"] += best
        log(f"[{dtype}] b{build} r{r} " + " | ".join(
            f"{c['kind']} B={c['batch']} {'k' if c['kind'] in ('plain', 'spec') else 'q'}={c['x']}: "
            f"{1e3 * c['median_s']:.1f} ms ({c['steps']} steps)" for c in best)
            + f"; other processes {noise['foreign_cpu_share']:.2f} CPUs"
            + (f", {len(attempts)} attempts" if len(attempts) > 1 else ""))


def profile_pass(args, dtype: str, parts: dict, ks: list[int], watch: ForeignCPU) -> list[dict]:
    """The plain cell, the speculative cells at ``--profile-ks`` and the floor at q = 1 and 8 under torch.profiler."""
    jobs = []
    for b in args.batches:
        jobs += [("plain", dict(batch=b, k=0, prompt_len=args.prompt_len))]
        jobs += [("spec", dict(batch=b, k=k, prompt_len=args.prompt_len)) for k in ks if k in args.profile_ks]
        jobs += [("floor", dict(batch=b, q=q, context=args.floor_context)) for q in (1, 8)]
    profiles = []
    for kind, kw in jobs:
        tries = []
        for _ in range(1 + min(1, args.retries)):  # the profiler pass is slow: one re-run at most
            noise: dict = {}
            with watch.measure(noise):
                p = parts[kind].call("profile", steps=args.profile_steps, **kw)
            p.update(kind=kind, **noise)
            tries.append(p)
            if noise["foreign_cpu_share"] <= args.max_foreign:
                break
            time.sleep(2.0)
        best = min(tries, key=lambda t: t["foreign_cpu_share"])
        profiles.append(best)
        log(f"[{dtype}] profiled {kind} {kw}: step {1e3 * best['profiled_step_s']:.1f} ms "
            f"({len(tries)} attempts, other processes {best['foreign_cpu_share']:.2f} CPUs)")
    log(f"[{dtype}] profiled {len(profiles)} cells")
    return profiles


# ------------------------------------------------------------------ the record


def run(args, command: str) -> int:
    """Measure every dtype of ``args`` into the record at ``args.out``; 1 when a floor check fails."""
    import signal

    # SIGTERM/SIGHUP end the run through the finally blocks (the worker processes are closed).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    from vllm_dspark.tools import default_pair as dp

    try:
        paths = dp.default_paths()
    except dp.DefaultPairError as exc:
        print(f"bench_step_cost: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    result: dict = {"command": command, "machine": machine_record(), "pair": paths,
                    "ld_preload": os.environ.get("LD_PRELOAD", ""),
                    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "dtypes": {}, "notes": []}
    import torch
    import vllm

    result["vllm"], result["torch"] = vllm.__version__, torch.__version__
    cpu = result["machine"].get("cpu", {})
    log(f"CPU {cpu.get('Model name')}, avx512_bf16={cpu.get('avx512_bf16')}, load {result['machine']['load']}")
    if not cpu.get("avx512_bf16"):
        result["notes"].append("this CPU has no avx512_bf16: bf16 GEMMs are emulated; compare with float32")
    failed = []
    for dt in args.dtypes:
        rec = measure_dtype(args, dt, paths)
        rec["analysis"] = analyse(rec, args.batches, args.ks)
        rec.update(command=command, args=result["args"], measured_at=time.strftime("%Y-%m-%d %H:%M:%S"))
        result["dtypes"][dt] = rec
        tol = args.tol.get(dt)
        for name, c in rec["logits_check"].items():
            d = c.get("max_abs_diff")
            if name.startswith(("plain", "DSpark")) and tol is not None and d is not None and d > tol:
                failed.append(f"{dt} {name}: max abs logit diff {d:.4g} > {tol}")
        # Written after each dtype so a long run keeps what it measured.
        result["seconds"] = time.monotonic() - t0
        (args.out / "results.json").write_text(json.dumps(result, indent=1, default=json_default))
    result["seconds"] = time.monotonic() - t0
    result["notes"] += [f"FLOOR CHECK FAILED: {f}" for f in failed]
    made = write_outputs(result, args.out)
    log(f"wrote {args.out}/results.json, report.md, {', '.join(made)} in {result['seconds'] / 60:.1f} min")
    for f in failed:
        print(f"bench_step_cost: {f}", file=sys.stderr)
    return 1 if failed else 0


def render_only(out: Path) -> int:
    """The report and plots of a record made again from its results.json."""
    path = out / "results.json"
    if not path.is_file():
        print(f"bench_step_cost: --render-only needs {path}", file=sys.stderr)
        return 2
    made = write_outputs(json.loads(path.read_text(), object_hook=int_keys), out)
    log(f"re-rendered {out}/report.md and {', '.join(made)} from {path}")
    return 0
