"""Lockstep: every configuration's engine in this process, stepped in turn, one engine step at a time.

Why not cells back to back (``e2e.run_interleaved``)? This machine's memory
bandwidth drifts by 10-20% from one second to the next (a 268 MB bf16
mat-vec loop, 1-second medians from 21.0 to 26.8 ms). Two identical
no-speculation engines, measured as interleaved cells of about 17 s each,
gave 1.02x [0.93-1.04] over 6 repeats, and 1.03x [0.92-1.18] over 8. That
is far too wide to tell whether a drafter costs 3%. Stepped in lockstep, the
same two engines gave 1.013x [1.008-1.020]. Each engine's step is about 30 ms
at batch 1, so every configuration sees the same seconds of the machine.

**How a cell runs.** Every engine gets the same requests, in waves of C (or, ``queued``, all at
once with at most C running: :func:`batch_of`, a server's full batch while the queue lasts). In
each round, every engine that still has unfinished requests runs one
``LLMEngine.step()``: it schedules, runs the forward and sampling, drafts and
processes the outputs. The round's order is reversed on odd repeats. An
engine's time is the sum of its own ``step()`` calls, and its rate is the
output tokens of finished requests over that time.

**Build bias: rotated builds and a control.** Identical engines in one
process came out apart, alike in every repeat of one build:
- 0.4-3.4% with three identical no-speculation engines, the later-built
  faster, with the CPU set-up's preloads and without;
- 7.7% from the first to the fourth of four engines (two of them DSpark) in
  the first run of this benchmark.

In the record ``never-lose-lockstep`` (git's history) it did not follow build order in
every build. Most of it is where each engine's weights landed in memory
(:mod:`.shared_weights`): with ``share`` every engine reads the first-built
engine's target weights, and the record's A/A went from 0.983-1.069 to
0.981-1.011 (record ``never-lose-shared``). Two more things answer
what is left (the engines' own KV caches, at batch 32 as much traffic as the
weights):
- ``builds`` > 1 builds the engines again for each build, in a rotated order,
  so every configuration takes every place in turn. Each build measures every
  cell ``repeats`` times; the record gives the median over all of them and the
  median of each build (``speedup_per_build``).
- A second no-speculation engine, ``no-spec-b``, is built with the others. Each
  configuration's speed-up is its rate over the geometric mean of the two
  controls' rates in the same repeat. The control's own row, ``no-spec-b``
  against ``no-spec``, is the record's A/A: how far apart two identical
  engines came out.

n-gram engines are always built last, outside the rotation: their effect is
far larger than the bias. (An in-process engine built after numba had loaded,
as the n-gram proposer does, failed in vLLM's kernel-override scan; the patch
``kernel-scan-fake-dict`` fixes that, so later builds can follow an n-gram one.)

**What this does not time.** The engines run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``). So the frontend-to-engine-core IPC
that a multiprocess ``LLM`` or ``vllm serve`` pays is not timed, and neither
is the engine core's busy-wait on the worker. Both are alike for every
configuration. Use ``run_interleaved`` for that end-to-end view.
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time

from benchmarks.harness.e2e import (
    EngineConfig,
    Pair,
    _cells,
    _delta,
    _inputs,
    _params,
    proposer_acceptance,
    repeats_row,
)
from benchmarks.harness.engine import dspark_report, llm_engine
from benchmarks.harness.shared_weights import share_weights, target_model

CONTROL = "no-spec-b"


def _method(cfg: EngineConfig) -> str | None:
    return (cfg.speculative_config or {}).get("method")


def build_order(configs: list[EngineConfig]) -> list[EngineConfig]:
    """no-spec first, then the DSpark (and other non-n-gram) configurations, the control, the n-gram ones."""
    names = [c.name for c in configs]
    if "no-spec" not in names:
        raise ValueError(f"lockstep needs the no-spec configuration to compare against (got {', '.join(names)})")
    if CONTROL in names:
        raise ValueError(f"{CONTROL!r} is the lockstep control's name; rename that configuration")
    ngram = [c for c in configs if _method(c) == "ngram"]
    rest = [c for c in configs if c.name != "no-spec" and c not in ngram]
    base = next(c for c in configs if c.name == "no-spec")
    return [base, *rest, EngineConfig(CONTROL), *ngram]


def speedups(rates: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per-repeat speed-up of each engine: against no-spec for the control (the A/A), against the
    geometric mean of no-spec and the control for everything else."""
    a, b = rates["no-spec"], rates[CONTROL]
    base = [math.sqrt(x * y) for x, y in zip(a, b, strict=True)]
    out = {}
    for name, r in rates.items():
        ref = a if name == CONTROL else base
        out[name] = [x / y for x, y in zip(r, ref, strict=True)]
    return out


