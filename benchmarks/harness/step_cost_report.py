"""The step-cost record from its measurements: the analysis and ``report.md`` (the plots: :mod:`.step_cost_plots`).

:mod:`.step_cost` measures (see its docstring for what is timed and how). The run's cells
are analysed here, and the record keeps the analysis and a digest of the cells
(:func:`slim`), not the cells' step times. Everything else reads only that
``results.json``, so a record's report and plots can be made again from it
(``bench_step_cost.py --render-only --out DIR``), and the tests do exactly that for the
committed record.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Sequence
from pathlib import Path

# The proposer's phases; the dotted names are parts of the phase before them (proposer.PARTS).
DRAFTER_PARTS = ("feedback", "layout", "context_kv_only", "block_forward", "block.metadata", "block.context_kv",
                 "markov_stage", "stage.lm_head", "stage.confidence", "stage.markov_op", "stage.sampled", "verify")
# The phase split of a step: the target forward split by the profiler's operator classes (scaled to the
# timed forward), everything else from the timers.
COMBINED = ("gemm", "attention", "rope", "norms_elementwise", "aux_capture", "forward_python", "logits", "sampler",
            "rejection_sampler", "drafter", "draft_glue", "input_prep", "scheduler", "other")


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


def linear_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs (0 for fewer than two points)."""
    pts = [(float(x), float(y)) for x, y in zip(xs, ys) if y is not None and not math.isnan(float(y))]
    if len(pts) < 2:
        return 0.0
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else 0.0


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
    cells = rec["cells"]
    qs = sorted({c["x"] for c in cells if c["kind"] == "floor"})
    profs = {(p["kind"], p["batch"], p.get("k", p.get("q"))): p["ops"] for p in rec.get("profiles", [])}
    out: dict = {}
    for b in batches:
        plain = _per_repeat(cells, "plain", b, 0)
        plain_model = _per_repeat(cells, "plain", b, 0, "model_s")
        floor = {q: _per_repeat(cells, "floor", b, q) for q in qs}
        flin = {q: _per_repeat(cells, "floor_linear", b, q) for q in (1, 8)
                if any(c["kind"] == "floor_linear" for c in cells)}
        row: dict = {"plain_s": summarize(plain), "plain_model_s": summarize(plain_model),
                     "floor_s": {q: summarize(v) for q, v in floor.items()},
                     "floor_linear_s": {q: summarize(v) for q, v in flin.items()},
                     "plain_vs_floor": ratio_summary(plain, floor.get(1, [])),
                     "plain_model_vs_floor": ratio_summary(plain_model, floor.get(1, [])),
                     "spec": {}}
        for k in ks:
            st = _per_repeat(cells, "spec", b, k)
            tg = _per_repeat(cells, "spec", b, k, "target_s")
            md = _per_repeat(cells, "spec", b, k, "model_s")
            fl = floor.get(1 + k, [])
            sel = [c for c in cells if c["kind"] == "spec" and c["batch"] == b and c["x"] == k]
            row["spec"][k] = {
                "step_s": summarize(st), "target_s": summarize(tg), "model_s": summarize(md),
                "step_vs_plain": ratio_summary(st, plain), "target_vs_plain": ratio_summary(tg, plain),
                "step_vs_floor": ratio_summary(st, fl), "target_vs_floor": ratio_summary(tg, fl),
                "model_vs_floor": ratio_summary(md, fl),
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
                p: linear_slope(vk, [row["spec"][k]["phases_s"].get(p, float("nan")) for k in vk])
                for p in (*COMBINED, "step")}
            row["growth_per_draft_s"]["floor"] = linear_slope(
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


def cells_digest(cells: list[dict]) -> dict:
    """What the report reads of the cells besides the analysis, for a record that keeps no cells:
    each cell's share of other processes' CPU, and each lockstep cell's position bias."""
    return {"foreign_cpu_share": [[c["kind"], c["batch"], c["x"], c["repeat"], c.get("foreign_cpu_share", 0.0)]
                                  for c in cells],
            "position_bias": [[c["batch"], c["kind"], c["x"], position_bias(c["step_s"])]
                              for c in cells if c.get("lockstep_rounds")]}


def slim(result: dict) -> dict:
    """The record as committed: the analysis and a digest in place of every cell's step times (a
    record's results stay under 100 KB; the cells of one run were 480 KB)."""
    out = json.loads(json.dumps(result, default=json_default), object_hook=int_keys)
    for d in out["dtypes"].values():
        if "cells" in d:
            d["cells_digest"] = cells_digest(d.pop("cells"))
    return out


def lockstep_position_lines(biases: list[list], a: dict) -> list[str]:
    """The lockstep self-check: does a cell's step depend on which cell ran before it?"""
    by: dict = {}
    for b, kind, x, bias in biases:
        by.setdefault((b, kind, x), []).append(bias)
    if not by:
        return []
    parts = [f"{kind} B={b} {'k' if kind in ('plain', 'spec') else 'q'}={x} "
             f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]" for (b, kind, x), v in sorted(by.items())]
    return ["", f"Lockstep position check (a cell's median step in even rounds over odd rounds; the order "
                f"reverses each round, so an end cell follows itself every other round; near 1 when a step does "
                f"not depend on what ran before it; {a.get('lockstep_gap_ms', 0):g} ms pause before each step): "
            + "; ".join(parts) + "."]


def report(result: dict) -> str:
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
         + "**Lockstep**: each speculative cell stepped in turn with the floor at its tokens per request "
         "(the no-draft cell also with the plain decode cell), one step each per round. "
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
        digest = d["cells_digest"] if "cells_digest" in d else cells_digest(d["cells"])
        cells = [dict(zip(("kind", "batch", "x", "repeat", "foreign_cpu_share"), c, strict=True))
                 for c in digest["foreign_cpu_share"]]
        shares = [c["foreign_cpu_share"] for c in cells]
        if shares:
            bad = [c for c in cells if c["foreign_cpu_share"] > 0.2]
            L += ["", f"Other processes during the cells: median {statistics.median(shares):.2f} CPUs, max "
                  f"{max(shares):.2f} (of {result['machine'].get('cpu', {}).get('CPU(s)')}); "
                  f"{len(bad)} of {len(shares)} cells above 0.2 CPUs"
                  + (": " + ", ".join(f"{c['kind']} B={c['batch']} x={c['x']} r{c['repeat']} "
                                      f"({c['foreign_cpu_share']:.2f})" for c in bad[:12]) if bad else "") + "."]
        L += lockstep_position_lines(digest["position_bias"], a)
        L += ["", "Goals of issue 18 (met only when the whole spread allows it):", ""]
        for b, row in an.items():
            s0 = row["spec"].get(0, {})
            kmax = max(row["spec"]) if row["spec"] else 0
            s7 = row["spec"].get(kmax, {}) if kmax else {}  # a run without k > 0 has no verify step
            L.append(f"- batch {b}: no-draft step <= 1.03x plain: "
                     f"**{spread_allows(s0.get('step_vs_plain'), 1.03)}** ({rx(s0.get('step_vs_plain'))}); "
                     f"verify-8 target step <= 1.1x floor(8): "
                     f"**{spread_allows(s7.get('target_vs_floor'), 1.1)}** ({rx(s7.get('target_vs_floor'))})")
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
        L += ["", "A slower reference at the same shapes (not the floor): the floor with plain `F.linear` "
              "instead of packed oneDNN weights:", ""]
        for b, row in an.items():
            fl = row.get("floor_linear_s") or {}
            L.append(f"- batch {b}: floor F.linear q=1 {ms(fl.get(1))}, q=8 {ms(fl.get(8))} ms")
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
        # The parts a record has (records before the proposer timed the sub-parts have none of them).
        seen = {k for row in an.values() for s in row["spec"].values() for k in (s.get("drafter_parts_s") or {})}
        parts = [p for p in DRAFTER_PARTS if "." not in p or "drafter." + p in seen]
        L += ["", "The drafter's own parts (ms per step, the proposer's timings):", "",
              "| batch | k | " + " | ".join(parts) + " |", "|---" * (len(parts) + 2) + "|"]
        for b, row in an.items():
            for k, s in row["spec"].items():
                dp = s.get("drafter_parts_s") or {}
                L.append(f"| {b} | {k} | " + " | ".join(f"{1e3 * dp.get('drafter.' + p, 0.0):.2f}"
                                                      for p in parts) + " |")
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


def write_outputs(result: dict, out: Path) -> list[str]:
    plain = slim(result)
    (out / "results.json").write_text(dumps_compact(plain))
    (out / "report.md").write_text(report(plain))
    from benchmarks.harness.step_cost_plots import plots  # imports matplotlib

    return plots(plain, out)


def dumps_compact(obj) -> str:
    """Indented JSON whose innermost lists (of numbers and strings) stay on one line each."""
    text = json.dumps(obj, indent=1, default=json_default)
    return re.sub(r"\[[^\[\]{}]*\]", lambda m: " ".join(m.group(0).split()), text) + "\n"


def json_default(o):
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, float) and math.isnan(o):
        return None
    raise TypeError(type(o).__name__)


def int_keys(d: dict) -> dict:
    return {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v for k, v in d.items()}
