#!/usr/bin/env python
"""What one target step costs, by tokens per request: vLLM (plain, speculative) against a plain-PyTorch floor.

    .venv/bin/python scripts/bench_step_cost.py --out docs/benchmarks/step-cost     # bf16 + float32, ~20 min
    .venv/bin/python scripts/bench_step_cost.py --quick                             # smoke test, ~4 min

For the default target (SmolLM2-135M-Instruct) in each dtype, at batch 1, 8 and 32:

- **plain**: vLLM without speculation, a decode step (1 token per request);
- **no drafts**: vLLM with DSpark, a step in which no draft is admitted (1 token per request;
  the drafter only stores the new tokens' context K/V, the path the budget takes when drafting
  does not pay);
- **verify k**: vLLM with DSpark verifying exactly k drafts per request (1 + k tokens, k = 1..7);
- **floor**: the same checkpoint as a minimal Llama in plain PyTorch (no vLLM): fused QKV and
  gate/up GEMMs, a preallocated KV cache written in place, SDPA, the same threads, one forward
  of q = 1..8 tokens per request over a cache of ``--floor-context`` tokens, logits at every
  one of the q positions. Its logits are checked against vLLM's (plain decode steps, and a
  DSpark 8-token verify step) and against transformers' ``LlamaForCausalLM`` (SDPA); the max
  abs differences go into the record and the run fails past ``--tolerance``.
  transformers' model with a ``DynamicCache`` is timed beside it at q = 1 and 8 (``hf``).

What exactly is timed. Each engine runs in its own process, in-process engine core
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager mode (the project's setting), prefix caching on,
``max_num_seqs`` 32. One step is ``EngineCore.step()`` followed by ``EngineCore.post_step()``,
exactly what the engine's busy loop runs per iteration: schedule, the runner's execute_model
(input preparation, target forward, logits) and sample_tokens (sampler or rejection sampler,
bookkeeping, the drafter), update_from_output, and handing the drafts to the scheduler. Not
timed: the frontend (detokenisation, output processing) and inter-process transfers of a
multiprocess engine. ``target step`` is that step minus ``DSparkProposer.propose`` (the
drafter). For a k-draft step the proposer's ``settings.max_draft_tokens`` is set to k from the
benchmark (``verification: fixed``), so every request sends exactly k drafts; only steps whose
scheduled shape is exactly batch x (1 + k) tokens are counted. Per-phase wall times come from
timers wrapped around the scheduler's, runner's and proposer's methods; a separate pass under
``torch.profiler`` splits them by operator class (GEMM, attention, RoPE, elementwise).

Noise: cells run for at least ``--min-seconds`` and ``--min-steps`` steps, every cell of a
dtype is repeated ``--repeats`` times interleaved (all cells, then all cells again, ...); a
cell's value is the median of its steps, the record gives the median over repeats and the
spread (min, max); ratios are taken per repeat (both sides measured in the same round).
With ``--lockstep`` the cells a goal compares are stepped in turn, one step each per round
(``step_cost.run_lockstep``): the speculative cell with k drafts and the floor at 1 + k
tokens; the no-draft cell, the plain decode cell and the floor at 1 token. Back to back,
their ratio carried the machine's second-to-second drift (the floor alone ranged 22-33 ms
over the 9 repeats of ``docs/benchmarks/step-cost-k7-batch1-9-repeats``).

On a shared machine, pause other work first (see the report of docs/benchmarks/step-cost).
Writes ``results.json``, ``report.md`` and PNG plots into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("scheduler", "input_prep", "forward", "logits", "sampler", "rejection_sampler", "drafter", "draft_glue",
          "bookkeeping", "sample_other", "engine_other")
DRAFTER_PARTS = ("feedback", "layout", "context_kv_only", "block_forward", "markov_stage", "verify")
# The phase split of a step: the target forward split by the profiler's operator classes (scaled to the
# timed forward), everything else from the timers.
COMBINED = ("gemm", "attention", "rope", "norms_elementwise", "aux_capture", "forward_python", "logits", "sampler",
            "rejection_sampler", "drafter", "draft_glue", "input_prep", "scheduler", "other")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output folder (default docs/benchmarks/step-cost; --quick: "
                                                "/tmp/step-cost-quick)")
    ap.add_argument("--dtypes", default=None, help="comma-separated (default bfloat16,float32; --quick bfloat16)")
    ap.add_argument("--batches", default=None, help="default 1,8,32 (--quick 1,8)")
    ap.add_argument("--ks", default=None, help="drafts per request for the speculative cells (default 0..7)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3, --quick 1)")
    ap.add_argument("--min-seconds", type=float, default=None, help="per cell (default 0.5, --quick 0.05)")
    ap.add_argument("--min-steps", type=int, default=None, help="per cell (default 5, --quick 3)")
    ap.add_argument("--prompt-len", type=int, default=257,
                    help="tokens per prompt (2 full KV blocks of 128 + 1: re-added prompts hit the prefix cache)")
    ap.add_argument("--floor-context", type=int, default=None,
                    help="tokens in the floor's cache (default prompt-len + 32, about the engines' mean context)")
    ap.add_argument("--profile-steps", type=int, default=None, help="steps per profiled cell (default 5, "
                                                                     "--quick 2; 0 = no profiler pass)")
    ap.add_argument("--profile-ks", default="0,1,3,5,7",
                    help="k of the profiled speculative cells (others use the nearest one's operator split)")
    ap.add_argument("--threads", type=int, default=None, help="OMP threads for every process (default: all CPUs)")
    ap.add_argument("--kv-space", type=int, default=2,
                    help="VLLM_CPU_KVCACHE_SPACE (GiB) per engine (2 is plenty: cells hold batch x ~300-900 tokens)")
    ap.add_argument("--max-foreign", type=float, default=0.1,
                    help="re-run a cell when other processes used more CPUs than this during it")
    ap.add_argument("--retries", type=int, default=None, help="re-runs of a disturbed cell (default 2, --quick 0)")
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="before measuring a dtype, wait up to this many seconds for other processes to go quiet")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' model (its logits check of the floor)")
    ap.add_argument("--hf-timing", action="store_true",
                    help="also time transformers' model + DynamicCache at q = 1 and 8 (a slower reference)")
    ap.add_argument("--tolerance", default="float32=0.01,bfloat16=1.0",
                    help="max abs logit difference allowed between the floor and vLLM, per dtype")
    ap.add_argument("--profile-only", action="store_true",
                    help="re-take only the profiler pass of the dtypes in --out/results.json (timed cells kept)")
    ap.add_argument("--append", action="store_true",
                    help="keep the other dtypes already in --out/results.json (measure one dtype per run)")
    ap.add_argument("--cpu-setup", action="store_true",
                    help="run with vLLM's CPU set-up (tcmalloc and Intel OpenMP preloaded). Off by default: it "
                         "speeds vLLM's engines and slows the plain-PyTorch floor (docs/benchmarks/"
                         "step-cost-cpu-setup), so ratios to the floor would flatter vLLM")
    ap.add_argument("--lockstep", action="store_true",
                    help="step each speculative cell in turn with the floor at its tokens per request (and the "
                         "no-draft cell with the plain decode cell), one step each per round, so that their "
                         "ratios see the same seconds of the machine (cells back to back see its drift)")
    ap.add_argument("--lockstep-gap-ms", type=float, default=20.0,
                    help="untimed pause before every lockstep step, so that the previous process's OpenMP threads "
                         "stop spinning first (without it a step after another process's ran 5-7 ms slower)")
    ap.add_argument("--share-weights", action="store_true",
                    help="run the plain and the speculative engine in one process, the second reading the first's "
                         "target weights (separate processes' weights land in different memory: the same forward "
                         "ran 0.96-1.18x apart over 4 starts)")
    ap.add_argument("--builds", type=int, default=1,
                    help="start the workers this many times, in a rotated order, each build measuring every "
                         "cell --repeats times (a start's weight placement biases its repeats alike)")
    ap.add_argument("--quick", action="store_true", help="smoke test: few cells, short, one repeat")
    a = ap.parse_args(argv)
    q = a.quick
    a.out = Path(a.out or ("/tmp/step-cost-quick" if q else ROOT / "docs" / "benchmarks" / "step-cost"))
    a.dtypes = (a.dtypes or ("bfloat16" if q else "bfloat16,float32")).split(",")
    a.batches = [int(x) for x in (a.batches or ("1,8" if q else "1,8,32")).split(",")]
    a.ks = [int(x) for x in (a.ks or ("0,1,7" if q else "0,1,2,3,4,5,6,7")).split(",")]
    a.repeats = a.repeats or (1 if q else 3)
    a.min_seconds = a.min_seconds if a.min_seconds is not None else (0.05 if q else 0.5)
    a.min_steps = a.min_steps or (3 if q else 5)
    a.profile_steps = a.profile_steps if a.profile_steps is not None else (2 if q else 5)
    a.floor_context = a.floor_context or a.prompt_len + 32
    a.profile_ks = [int(x) for x in a.profile_ks.split(",")]
    a.threads = a.threads or os.cpu_count() or 1
    a.retries = a.retries if a.retries is not None else (0 if q else 2)
    a.tol = {k: float(v) for k, v in (p.split("=") for p in a.tolerance.split(","))}
    return a


# ------------------------------------------------------------------ measurement


def floor_qs(ks: list[int]) -> list[int]:
    return sorted({1 + k for k in ks} | {1, 8})


def logits_check(plain, spec, floor, prompt: list[int], use_hf: bool, block: int) -> dict:
    """Max abs logit difference: floor vs vLLM (plain decode steps, a DSpark verify step) and vs transformers."""
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
        if use_hf:
            h = torch.tensor(floor.call("hf_logits", context_ids=c["context"], ids=c["ids"]))
            out["floor vs transformers (SDPA)"] = {"max_abs_diff": float((a - h).abs().max()),
                                                   "top1_agreement": float((a.argmax(-1) == h.argmax(-1))
                                                                           .float().mean())}
            ref = torch.tensor(c["logits"])
            out["transformers vs vLLM verify"] = {"max_abs_diff": float((h - ref).abs().max())}
    return out


def wait_quiet(max_wait_s: float, pids: list[int], threshold: float = 0.1, window_s: float = 3.0) -> dict:
    """Wait (at most ``max_wait_s``) for a ``window_s`` window in which other processes use < threshold CPUs."""
    from vllm_dspark.tools.bench import step_cost as S

    watch = S.ForeignCPU(pids)
    t0 = time.monotonic()
    last: dict = {}
    while True:
        with watch.measure(last):
            time.sleep(window_s)
        if last["foreign_cpu_share"] < threshold or time.monotonic() - t0 >= max_wait_s:
            return {"waited_s": time.monotonic() - t0, "foreign_cpu_share": last["foreign_cpu_share"]}


def open_args(plain, spec, floor, kind: str, b: int, x: int, args) -> tuple:
    """(worker, open_cell keywords) of a cell that can run in lockstep (every kind but hf)."""
    if kind == "plain":
        return plain, dict(batch=b, k=0, prompt_len=args.prompt_len)
    if kind == "spec":
        return spec, dict(batch=b, k=x, prompt_len=args.prompt_len)
    if kind == "floor":
        return floor, dict(batch=b, q=x, context=args.floor_context)
    assert kind == "floor_linear", kind
    return floor, dict(batch=b, q=x, context=args.floor_context, gemm="linear")


def run_group(plain, spec, floor, group: list[tuple], args, common: dict) -> tuple[list[dict], int | None]:
    """Run a group's cells: one alone as before, several in lockstep; (results in group order, rounds)."""
    if len(group) == 1:
        kind, b, x = group[0]
        return [run_cell(plain, spec, floor, kind, b, x, args, common)], None
    from vllm_dspark.tools.bench import step_cost as S

    cells = [open_args(plain, spec, floor, kind, b, x, args) for kind, b, x in group]
    return S.run_lockstep(cells, common["min_seconds"], common["min_steps"], gap_s=args.lockstep_gap_ms / 1e3)