def _step_all(engines: dict, order: list[str], seconds: dict[str, float], steps: dict[str, int],
              done: dict[str, dict[str, list[int]]]) -> None:
    """Round after round, one ``step()`` of every engine with unfinished requests, until all are done."""
    live = [n for n in order if engines[n].llm_engine.has_unfinished_requests()]
    while live:
        for name in live:
            eng = engines[name].llm_engine
            t = time.perf_counter()
            outs = eng.step()
            seconds[name] += time.perf_counter() - t
            steps[name] += 1
            for o in outs:
                if o.finished:
                    done[name][o.request_id] = list(o.outputs[0].token_ids)
        live = [n for n in live if engines[n].llm_engine.has_unfinished_requests()]


def _scheduler(llm):
    """The in-process engine core's scheduler (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


@contextlib.contextmanager
def batch_of(engines: dict, c: int):
    """Every engine runs at most ``c`` requests at once, as with ``max_num_seqs`` ``c``: the scheduler's
    admission limit, lowered for a cell (the runner keeps the slots of the engine's ``max_num_seqs``)."""
    old = {n: _scheduler(llm).max_num_active_reqs for n, llm in engines.items()}
    for n, llm in engines.items():
        _scheduler(llm).max_num_active_reqs = min(c, old[n])
    try:
        yield
    finally:
        for n, llm in engines.items():
            _scheduler(llm).max_num_active_reqs = old[n]


def run_cell(engines: dict, cell: list, c: int, params, order: list[str], tag: str,
             queued: bool = False) -> dict[str, dict]:
    """One repeat of a cell: every engine gets the cell's prompts in waves of ``c``, stepped in lockstep;
    ``queued``: all of them at once, at most ``c`` running (a full batch of ``c`` while the queue lasts, as
    a server's). Returns per engine: outputs (prompt order), output tokens, seconds in ``step()``, steps."""
    seconds = dict.fromkeys(order, 0.0)
    steps = dict.fromkeys(order, 0)
    done: dict[str, dict[str, list[int]]] = {n: {} for n in order}
    for llm in engines.values():
        llm.reset_prefix_cache()  # see e2e._generate: repeats must not time prefix-cache hits on one side only
    ids = []
    size = len(cell) if queued else c
    for i in range(0, len(cell), size):
        wave = [f"{tag}-{j}" for j in range(i, min(i + size, len(cell)))]
        ids += wave
        for name in order:
            for rid, prompt in zip(wave, _inputs(cell[i:i + size])):
                engines[name].llm_engine.add_request(rid, prompt, params)
        with batch_of(engines, c) if queued else contextlib.nullcontext():
            _step_all(engines, order, seconds, steps, done)
    out = {}
    for name in order:
        outputs = [done[name][rid] for rid in ids]
        out[name] = {"outputs": outputs, "tokens": sum(len(t) for t in outputs), "seconds": seconds[name],
                     "steps": steps[name]}
    return out


def rotated(built: list[EngineConfig], b: int) -> list[EngineConfig]:
    """Build ``b``'s order: the bracketed engines rotated by ``b`` places; n-gram ones stay last."""
    ngram = [c for c in built if _method(c) == "ngram"]
    rest = [c for c in built if c not in ngram]
    k = b % len(rest)
    return rest[k:] + rest[:k] + ngram


def _build(pair: Pair, order: list[EngineConfig], cells: list, *, repeats: int, max_tokens: int, max_seqs: int,
           env: dict, ignore_eos: bool, tag: str, log, share: bool = False, queued: bool = False) -> dict:
    """Build the engines in ``order``, run every cell ``repeats`` times in lockstep, close them.
    Returns, per cell index, the runs and the DSpark engines' counter deltas."""
    out: dict = {}
    with contextlib.ExitStack() as stack:
        engines = {}
        for cfg in order:
            t0 = time.monotonic()
            engines[cfg.name] = stack.enter_context(llm_engine(
                pair.target, speculative_config=cfg.speculative_config, env={**cfg.env, **env},
                dtype=pair.dtype, max_model_len=pair.max_model_len, max_num_seqs=max_seqs,
                served_model_name=cfg.name))
            log(f"[{tag}] [{cfg.name}] in-process engine up in {time.monotonic() - t0:.0f} s")
        names = list(engines)
        if share:
            src = target_model(engines[names[0]])
            for n in names[1:]:
                k = share_weights(target_model(engines[n]), src)
                log(f"[{tag}] [{n}] reads {names[0]}'s target weights ({k} tensors and packed linears shared)")
        warm = cells[0][3][:2]
        run_cell(engines, warm, len(warm), _params(8, 0.0), names, f"{tag}-warm")
        dspark = [c.name for c in order if _method(c) == "dspark"]
        for ci, (_, temp, c, cell) in enumerate(cells):
            params = _params(max_tokens, temp, ignore_eos)
            before = {n: dspark_report(engines[n]) for n in dspark}
            runs = [run_cell(engines, cell, c, params, names if rep % 2 == 0 else names[::-1], f"{tag}c{ci}r{rep}",
                             queued) for rep in range(repeats)]
            deltas = {}
            for n, was in before.items():
                now = dspark_report(engines[n])
                assert now is not None and was is not None
                deltas[n] = {k: _delta(now[k], was[k]) for k in ("stats", "timings_s")}
                log(f"[{tag}] [{n}] {cells[ci][0]} C={c}: {policy_line(deltas[n]['stats'], now)}")
            out[ci] = {"runs": runs, "dspark": deltas}
    return out


def policy_line(stats: dict, report: dict) -> str:
    """What a DSpark engine did in a cell and the state its budget ended in: a record whose drafter sat idle
    says so in the run's log (drafts / verified / accepted per source)."""
    by = "; ".join(f"{k} {v['drafts']}/{v['verified']}/{v['accepted']}" for k, v in stats["by_source"].items())
    p, c = report["policy"], report.get("costs") or {}
    return (f"{stats['steps']} steps, {stats['steps_skipped']} without a draft; drafts/verified/accepted: "
            f"{by or 'none'}; budget {p['state']} (period {p['period']}, wait {p['wait']}, stops {p['stops']}, "
            f"softened {p['softened']}); cost scales verify {c.get('scale_verify', 1):.2f}, "
            f"draft {c.get('scale_draft', 1):.2f}")


def _sum(a: dict, b: dict) -> dict:
    """Two builds' counter deltas added up (nested dicts of numbers and lists of numbers)."""
    return {k: _sum(a[k], v) if isinstance(v, dict) else
            ([x + y for x, y in zip(a[k], v)] if isinstance(v, list) else
             (a[k] + v if isinstance(v, (int, float)) else v)) for k, v in b.items()}


def run_lockstep(pair: Pair, configs: list[EngineConfig], datasets: dict[str, list], *, concurrencies=(1,),
                 temperatures=(0.0,), max_tokens: int = 256, repeats: int = 3, builds: int = 1,
                 prompts_per_cell=None, log=print, kv_cache_gib: int = 2, ignore_eos: bool = False,
                 share: bool = False, queued: bool = False) -> list[dict]:
    """Every configuration (and the control) in lockstep, cell by cell: ``builds`` times built, in
    rotated orders, each build measuring every cell ``repeats`` times. Rows as
    ``e2e.run_interleaved`` gives them, with ``lockstep`` details and the control's row. ``share``:
    every engine reads the first-built engine's target weights (:mod:`.shared_weights`)."""
    if repeats < 1 or builds < 1:
        raise ValueError(f"repeats and builds must be >= 1, not {repeats} and {builds}")
    built = build_order(configs)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    cells = list(_cells(datasets, temperatures, concurrencies, prompts_per_cell))
    results = [_build(pair, rotated(built, b), cells, repeats=repeats, max_tokens=max_tokens,
                      max_seqs=max(concurrencies), env=env, ignore_eos=ignore_eos, tag=f"build {b + 1}/{builds}",
                      log=log, share=share, queued=queued) for b in range(builds)]
    rows = []
    names = [c.name for c in built]
    for ci, (ds, temp, c, cell) in enumerate(cells):
        runs = [r for res in results for r in res[ci]["runs"]]
        rates = {n: [r[n]["tokens"] / r[n]["seconds"] for r in runs] for n in names}
        ups = speedups(rates)
        for cfg in built:
            name = cfg.name
            r, s = rates[name], ups[name]
            row = {**repeats_row(pair, name, ds, c, temp, len(cell), r),
                   "output_tokens": sum(x[name]["tokens"] for x in runs), "outputs": runs[0][name]["outputs"],
                   "speedup_median": statistics.median(s), "speedup_spread": [min(s), max(s)],
                   "lockstep": {"steps": [x[name]["steps"] for x in runs], "builds": builds,
                                "shared_weights": share,
                                "speedup_per_build": [statistics.median(s[b * repeats:(b + 1) * repeats])
                                                      for b in range(builds)],
                                "against": "no-spec" if name == CONTROL else f"sqrt(no-spec x {CONTROL})"}}
            deltas = [res[ci]["dspark"][name] for res in results if name in res[ci]["dspark"]]
            if deltas:
                row["dspark"] = functools.reduce(_sum, deltas)
                row.update(proposer_acceptance(row["dspark"]["stats"]))
            elif cfg.speculative_config:
                row["acceptance_note"] = "not measured: several engines share this process's metrics"
            rows.append(row)
            log(f"[{name}] {ds} C={c} T={temp:g}: {row['tokens_per_s']:.1f} tok/s "
                f"(repeats {', '.join(f'{x:.1f}' for x in r)}), speed-up {row['speedup_median']:.3f}x "
                f"[{min(s):.3f}-{max(s):.3f}] against {row['lockstep']['against']}; by build "
                + ", ".join(f"{x:.3f}" for x in row["lockstep"]["speedup_per_build"]))
    return rows
