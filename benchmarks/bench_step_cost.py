#!/usr/bin/env python
"""What one target step costs, by tokens per request: vLLM (plain, speculative) against a plain-PyTorch floor.

    .venv/bin/python benchmarks/bench_step_cost.py --out docs/benchmarks/step-cost     # bf16 + float32, ~20 min
    .venv/bin/python benchmarks/bench_step_cost.py --quick                             # smoke test, ~4 min

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
over 9 repeats in a record git keeps: ``step-cost-k7-batch1-9-repeats``).

On a shared machine, pause other work first (``docs/benchmarks/method.md``).
Writes ``results.json``, ``report.md`` and PNG plots into ``--out``; the analysis, the report
and the plots are ``benchmarks/harness/step_cost_report.py``, and ``--render-only`` makes
them again from a record's ``results.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness.step_cost_report import analyse, int_keys, json_default, write_outputs  # noqa: E402


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
    ap.add_argument("--render-only", action="store_true",
                    help="measure nothing: analyse --out/results.json again and rewrite its analysis, report.md "
                         "and plots")
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
    ap.add_argument("--floor-in-pair", action="store_true",
                    help="with --share-weights: the floor runs in the engines' process too (its own weights, the "
                         "same OpenMP threads); builds rotate the order the three are built in")
    ap.add_argument("--builds", type=int, default=1,
                    help="start the workers this many times, in a rotated order, each build measuring every "
                         "cell --repeats times (a start's weight placement biases its repeats alike)")
    ap.add_argument("--quick", action="store_true", help="smoke test: few cells, short, one repeat")
    a = ap.parse_args(argv)
    if a.floor_in_pair and not a.share_weights:
        ap.error("--floor-in-pair runs the floor in the pair's process: add --share-weights")
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
    from benchmarks.harness import step_cost as S

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
    from benchmarks.harness import step_cost as S

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
    (``benchmarks/harness/shared_weights.py``). That bias survives any number of repeats
    within one start, so each build starts the workers anew, and its repeats are
    numbered after the previous build's: the record's spread covers the builds.
    """
    from benchmarks.harness import step_cost as S

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
    from benchmarks.harness import step_cost as S

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false"}
    floor_env = {"OMP_NUM_THREADS": str(args.threads), "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
    specs = {"plain": (S.EngineSpec("plain", paths["target"], None, dtype, kv_space_gib=args.kv_space), env),
             "spec": (S.EngineSpec("spec", paths["target"], paths["draft"], dtype, kv_space_gib=args.kv_space), env),
             "floor": (S.EngineSpec("floor", paths["target"], None, dtype, threads=args.threads), floor_env)}
    if args.share_weights:
        # Builds alternate which engine is built first (and owns the weights) and which process starts first.
        pair_order: tuple[str, ...] = ("plain", "spec") if build % 2 == 0 else ("spec", "plain")
        if args.floor_in_pair:  # the floor built first, second or third, in turn
            at = build % 3
            pair_order = (*pair_order[:at], "floor", *pair_order[at:])
        pair = (S.EngineSpec("pair", paths["target"], paths["draft"], dtype, kv_space_gib=args.kv_space,
                             order=pair_order), env)
        specs = {"pair": pair} if args.floor_in_pair else {"pair": pair, "floor": specs["floor"]}
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
        owner, reader = workers["pair"].info["weights"]
        log(f"[pair/{dtype}] {reader} reads {owner}'s target weights ({workers['pair'].info['shared_tensors']} "
            f"tensors and packed linears shared); built in the order {', '.join(workers['pair'].info['order'])}")
        workers = {"pair": workers["pair"], "plain": S.EngineProxy(workers["pair"], "plain"),
                   "spec": S.EngineProxy(workers["pair"], "spec"),
                   "floor": S.EngineProxy(workers["pair"], "floor") if args.floor_in_pair else workers["floor"]}
    return workers


def measure_build(args, dtype: str, paths: dict, rec: dict, build: int) -> None:
    from benchmarks.harness import step_cost as S

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
            (args.out / f"cells-{dtype}.partial.json").write_text(json.dumps(rec, indent=1, default=json_default))

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


def render_only(out: Path) -> int:
    """The report and plots of a record made again from its results.json, by today's analysis."""
    path = out / "results.json"
    if not path.is_file():
        print(f"bench_step_cost: --render-only needs {path}", file=sys.stderr)
        return 2
    result = json.loads(path.read_text(), object_hook=int_keys)
    for rec in result["dtypes"].values():
        a = rec.get("args", result.get("args", {}))
        if "cells" in rec:  # a record written before slim(): its cells analysed again
            rec["analysis"] = analyse(rec, a["batches"], a["ks"])
    made = write_outputs(result, out)
    log(f"re-rendered {out}/report.md and {', '.join(made)} from {path}")
    return 0


def main(argv=None) -> int:
    import signal

    args = parse_args(argv)
    if args.render_only:
        return render_only(args.out)
    if argv is None:  # run as a script (the re-exec repeats its command line)
        from vllm_dspark.tools import cpu_setup

        cpu_setup.reexec_with(args.cpu_setup)
    # SIGTERM/SIGHUP end the run through the finally blocks (the worker processes are closed).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    from benchmarks.harness import step_cost as S
    from vllm_dspark.tools import default_pair as dp

    try:
        paths = dp.default_paths()
    except dp.DefaultPairError as exc:
        print(f"bench_step_cost: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    command = " ".join([".venv/bin/python benchmarks/bench_step_cost.py",
                        *(argv if argv is not None else sys.argv[1:])])
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
        (args.out / "results.json").write_text(json.dumps(result, indent=1, default=json_default))
    result["seconds"] = time.monotonic() - t0
    if failed:
        result["notes"] += [f"FLOOR CHECK FAILED: {f}" for f in failed]
    made = write_outputs(result, args.out)
    log(f"wrote {args.out}/results.json, report.md, {', '.join(made)} in {result['seconds'] / 60:.1f} min")
    if failed:
        for f in failed:
            print(f"bench_step_cost: {f}", file=sys.stderr)
        return 1
    return 0


def profile_only(args, paths: dict, result: dict, command: str) -> int:
    """Re-take the profiler pass of dtypes already in --out/results.json and re-analyse them (timed cells kept)."""
    path = args.out / "results.json"
    if not path.is_file():
        print(f"bench_step_cost: --profile-only needs {path}", file=sys.stderr)
        return 2
    prev = json.loads(path.read_text(), object_hook=int_keys)
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


if __name__ == "__main__":
    raise SystemExit(main())
