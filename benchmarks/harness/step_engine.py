"""vLLM's engine core as the step-cost benchmark drives it: one engine step at a time, timed by phase.

Two engines are built in the worker process (:mod:`.step_worker`):

- ``plain``: vLLM's V1 engine core, in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), no
  speculation. A cell adds ``batch`` requests and calls ``EngineCore.step()`` + ``post_step()``
  (what the engine's busy loop calls) itself; every step is timed with ``perf_counter``.
- ``spec``: the same with DSpark (``num_speculative_tokens`` = the block, ``verification:
  fixed``). Before a cell the proposer's ``settings.max_draft_tokens`` is set to ``k``: every
  request then sends exactly ``k`` drafts (``k = 0``: the proposer takes its no-draft path, the
  one the budget takes when drafting does not pay: the drafter only stores the new tokens'
  context K/V and the target runs a 1-token decode step).

A cell runs for at least ``min_seconds`` and ``min_steps`` steps after ``warmup`` steps; only
steps whose scheduled shape is exactly ``batch x (1 + k)`` tokens count, and its value is the
median step. Prompts are distinct random token sequences of ``prompt_len`` tokens, re-added
for every cell; with prefix caching, the re-added prompt's full blocks hit the cache, so a
cell starts with a 1-token "prefill" and the context stays near ``prompt_len`` (recorded per
cell).

Per-phase wall times come from timers wrapped around the scheduler's, the model runner's and
the proposer's methods (instance attributes, nothing in vLLM or in ``spec_decode/`` is
edited); a separate, shorter pass under ``torch.profiler`` splits the target forward by
operator class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.step_common import EngineSpec, classify_op, random_prompts, run_until, typical_mean


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


def capture_vllm_logits(server: EngineServer, prompt: list[int], k: int, steps: int = 3) -> list[dict]:
    """Batch 1: run ``prompt`` and capture, for ``steps`` uniform steps of 1 + k tokens, the step's input
    ids, its first position, the request's tokens before it, and the target's logits."""
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
    return got