def run_cell(plain, spec, floor, kind: str, b: int, x: int, args, common: dict) -> dict:
    if kind == "hf":
        return floor.call("hf_cell", batch=b, q=x, context=args.floor_context, **common)
    worker, kw = open_args(plain, spec, floor, kind, b, x, args)
    return worker.call("cell", **kw, **common)


def measure_dtype(args, dtype: str, paths: dict) -> dict:
    """Every build of the dtype's workers: ``--builds`` times, started in a rotated order.

    Two identical engines in separate processes run apart by a few percent, alike in
    every repeat of one start: mostly where each process's weights landed in memory
    (``tools/bench/shared_weights.py``). That bias survives any number of repeats
    within one start, so each build starts the workers anew, and its repeats are
    numbered after the previous build's: the record's spread covers the builds.
    """
    from vllm_dspark.tools.bench import step_cost as S

    rec: dict = {"dtype": dtype, "load_before": S.load_snapshot(), "builds": args.builds, "cells": []}
    t0 = time.monotonic()
    for build in range(args.builds):
        measure_build(args, dtype, paths, rec, build)
    rec["load_after"] = S.load_snapshot()
    rec["seconds"] = time.monotonic() - t0
    with contextlib.suppress(OSError):
        (args.out / f"cells-{dtype}.partial.json").unlink()
    return rec


def start_workers(args, dtype: str, paths: dict, build: int) -> dict:
    from vllm_dspark.tools.bench import step_cost as S

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false"}
    floor_env = {"OMP_NUM_THREADS": str(args.threads), "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
    specs = {"plain": (S.EngineSpec("plain", paths["target"], None, dtype, kv_space_gib=args.kv_space), env),
             "spec": (S.EngineSpec("spec", paths["target"], paths["draft"], dtype, kv_space_gib=args.kv_space), env),
             "floor": (S.EngineSpec("floor", paths["target"], None, dtype, threads=args.threads), floor_env)}
    if args.share_weights:
        # Builds alternate which engine is built first (and owns the weights) and which process starts first.
        pair_order = ("plain", "spec") if build % 2 == 0 else ("spec", "plain")
        pair = (S.EngineSpec("pair", paths["target"], paths["draft"], dtype, kv_space_gib=args.kv_space,
                             order=pair_order), env)
        specs = {"pair": pair, "floor": specs["floor"]}
    order = list(specs)
    order = order[build % len(order):] + order[:build % len(order)]
    workers: dict = {}
    try:
        for name in order:
            workers[name] = S.Worker(*specs[name], log)
    except BaseException:
        for w in workers.values():
            w.close()
        raise
    if "pair" in workers:
        log(f"[pair/{dtype}] {workers['pair'].info['order'][1]} reads {workers['pair'].info['order'][0]}'s target "
            f"weights ({workers['pair'].info['shared_tensors']} tensors and packed linears shared)")
        workers = {"pair": workers["pair"], "plain": S.EngineProxy(workers["pair"], "plain"),
                   "spec": S.EngineProxy(workers["pair"], "spec"), "floor": workers["floor"]}
    return workers


def measure_build(args, dtype: str, paths: dict, rec: dict, build: int) -> None:
    from vllm_dspark.tools.bench import step_cost as S

    t0 = time.monotonic()
    workers: dict = {}
    try:
        workers = start_workers(args, dtype, paths, build)
        rec.setdefault("workers_per_build", []).append({k: w.info for k, w in workers.items() if k != "pair"})
        rec["workers"] = rec["workers_per_build"][0]
        plain, spec, floor = workers["plain"], workers["spec"], workers["floor"]
        if plain.info["threads"] != args.threads:  # the floor runs args.threads: say when the engines do not
            log(f"[{dtype}] warning: the engines run {plain.info['threads']} torch threads, the floor {args.threads}")
        block = int(spec.info["drafter_block"])
        ks = [k for k in args.ks if 0 <= k <= block]
        qs = floor_qs(ks)
        rec["start_seconds"] = time.monotonic() - t0
        if args.wait_quiet > 0:
            rec["wait_quiet"] = wait_quiet(args.wait_quiet, [os.getpid(), *{w.pid for w in workers.values()}])
            log(f"[{dtype}] quiet check: {rec['wait_quiet']}")

        # Warm-up: first prefill of every batch's prompts (fills the prefix cache) and the floor's caches.
        for b in args.batches:
            plain.call("cell", batch=b, k=0, prompt_len=args.prompt_len, min_seconds=0.0, min_steps=2)
            spec.call("cell", batch=b, k=max(ks), prompt_len=args.prompt_len, min_seconds=0.0, min_steps=2)
            floor.call("cell", batch=b, q=1, context=args.floor_context, min_seconds=0.0, min_steps=1)

        watch = S.ForeignCPU([os.getpid(), *{w.pid for w in workers.values()}])
        if not args.profile_only and build == 0:
            prompt = S.random_prompts(1, args.prompt_len, int(plain.info["vocab"]), seed=7)[0]
            log(f"[{dtype}] logits check")
            rec["logits_check"] = logits_check(plain, spec, floor, prompt, not args.no_hf, block)
            rec["tolerance"] = args.tol.get(dtype)
            for name, c in rec["logits_check"].items():
                log(f"[{dtype}]   {name}: {c}")
        if not args.profile_only:
            groups = S.cell_groups(args.batches, ks, qs, args.hf_timing and not args.no_hf, args.lockstep)
            rec["lockstep"] = args.lockstep
            runs: list[dict] = rec["cells"]
            common = dict(min_seconds=args.min_seconds, min_steps=args.min_steps)
            for r, group in S.interleaved(groups, args.repeats):
                r += build * args.repeats
                # A group during which other processes took more than --max-foreign CPUs is run again (a
                # 2-thread OpenMP region waits a whole time slice for a descheduled thread), up to
                # --retries times; the least disturbed attempt is kept, the others are recorded.
                attempts: list[tuple[list[dict], dict]] = []
                for _ in range(1 + args.retries):
                    noise: dict = {}
                    with watch.measure(noise):
                        res, rounds = run_group(plain, spec, floor, group, args, common)
                    for c, (kind, _, x) in zip(res, group):
                        c.update(kind=kind, repeat=r, x=x, lockstep_rounds=rounds, **noise)
                    attempts.append((res, noise))
                    if noise["foreign_cpu_share"] <= args.max_foreign:
                        break
                    time.sleep(2.0)  # let the disturbance pass
                best, noise = min(attempts, key=lambda a: a[1]["foreign_cpu_share"])
                for i, c in enumerate(best):
                    c["discarded_attempts"] = [{"median_s": a[0][i]["median_s"],
                                                "foreign_cpu_share": a[1]["foreign_cpu_share"]}
                                               for a in attempts if a[0] is not best]
                runs += best
                log(f"[{dtype}] b{build} r{r} " + " | ".join(
                    f"{c['kind']} B={c['batch']} {'k' if c['kind'] in ('plain', 'spec') else 'q'}={c['x']}: "
                    f"{1e3 * c['median_s']:.1f} ms ({c['steps']} steps)" for c in best)
                    + f"; other processes {noise['foreign_cpu_share']:.2f} CPUs"
                    + (f", {len(attempts)} attempts" if len(attempts) > 1 else ""))
            # The timed cells are kept even if the profiler pass fails or is interrupted.
            (args.out / f"cells-{dtype}.partial.json").write_text(json.dumps(rec, indent=1, default=_json_default))

        rec["profiles"] = []
        if args.profile_steps > 0 and build == args.builds - 1:
            jobs = []
            for b in args.batches:
                jobs += [(plain, "plain", b, dict(batch=b, k=0, prompt_len=args.prompt_len))]
                jobs += [(spec, "spec", b, dict(batch=b, k=k, prompt_len=args.prompt_len)) for k in ks
                         if k in args.profile_ks]
                jobs += [(floor, "floor", b, dict(batch=b, q=q, context=args.floor_context)) for q in (1, 8)]
            for w, kind, b, kw in jobs:
                tries = []
                for _ in range(1 + min(1, args.retries)):  # the profiler pass is slow: one re-run at most
                    noise = {}
                    with watch.measure(noise):
                        p = w.call("profile", steps=args.profile_steps, **kw)
                    p.update(kind=kind, **noise)
                    tries.append(p)
                    if noise["foreign_cpu_share"] <= args.max_foreign:
                        break
                    time.sleep(2.0)
                best = min(tries, key=lambda t: t["foreign_cpu_share"])
                rec["profiles"].append(best)
                log(f"[{dtype}] profiled {kind} {kw}: step {1e3 * best['profiled_step_s']:.1f} ms "
                    f"({len(tries)} attempts, other processes {best['foreign_cpu_share']:.2f} CPUs)")
            log(f"[{dtype}] profiled {len(rec['profiles'])} cells")
    finally:
        for w in workers.values():
            w.close()
    rec.setdefault("build_seconds", []).append(time.monotonic() - t0)


# ------------------------------------------------------------------ analysis


def _per_repeat(cells: list[dict], kind: str, batch: int, x: int, field: str = "median_s") -> list[float]:
    rows = sorted((c for c in cells if c["kind"] == kind and c["batch"] == batch and c["x"] == x),
                  key=lambda c: c["repeat"])
    out = []
    for c in rows:
        if field == "median_s":
            out.append(c["median_s"])
        elif field == "target_s":
            out.append(statistics.median(c["target_s"]) if c.get("target_s") else float("nan"))
        elif field == "model_s":  # forward + logits
            out.append(statistics.median(c["model_s"]) if c.get("model_s") else float("nan"))
    return out


def _median_dict(ds: list[dict]) -> dict:
    keys = sorted({k for d in ds for k in d})
    return {k: statistics.median(d.get(k, 0.0) for d in ds) for k in keys}


def combined_phases(timer: dict, ops: dict | None) -> dict:
    """Seconds per step by phase (:data:`COMBINED`): the timed forward split into the profiler's operator
    classes (their self times; ``forward_python`` is the rest of the timed forward: Python between
    operators); the other phases from the timers. Sums to the step."""
    out = dict.fromkeys(COMBINED, 0.0)
    fwd = float(timer.get("forward", 0.0))
    split = dict.fromkeys(("gemm", "attention", "rope", "norms_elementwise", "aux_capture", "forward_python"), 0.0)
    for key, v in (ops or {}).items():
        scope, _, cls = key.partition("/")
        if scope == "aux_capture":
            if cls != "python":  # the adds themselves; the scope's own time is the profiler's
                split["aux_capture"] += v
        elif scope in ("layer", "forward"):
            name = {"elementwise": "norms_elementwise", "python": "forward_python"}.get(cls, cls)
            split[name] = split.get(name, 0.0) + v
    # Operators keep their profiled self times (the profiler's own per-operator cost lands between
    # operators, in its "python"); Python in the forward is what the timed forward leaves over.
    ops_t = {n: v for n, v in split.items() if n != "forward_python"}
    tot = sum(ops_t.values())
    if tot > 0:
        scale = min(1.0, fwd / tot)
        for name, v in ops_t.items():
            out[name] = v * scale
        out["forward_python"] = max(0.0, fwd - tot * scale)
    else:
        out["forward_python"] = fwd  # no profile: the forward unsplit
    for name in ("logits", "sampler", "rejection_sampler", "drafter", "draft_glue", "input_prep", "scheduler"):
        out[name] = float(timer.get(name, 0.0))
    out["other"] = sum(float(timer.get(n, 0.0)) for n in ("bookkeeping", "sample_other", "engine_other"))
    out["step"] = float(timer.get("step", 0.0))
    return out


def analyse(rec: dict, batches: list[int], ks: list[int]) -> dict:
    from vllm_dspark.tools.bench import step_cost as S

    cells = rec["cells"]
    qs = sorted({c["x"] for c in cells if c["kind"] == "floor"})
    profs = {(p["kind"], p["batch"], p.get("k", p.get("q"))): p["ops"] for p in rec.get("profiles", [])}
    out: dict = {}
    for b in batches:
        plain = _per_repeat(cells, "plain", b, 0)
        plain_model = _per_repeat(cells, "plain", b, 0, "model_s")
        floor = {q: _per_repeat(cells, "floor", b, q) for q in qs}
        hf = {q: _per_repeat(cells, "hf", b, q) for q in (1, 8) if any(c["kind"] == "hf" for c in cells)}
        flin = {q: _per_repeat(cells, "floor_linear", b, q) for q in (1, 8)
                if any(c["kind"] == "floor_linear" for c in cells)}
        row: dict = {"plain_s": S.summarize(plain), "plain_model_s": S.summarize(plain_model),
                     "floor_s": {q: S.summarize(v) for q, v in floor.items()},
                     "hf_s": {q: S.summarize(v) for q, v in hf.items()},
                     "floor_linear_s": {q: S.summarize(v) for q, v in flin.items()},
                     "plain_vs_floor": S.ratio_summary(plain, floor.get(1, [])),
                     "plain_model_vs_floor": S.ratio_summary(plain_model, floor.get(1, [])),
                     "spec": {}}
        for k in ks:
            st = _per_repeat(cells, "spec", b, k)
            tg = _per_repeat(cells, "spec", b, k, "target_s")
            md = _per_repeat(cells, "spec", b, k, "model_s")
            fl = floor.get(1 + k, [])
            sel = [c for c in cells if c["kind"] == "spec" and c["batch"] == b and c["x"] == k]
            row["spec"][k] = {
                "step_s": S.summarize(st), "target_s": S.summarize(tg), "model_s": S.summarize(md),
                "step_vs_plain": S.ratio_summary(st, plain), "target_vs_plain": S.ratio_summary(tg, plain),
                "step_vs_floor": S.ratio_summary(st, fl), "target_vs_floor": S.ratio_summary(tg, fl),
                "model_vs_floor": S.ratio_summary(md, fl),
                "timer_phases_s": _median_dict([c["phases_mean_s"] for c in sel]),
                "drafter_parts_s": {p: v for p, v in _median_dict([c["timers_mean_s"] for c in sel]).items()
                                    if p.startswith("drafter.")},
                "context_mean": statistics.mean(c["context_mean"] for c in sel if c.get("context_mean"))
                if any(c.get("context_mean") for c in sel) else None,
            }
            pk = [kk for (kind, bb, kk) in profs if kind == "spec" and bb == b]
            near = min(pk, key=lambda kk: (abs(kk - k), kk)) if pk else None  # unprofiled k: the nearest one's split
            row["spec"][k]["profile_k"] = near
            row["spec"][k]["phases_s"] = combined_phases(row["spec"][k]["timer_phases_s"],
                                                         profs.get(("spec", b, near)))
        sel = [c for c in cells if c["kind"] == "plain" and c["batch"] == b]
        row["plain_timer_phases_s"] = _median_dict([c["phases_mean_s"] for c in sel])
        row["plain_phases_s"] = combined_phases(row["plain_timer_phases_s"], profs.get(("plain", b, 0)))
        row["plain_context_mean"] = statistics.mean(c["context_mean"] for c in sel if c.get("context_mean")) \
            if any(c.get("context_mean") for c in sel) else None
        if 0 in row["spec"]:
            row["no_draft_extra_s"] = {p: row["spec"][0]["phases_s"].get(p, 0.0) - row["plain_phases_s"].get(p, 0.0)
                                       for p in (*COMBINED, "step")}
        vk = [k for k in ks if k >= 1]
        if len(vk) >= 2:
            row["growth_per_draft_s"] = {
                p: S.linear_slope(vk, [row["spec"][k]["phases_s"].get(p, float("nan")) for k in vk])
                for p in (*COMBINED, "step")}
            row["growth_per_draft_s"]["floor"] = S.linear_slope(
                vk, [row["floor_s"].get(1 + k, {}).get("median", float("nan")) for k in vk])
        out[b] = row
    prof: dict = {}
    for p in rec.get("profiles", []):
        key = f"{p['kind']} B={p['batch']} " + (f"k={p['k']}" if p["kind"] != "floor" else f"q={p['q']}")
        prof[key] = {"profiled_step_s": p["profiled_step_s"], "ops_s": p["ops"]}
    return {"by_batch": out, "profiles": prof}


# ------------------------------------------------------------------ report


def ms(s: dict | None, nd: int = 1) -> str:
    if not s or not s.get("n"):
        return "-"
    return f"{1e3 * s['median']:.{nd}f} [{1e3 * s['min']:.{nd}f}-{1e3 * s['max']:.{nd}f}]"


def rx(s: dict | None) -> str:
    if not s or not s.get("n"):
        return "-"
    return f"{s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]"


def lockstep_position_lines(cells: list[dict], a: dict) -> list[str]:
    """The lockstep self-check: does a cell's step depend on which cell ran before it?"""
    from vllm_dspark.tools.bench import step_cost as S

    by: dict = {}
    for c in cells:
        if c.get("lockstep_rounds"):
            by.setdefault((c["batch"], c["kind"], c["x"]), []).append(S.position_bias(c["step_s"]))
    if not by:
        return []
    parts = [f"{kind} B={b} {'k' if kind in ('plain', 'spec') else 'q'}={x} "
             f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]" for (b, kind, x), v in sorted(by.items())]
    return ["", f"Lockstep position check (a cell's median step in even rounds over odd rounds; the order "
                f"reverses each round, so an end cell follows itself every other round; near 1 when a step does "
                f"not depend on what ran before it; {a.get('lockstep_gap_ms', 0):g} ms pause before each step): "
            + "; ".join(parts) + "."]


def report(result: dict) -> str:
    from vllm_dspark.tools.bench import step_cost as S

    m = result["machine"]
    a = result["args"]
    cpu = m.get("cpu", {})
    cmds = list(dict.fromkeys(d.get("command", result["command"]) for d in result["dtypes"].values()))
    L = ["# Step cost: one target step by tokens per request, vLLM against the plain-PyTorch floor", "",
         *([result["preamble"], ""] if result.get("preamble") else []),
         *[f"`{c}`" for c in cmds], "",
         f"- Machine: {cpu.get('Model name')} ({cpu.get('CPU(s)')} CPUs, {cpu.get('Hypervisor vendor') or 'bare'}); "
         f"avx512_bf16: **{'yes' if cpu.get('avx512_bf16') else 'NO (bf16 emulated)'}**; "
         f"bf16/AMX flags: {', '.join(cpu.get('bf16_flags') or []) or 'none'}.",
         f"- Software: vLLM {result.get('vllm')}, torch {result.get('torch')}; {a['threads']} threads per process; "
         f"eager mode; prefix caching on; " + (f"LD_PRELOAD {result['ld_preload']}." if result.get("ld_preload")
                                               else "no LD_PRELOAD (vLLM's tcmalloc/iomp advice not applied)."),
         f"- Cells: >= {a['min_seconds']} s and >= {a['min_steps']} steps each, {a['repeats']} interleaved "
         f"repeats" + (f" in each of {a['builds']} builds (workers started anew, rotated order)"
                       if a.get("builds", 1) > 1 else "")
         + "; value = median step of a cell; shown as median [min-max] over repeats. "
         + ("**Lockstep**: each speculative cell stepped in turn with the floor at its tokens per request "
            "(the no-draft cell also with the plain decode cell), one step each per round. " if a.get("lockstep")
            else "")
         + 
         f"Prompts {a['prompt_len']} tokens (random ids, distinct per request); floor cache {a['floor_context']} "
         f"tokens.",
         "- Measured: " + "; ".join(f"{dt} at {d.get('measured_at')} ({d.get('seconds', 0) / 60:.1f} min)"
                                    for dt, d in result["dtypes"].items()) + ".", ""]
    L += ["**What is timed.** A step is `EngineCore.step()` + `post_step()` in an in-process engine core "
          "(schedule, execute_model, sample_tokens with the drafter, update_from_output, drafts to the "
          "scheduler). *target step* = step minus `DSparkProposer.propose`. *model* = the target's forward + "
          "logits alone. The floor is one forward of q tokens per request with logits at all q positions. "
          "Ratios are per repeat, then median [min-max].", ""]
    for dt, d in result["dtypes"].items():
        an = d["analysis"]["by_batch"]
        a = d.get("args", result["args"])
        L += [f"## {dt}", "", f"`{d.get('command', result['command'])}`", ""]
        L += ["### Headline", "",
              "| batch | plain decode ms | plain / floor(1) | no-draft step ms | no-draft / plain | "
              "no-draft / floor(1) | verify-8 step ms | verify-8 target ms | target / floor(8) | "
              "step / floor(8) | floor(1) ms | floor(8) ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for b, row in an.items():
            s0 = row["spec"].get(0, {})
            kmax = max(row["spec"]) if row["spec"] else None
            s7 = row["spec"].get(kmax, {}) if kmax else {}
            L.append(f"| {b} | {ms(row['plain_s'])} | {rx(row['plain_vs_floor'])} | {ms(s0.get('step_s'))} | "
                     f"{rx(s0.get('step_vs_plain'))} | {rx(s0.get('step_vs_floor'))} | {ms(s7.get('step_s'))} | "
                     f"{ms(s7.get('target_s'))} | {rx(s7.get('target_vs_floor'))} | {rx(s7.get('step_vs_floor'))} | "
                     f"{ms(row['floor_s'].get(1))} | {ms(row['floor_s'].get(8))} |")
        shares = [c.get("foreign_cpu_share", 0.0) for c in d["cells"]]
        if shares:
            bad = [c for c in d["cells"] if c.get("foreign_cpu_share", 0.0) > 0.2]
            L += ["", f"Other processes during the cells: median {statistics.median(shares):.2f} CPUs, max "
                  f"{max(shares):.2f} (of {result['machine'].get('cpu', {}).get('CPU(s)')}); "
                  f"{len(bad)} of {len(shares)} cells above 0.2 CPUs"
                  + (": " + ", ".join(f"{c['kind']} B={c['batch']} x={c['x']} r{c['repeat']} "
                                      f"({c['foreign_cpu_share']:.2f})" for c in bad[:12]) if bad else "") + "."]
        L += lockstep_position_lines(d["cells"], a)
        L += ["", "Goals of issue 18 (met only when the whole spread allows it):", ""]
        for b, row in an.items():
            s0 = row["spec"].get(0, {})
            kmax = max(row["spec"]) if row["spec"] else 0
            s7 = row["spec"].get(kmax, {}) if kmax else {}  # a run without k > 0 has no verify step
            L.append(f"- batch {b}: no-draft step <= 1.03x plain: "
                     f"**{S.spread_allows(s0.get('step_vs_plain'), 1.03)}** ({rx(s0.get('step_vs_plain'))}); "
                     f"verify-8 target step <= 1.1x floor(8): "
                     f"**{S.spread_allows(s7.get('target_vs_floor'), 1.1)}** ({rx(s7.get('target_vs_floor'))})")
        L += ["", "### Step time by tokens per request (ms)", "",
              "| batch | tokens/req | floor | vLLM model (fwd+logits) | spec target step | spec step | "
              "step / floor | target / floor | model / floor |", "|---|---|---|---|---|---|---|---|---|"]
        for b, row in an.items():
            L.append(f"| {b} | 1 (plain) | {ms(row['floor_s'].get(1))} | {ms(row['plain_model_s'])} | "
                     f"{ms(row['plain_s'])} | {ms(row['plain_s'])} | {rx(row['plain_vs_floor'])} | "
                     f"{rx(row['plain_vs_floor'])} | {rx(row['plain_model_vs_floor'])} |")
            for k, s in row["spec"].items():
                L.append(f"| {b} | {1 + k} ({'no drafts' if k == 0 else f'k={k}'}) | "
                         f"{ms(row['floor_s'].get(1 + k))} | {ms(s['model_s'])} | {ms(s['target_s'])} | "
                         f"{ms(s['step_s'])} | {rx(s['step_vs_floor'])} | {rx(s['target_vs_floor'])} | "
                         f"{rx(s['model_vs_floor'])} |")
        L += ["", "Slower references at the same shapes (not the floor): the floor with plain `F.linear` "
              "instead of packed oneDNN weights, and transformers' LlamaForCausalLM + DynamicCache (SDPA):", ""]
        for b, row in an.items():
            fl, hf = row.get("floor_linear_s") or {}, row.get("hf_s") or {}
            L.append(f"- batch {b}: floor F.linear q=1 {ms(fl.get(1))}, q=8 {ms(fl.get(8))} ms; transformers q=1 "
                     f"{ms(hf.get(1))}, q=8 {ms(hf.get(8))} ms")
        L += ["", "### Where a step's time goes (ms per step)", "",
              "Timers around the engine's methods (median over repeats of each cell's mean over its typical "
              "steps, those within 1.3x of its median step); the target forward split into "
              "its operator classes under torch.profiler (self times of GEMM, attention, RoPE, norms and other "
              "elementwise ops, the aux hidden-state adds; `forward_python` = the timed forward minus those: "
              "Python between operators; profiled at k = "
              f"{', '.join(str(k) for k in a.get('profile_ks', []))}, other k use the nearest profiled split). "
              "`drafter` = "
              "DSparkProposer.propose; `draft glue` = the runner's propose_draft_token_ids around it (the "
              "concat of the aux hidden states, next-token preparation); `other` = bookkeeping and the "
              "engine's glue.", ""]
        L += ["| batch | step | " + " | ".join(COMBINED) + " | total |", "|---" * (len(COMBINED) + 3) + "|"]
        for b, row in an.items():
            variants = [("plain", row["plain_phases_s"])] + [(("no drafts" if k == 0 else f"k={k}"), s["phases_s"])
                                                              for k, s in row["spec"].items()]
            for name, ph in variants:
                L.append(f"| {b} | {name} | " + " | ".join(f"{1e3 * ph.get(c, 0.0):.2f}" for c in COMBINED)
                         + f" | {1e3 * ph.get('step', 0.0):.2f} |")
        L += ["", "**No-draft step minus plain decode step, by phase** (ms; positive = the speculative engine "
              "pays more):", "",
              "| batch | " + " | ".join(COMBINED) + " | step |", "|---" * (len(COMBINED) + 2) + "|"]
        for b, row in an.items():
            ex = row.get("no_draft_extra_s")
            if ex:
                L.append(f"| {b} | " + " | ".join(f"{1e3 * ex.get(c, 0.0):+.2f}" for c in (*COMBINED, "step")) + " |")
        L += ["", "**What grows with k** (ms per extra draft per step: least-squares slope over k = 1..7; "
              "`floor` = the floor's slope per extra token):", "",
              "| batch | " + " | ".join((*COMBINED, "step", "floor")) + " |", "|---" * (len(COMBINED) + 3) + "|"]
        for b, row in an.items():
            g = row.get("growth_per_draft_s")
            if g:
                L.append(f"| {b} | " + " | ".join(f"{1e3 * g.get(p, 0.0):.2f}" for p in (*COMBINED, "step", "floor"))
                         + " |")
        L += ["", "The drafter's own parts (ms per step, the proposer's timings):", "",
              "| batch | k | " + " | ".join(DRAFTER_PARTS) + " |", "|---" * (len(DRAFTER_PARTS) + 2) + "|"]
        for b, row in an.items():
            for k, s in row["spec"].items():
                dp = s.get("drafter_parts_s") or {}
                L.append(f"| {b} | {k} | " + " | ".join(f"{1e3 * dp.get('drafter.' + p, 0.0):.2f}"
                                                      for p in DRAFTER_PARTS) + " |")
        prof = d["analysis"]["profiles"]
        floors = {k: v for k, v in prof.items() if k.startswith("floor")}
        if floors:
            L += ["", "The floor under torch.profiler (ms per step, self CPU time by operator class; the LM head "
                  "timed alone is part of `gemm`):", ""]
            for key, p in floors.items():
                L.append(f"- {key} (profiled step {1e3 * p['profiled_step_s']:.1f} ms): "
                         + ", ".join(f"{n} {1e3 * v:.1f}" for n, v in p["ops_s"].items()))
        L += ["", "### Floor check (max abs logit difference)", "",
              f"Tolerance for {dt}: {d.get('tolerance')} (the run fails past it).", ""]
        for name, c in d["logits_check"].items():
            L.append(f"- {name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in c.items()))
        L.append("")
        for w, info in d.get("workers", {}).items():
            L.append(f"- {w}: {info.get('threads')} threads, started in {info.get('start_seconds', 0):.0f} s")
        L += [f"- load before: {d['load_before'].get('loadavg')}, after: {d['load_after'].get('loadavg')}", ""]
    if result.get("notes"):
        L += ["## Notes", ""] + [f"- {n}" for n in result["notes"]] + [""]
    return "\n".join(L)


def plots(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    dts = list(result["dtypes"])
    batches = list(next(iter(result["dtypes"].values()))["analysis"]["by_batch"])

    def err(s):
        return ([1e3 * (s["median"] - s["min"])], [1e3 * (s["max"] - s["median"])])

    fig, axes = plt.subplots(len(dts), len(batches), figsize=(4.6 * len(batches), 3.8 * len(dts)), squeeze=False)
    for i, dt in enumerate(dts):
        an = result["dtypes"][dt]["analysis"]["by_batch"]
        for j, b in enumerate(batches):
            ax = axes[i][j]
            row = an[b]
            fq = sorted(row["floor_s"])
            ax.errorbar(fq, [1e3 * row["floor_s"][q]["median"] for q in fq],
                        yerr=[[1e3 * (row["floor_s"][q]["median"] - row["floor_s"][q]["min"]) for q in fq],
                              [1e3 * (row["floor_s"][q]["max"] - row["floor_s"][q]["median"]) for q in fq]],
                        marker="o", color="k", label="floor (PyTorch)", capsize=2)
            ks = sorted(k for k in row["spec"] if k >= 1)
            for field, label, color in (("step_s", "spec step (verify k)", "tab:red"),
                                        ("target_s", "spec target step", "tab:orange"),
                                        ("model_s", "vLLM model (fwd+logits)", "tab:purple")):
                ys = [row["spec"][k][field] for k in ks]
                ax.errorbar([1 + k for k in ks], [1e3 * s["median"] for s in ys],
                            yerr=[[1e3 * (s["median"] - s["min"]) for s in ys], [1e3 * (s["max"] - s["median"])
                                                                                for s in ys]],
                            marker=".", color=color, label=label, capsize=2)
            ax.errorbar([1], [1e3 * row["plain_s"]["median"]], yerr=err(row["plain_s"]), marker="s",
                        color="tab:blue", label="plain decode step", capsize=2, linestyle="none")
            if 0 in row["spec"]:
                s0 = row["spec"][0]["step_s"]
                ax.errorbar([1.1], [1e3 * s0["median"]], yerr=err(s0), marker="^", color="tab:green",
                            label="spec step, no drafts", capsize=2, linestyle="none")
            if row.get("hf_s"):
                hq = sorted(row["hf_s"])
                ax.plot(hq, [1e3 * row["hf_s"][q]["median"] for q in hq], "x--", color="grey",
                        label="transformers + DynamicCache")
            ax.set_title(f"{dt}, batch {b}")
            ax.set_xlabel("tokens per request")
            ax.set_ylabel("ms per step")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=110)
    plt.close(fig)
    made.append("step_time.png")

    fig, axes = plt.subplots(1, len(dts), figsize=(5.5 * len(dts), 4), squeeze=False)
    for i, dt in enumerate(dts):
        ax = axes[0][i]
        an = result["dtypes"][dt]["analysis"]["by_batch"]
        for b, color in zip(batches, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
            row = an[b]
            ks = sorted(row["spec"])
            xs = [1 + k for k in ks]
            ax.plot(xs, [row["spec"][k]["target_vs_floor"]["median"] for k in ks], "o-", color=color,
                    label=f"B={b} target step / floor")
            ax.plot(xs, [row["spec"][k]["step_vs_floor"]["median"] for k in ks], "x:", color=color,
                    label=f"B={b} step (with drafter) / floor")
            ax.plot([1], [row["plain_vs_floor"]["median"]], "s", color=color)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.1, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{dt}: ratio to the floor at the same tokens/request (square: plain decode)")
        ax.set_xlabel("tokens per request (1 = no drafts)")
        ax.set_ylabel("x floor")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ratio_to_floor.png", dpi=110)
    plt.close(fig)
    made.append("ratio_to_floor.png")

    fig, axes = plt.subplots(len(dts), len(batches), figsize=(4.6 * len(batches), 3.8 * len(dts)), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    for i, dt in enumerate(dts):
        an = result["dtypes"][dt]["analysis"]["by_batch"]
        for j, b in enumerate(batches):
            ax = axes[i][j]
            row = an[b]
            variants = [("plain", row["plain_phases_s"])] + [(f"k={k}", s["phases_s"])
                                                              for k, s in sorted(row["spec"].items())]
            bottom = [0.0] * len(variants)
            for c, p in enumerate(COMBINED):
                vals = [1e3 * ph.get(p, 0.0) for _, ph in variants]
                ax.bar(range(len(variants)), vals, bottom=bottom, color=colors[c % 20], label=p)
                bottom = [x + y for x, y in zip(bottom, vals)]
            fq = [1 if n == "plain" else 1 + int(n[2:]) for n, _ in variants]
            ax.plot(range(len(variants)), [1e3 * row["floor_s"].get(q, {}).get("median", float("nan")) for q in fq],
                    "k_", markersize=14, mew=2, label="floor (same tokens/req)")
            ax.set_xticks(range(len(variants)), [n for n, _ in variants], fontsize=7)
            ax.set_title(f"{dt}, batch {b}: phases")
            ax.set_ylabel("ms per step")
            if i == 0 and j == len(batches) - 1:
                ax.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "phases.png", dpi=110)
    plt.close(fig)
    made.append("phases.png")
    return made


def main(argv=None) -> int:
    import signal

    args = parse_args(argv)
    if argv is None:  # run as a script (the re-exec repeats its command line)
        from vllm_dspark.tools.bench import cpu_setup

        cpu_setup.reexec_with(args.cpu_setup)
    # SIGTERM/SIGHUP end the run through the finally blocks (the worker processes are closed).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    from vllm_dspark.tools import default_pair as dp
    from vllm_dspark.tools.bench import step_cost as S

    try:
        paths = dp.default_paths()
    except dp.DefaultPairError as exc:
        print(f"bench_step_cost: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    command = " ".join([".venv/bin/python scripts/bench_step_cost.py", *(argv if argv is not None else sys.argv[1:])])
    result: dict = {"command": command, "machine": S.machine_record(), "pair": paths,
                    "ld_preload": os.environ.get("LD_PRELOAD", ""),
                    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "dtypes": {}, "notes": []}
    old = args.out / "results.json"
    if args.append and old.is_file():  # keep the dtypes measured by earlier runs (replaced if re-measured)
        prev = json.loads(old.read_text())
        result["dtypes"] = {k: v for k, v in prev.get("dtypes", {}).items() if k not in args.dtypes}
    import torch
    import vllm

    result["vllm"], result["torch"] = vllm.__version__, torch.__version__
    cpu = result["machine"].get("cpu", {})
    log(f"CPU {cpu.get('Model name')}, avx512_bf16={cpu.get('avx512_bf16')}, load {result['machine']['load']}")
    if not cpu.get("avx512_bf16"):
        result["notes"].append("this CPU has no avx512_bf16: bf16 GEMMs are emulated; compare with float32")
    failed = []
    if args.profile_only:
        return profile_only(args, paths, result, command)
    for dt in args.dtypes:
        rec = measure_dtype(args, dt, paths)
        rec["analysis"] = analyse(rec, args.batches, args.ks)
        rec.update(command=command, args=result["args"], measured_at=time.strftime("%Y-%m-%d %H:%M:%S"))
        result["dtypes"][dt] = rec
        tol = args.tol.get(dt)
        for name, c in rec["logits_check"].items():
            if "vLLM" in name or name.startswith("plain") or name.startswith("DSpark"):
                d = c.get("max_abs_diff")
                if tol is not None and d is not None and d > tol:
                    failed.append(f"{dt} {name}: max abs logit diff {d:.4g} > {tol}")
        # Write after each dtype so a long run keeps what it measured.
        result["seconds"] = time.monotonic() - t0
        (args.out / "results.json").write_text(json.dumps(result, indent=1, default=_json_default))
    result["seconds"] = time.monotonic() - t0
    if failed:
        result["notes"] += [f"FLOOR CHECK FAILED: {f}" for f in failed]
    (args.out / "results.json").write_text(json.dumps(result, indent=1, default=_json_default))
    (args.out / "report.md").write_text(report(json.loads(json.dumps(result, default=_json_default),
                                                          object_hook=_int_keys)))
    made = plots(json.loads(json.dumps(result, default=_json_default), object_hook=_int_keys), args.out)
    log(f"wrote {args.out}/results.json, report.md, {', '.join(made)} in {result['seconds'] / 60:.1f} min")
    if failed:
        for f in failed:
            print(f"bench_step_cost: {f}", file=sys.stderr)
        return 1
    return 0


def write_outputs(result: dict, out: Path) -> list[str]:
    (out / "results.json").write_text(json.dumps(result, indent=1, default=_json_default))
    plain = json.loads(json.dumps(result, default=_json_default), object_hook=_int_keys)
    (out / "report.md").write_text(report(plain))
    return plots(plain, out)


def profile_only(args, paths: dict, result: dict, command: str) -> int:
    """Re-take the profiler pass of dtypes already in --out/results.json and re-analyse them (timed cells kept)."""
    path = args.out / "results.json"
    if not path.is_file():
        print(f"bench_step_cost: --profile-only needs {path}", file=sys.stderr)
        return 2
    prev = json.loads(path.read_text(), object_hook=_int_keys)
    for dt in args.dtypes:
        old = prev["dtypes"].get(dt)
        if old is None:
            print(f"bench_step_cost: no {dt} record in {path}", file=sys.stderr)
            return 2
        a = old.get("args", prev.get("args", {}))
        args.builds = 1  # the profiler pass needs one start
        args.batches, args.ks = a.get("batches", args.batches), a.get("ks", args.ks)
        args.prompt_len, args.floor_context = a.get("prompt_len", args.prompt_len), a.get("floor_context",
                                                                                         args.floor_context)
        rec = measure_dtype(args, dt, paths)
        old["profiles"] = rec["profiles"]
        old["profile_run"] = {"command": command, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "seconds": rec["seconds"], "profile_ks": args.profile_ks,
                              "profile_steps": args.profile_steps, "load_before": rec["load_before"],
                              "load_after": rec["load_after"]}
        old.setdefault("args", a)["profile_ks"] = args.profile_ks
        old["analysis"] = analyse(old, args.batches, args.ks)
    made = write_outputs(prev, args.out)
    log(f"re-profiled {', '.join(args.dtypes)}; wrote {args.out}/results.json, report.md, {', '.join(made)}")
    return 0


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, float) and math.isnan(o):
        return None
    raise TypeError(type(o).__name__)


def _int_keys(d: dict) -> dict:
    return {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v for k, v in d.items()}


if __name__ == "__main__":
    raise SystemExit(main())
