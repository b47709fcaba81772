#!/usr/bin/env python3
"""One-command GPU check of the Markov draft op's CUDA build.

For the first GPU machine this project gets. What that machine needs: Python,
torch with CUDA, and nvcc. It does not need vLLM, pytest, an install of this
package, or any network, and nothing travels with the tree but the tree itself.
From the repository root:

    python3 scripts/gpu_check.py     # report in docs/benchmarks/gpu-check/

With this workplace's device tool, the exact call is

    run(command="PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py", timeout_s=540)

When ``$OUT`` is set (the tool's output folder), the script also copies
``report.md``, ``report.json`` and ``build.log`` to ``$OUT/gpu-check/``, so
that they come back. Copy them into ``docs/benchmarks/gpu-check/``. The run
needs the tree that travels (tracked plus untracked-not-ignored files) to be at
most 64 MiB. ``report.json``'s ``carry`` and the dry run say whether it is.
The whole tree is not (about 88 MiB, mostly four weight files, while this
check needs 0.2 MiB of it): ``python scripts/device_tree.py slim`` takes the
weights off the tree for the run and ``restore`` puts them back (see
``docs/markov-op.md``).

In under 8 minutes (``--budget-s``, 420 s by default; each part stops
starting new work when its share is spent) it does four things:

1. **Build.** It builds ``vllm_dspark._C`` with its CUDA glue, in place, with
   ``python3 setup.py build_ext --inplace``. setup.py adds ``csrc/*_cuda.cpp``
   and ``csrc/*.cu`` when torch is a CUDA build. The build is for this GPU's
   architecture only (``TORCH_CUDA_ARCH_LIST``).
2. **Tests.** It runs ``CUDA_CHECKS`` from ``tests/ops/markov_cases.py``. That
   is the same list ``tests/ops/test_markov_cuda.py`` runs under pytest: the
   kernel against ``markov_draft_reference`` over batch 1 to 64, vocab 111,
   5000 and 163840, fp32/bf16/fp16, greedy/sampled/mixed, pruned and dense; the
   upstream-style loop on clear winners; the NaN, anchor and length policies;
   host tensors refused; CUDA-graph capture. Cheap checks go first, and a check
   left when time runs out is reported "not run".
3. **Timing.** It times the raw op (``torch.ops.vllm_dspark.markov_draft``,
   preallocated outputs, ``max_norms`` given) against the dense torch loop
   (per position: gather, ``w1[prev] @ w2.T``, add, argmax). The sizes are
   K3's: vocab 163,840, rank 256, block 7, batch 1/8/64, bf16, greedy, on the
   ``peaky`` and ``flat`` logits of ``benchmarks/bench_markov_op.py``. There are
   three timings: eager back to back (L2 warm), eager after a 256 MiB L2 flush,
   and CUDA-graph replay. Each is the median of CUDA-event times. Every timed
   op output is also checked against the reference.
4. **Report.** It writes ``report.json`` (schema ``gpu-check/1``) and
   ``report.md`` under ``--out``: by default ``docs/benchmarks/gpu-check/``,
   or ``build/gpu-check/`` for a dry run, so that a dry run never overwrites
   a GPU report.

``--dry-run`` skips the build and everything on CUDA. It is also what happens
when there is no CUDA device. It still writes the same report, with every CUDA
part marked "not run", and it measures what would travel. CI runs it, in
``tests/ops/test_gpu_check.py``.

Exit status: 0 when every part that ran passed (a dry run passes), 1 when
anything failed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.ops.markov_cases import CUDA_CHECKS, Check, clear_case_cache, upstream_loop  # noqa: E402
from vllm_dspark.ops import markov as M  # noqa: E402
from vllm_dspark.ops.markov_reference import (  # noqa: E402
    markov_draft_reference,
    markov_max_norms,
    markov_row_norms,
)

SCHEMA = "gpu-check/1"
NOT_RUN = "not run"
CARRY_LIMIT = 64 * 2**20  # bytes of working tree the device tool carries
# What this check reads on the GPU machine: the build, the op's Python face, the cases.
NEEDED = ("setup.py", "pyproject.toml", "README.md", "csrc", "vllm_dspark/__init__.py", "vllm_dspark/ops",
          "tests/__init__.py", "tests/ops/__init__.py", "tests/ops/markov_cases.py", "scripts/gpu_check.py",
          "benchmarks/bench_markov_op.py")
BENCH: dict[str, Any] = dict(vocab=163840, rank=256, block=7, batches=(1, 8, 64), regimes=("peaky", "flat"),
             dtype="bf16", mode="greedy")
BENCH_RESERVE_S = 75.0  # of the budget kept for the timing part


def _bench_inputs():
    """benchmarks/bench_markov_op.py's ``make_inputs`` (its peaky/flat regimes)."""
    spec = importlib.util.spec_from_file_location("bench_markov_op", ROOT / "benchmarks" / "bench_markov_op.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_inputs


# ------------------------------------------------------------------ environment and carry
def _cmd_output(cmd: list[str], cwd: Path = ROOT) -> str | None:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _csrc_digest() -> str:
    h = hashlib.sha256()
    for p in sorted((ROOT / "csrc").iterdir()):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def environment(cuda: bool) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvcc": None,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "git_commit": _cmd_output(["git", "rev-parse", "HEAD"]),
        "git_dirty": None,
        "csrc_sha256": _csrc_digest(),  # identifies the kernel source where git is not there
        "device": None,
    }
    nvcc = shutil.which("nvcc")
    if nvcc:
        out = _cmd_output([nvcc, "--version"])
        env["nvcc"] = out.splitlines()[-1] if out else nvcc
    status = _cmd_output(["git", "status", "--porcelain"])
    if status is not None:
        env["git_dirty"] = bool(status)
    if cuda:
        p = torch.cuda.get_device_properties(0)
        env["device"] = {"name": p.name, "capability": f"{p.major}.{p.minor}",
                         "sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1)}
    return env


def _size(path: Path) -> int | None:
    try:
        return path.lstat().st_size  # a link travels as a link
    except OSError:
        return None  # listed by git but not on disk: does not travel


def carry(root: Path = ROOT) -> dict[str, Any]:
    """What the device tool carries (tracked + untracked-not-ignored files) against its limit."""
    listing = _cmd_output(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root)
    if listing is None:
        return {"status": NOT_RUN, "reason": "not a git checkout (or no git)", "limit_bytes": CARRY_LIMIT}
    sizes = {f: s for f in listing.split("\0") if f and (s := _size(root / f)) is not None}
    needed = {f: s for f, s in sizes.items() if any(f == n or f.startswith(n + "/") for n in NEEDED)}
    tree = sum(sizes.values())
    return {
        "status": "passed" if tree <= CARRY_LIMIT else "failed",
        "limit_bytes": CARRY_LIMIT,
        "tree_bytes": tree,
        "tree_files": len(sizes),
        "tree_ok": tree <= CARRY_LIMIT,
        "needed_bytes": sum(needed.values()),
        "needed_files": len(needed),
        "needed_ok": sum(needed.values()) <= CARRY_LIMIT,
        "largest": [[f, s] for f, s in sorted(sizes.items(), key=lambda kv: -kv[1])[:8]],
    }


def imported(prefixes=("vllm", "pytest")) -> dict[str, bool]:
    return {p: any(m == p or m.startswith(p + ".") for m in sys.modules) for p in prefixes}


# ------------------------------------------------------------------ 1. build
def build(out: Path, timeout_s: float) -> dict[str, Any]:
    major, minor = torch.cuda.get_device_capability(0)
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=f"{major}.{minor}", MAX_JOBS=str(os.cpu_count() or 4))
    for k in ("VLLM_DSPARK_NO_CUDA", "VLLM_DSPARK_NO_EXT"):
        env.pop(k, None)
    cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
    res: dict[str, Any] = {"command": f"TORCH_CUDA_ARCH_LIST={major}.{minor} " + " ".join(cmd[1:]),
                           "log": "build.log"}
    t0 = time.monotonic()
    with open(out / "build.log", "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=max(timeout_s, 1.0))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    res["seconds"] = round(time.monotonic() - t0, 1)
    if rc != 0:
        res.update(status="failed", error="timed out" if rc is None else f"exit status {rc}",
                   log_tail=(out / "build.log").read_text(errors="replace")[-3000:])
        return res
    if not M.is_compiled_available("cuda"):
        res.update(status="failed", error=f"built, but no CUDA kernel is registered ({M._load_error})")
        return res
    res["status"] = "passed"
    return res


# ------------------------------------------------------------------ 2. tests
def run_checks(deadline: float | None, device: str = "cuda", checks: list[Check] | None = None) -> dict[str, Any]:
    """The CUDA checks in order (default: all of ``CUDA_CHECKS``) on ``device``; deadline None:
    a dry run (nothing runs). ``device="cpu"`` runs them on the CPU twin (the tests do)."""
    cases: list[dict[str, Any]] = []
    for c in CUDA_CHECKS if checks is None else checks:
        if deadline is None:
            cases.append({"name": c.name, "status": NOT_RUN})
            continue
        if time.monotonic() > deadline:
            cases.append({"name": c.name, "status": NOT_RUN, "reason": "time budget"})
            continue
        t0 = time.monotonic()
        case: dict[str, Any] = {"name": c.name}
        try:
            c.run(device)
            if device == "cuda":
                torch.cuda.synchronize()
            case["status"] = "passed"
        except AssertionError as exc:
            case.update(status="failed", error=(str(exc) or traceback.format_exc(limit=3))[-1500:])
        except Exception as exc:  # a kernel fault or an op error: reported, the rest still runs
            case.update(status="error", error=f"{type(exc).__name__}: {exc}"[-1500:])
        case["seconds"] = round(time.monotonic() - t0, 2)
        cases.append(case)
        print(f"  {case['status']:7s} {c.name} ({case['seconds']} s)", flush=True)
    clear_case_cache()
    counts = {s: sum(x["status"] == s for x in cases) for s in ("passed", "failed", "error", NOT_RUN)}
    if deadline is None:
        status = NOT_RUN
    else:
        status = "passed" if counts["failed"] == counts["error"] == counts[NOT_RUN] == 0 else "failed"
    return {"status": status, "counts": counts, "cases": cases}


# ------------------------------------------------------------------ 3. timing
def _median_ms(fn, iters: int, device: str, flush: torch.Tensor | None = None) -> float:
    """Median wall time of ``fn`` in ms: CUDA events on CUDA, perf_counter on the CPU."""
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()  # outside the timed window: evicts L2 (60 MB on an H200)
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _graph_ms(fn, iters: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return _median_ms(g.replay, iters, "cuda")


def bench_row(R: int, regime: str, make_inputs, iters: int, *, device: str = "cuda",
              vocab: int | None = None) -> dict[str, Any]:
    """One timing row: the raw op vs the dense loop on the same inputs, both checked.
    ``device="cpu"`` (and a small ``vocab``) exercises the same code without a GPU."""
    V, rank, B = vocab or int(BENCH["vocab"]), int(BENCH["rank"]), int(BENCH["block"])
    cuda = device == "cuda"
    inp = make_inputs(R, B, V, rank, torch.bfloat16, regime, device)
    norms = markov_row_norms(inp["markov_w2"])                 # once per model
    max_norms = markov_max_norms(inp["markov_w1"], norms)      # once per model
    temp = torch.zeros(R, device=device)
    tokens = torch.empty(R, B, dtype=torch.int64, device=device)
    conf = torch.empty(R, B, device=device)
    stats = torch.empty(R, B, dtype=torch.int32, device=device)

    def op():
        torch.ops.vllm_dspark.markov_draft(
            inp["base_logits"], inp["anchor_ids"], inp["markov_w1"], inp["markov_w2"], norms,
            inp["conf_base"], inp["conf_w_markov"], temp, inp["seeds"], tokens, conf, None, stats,
            max_norms)

    def loop():
        return upstream_loop(inp)

    op()
    ref = markov_draft_reference(inp["base_logits"], inp["anchor_ids"], inp["markov_w1"], inp["markov_w2"],
                                 inp["conf_base"], inp["conf_w_markov"], temp, inp["seeds"])
    row: dict[str, Any] = {
        "batch": R, "regime": regime, "vocab": V,
        "matches_reference": bool(torch.equal(tokens, ref[0])
                                  and torch.allclose(conf, ref[1], atol=1e-6, rtol=0)),
        "matches_loop": bool(torch.equal(tokens, loop())),
        "exact_scores_per_row": round(stats.float().mean().item(), 1),
        "dense_rows": int((stats == V).sum().item()),
        "rows": R * B,
    }
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if cuda else None
    for name, fn in (("op", op), ("loop", loop)):
        for _ in range(3):
            fn()
        row[f"{name}_warm_ms"] = round(_median_ms(fn, iters, device), 4)
        row[f"{name}_cold_ms"] = round(_median_ms(fn, iters, device, flush), 4) if cuda else None
        row[f"{name}_graph_ms"] = None
        if cuda:
            try:
                row[f"{name}_graph_ms"] = round(_graph_ms(fn, iters), 4)
            except Exception as exc:  # capture refused: reported, not fatal
                row[f"{name}_graph_error"] = f"{type(exc).__name__}: {exc}"[-500:]
    for mode in ("warm", "cold", "graph"):
        o, lp = row.get(f"op_{mode}_ms"), row.get(f"loop_{mode}_ms")
        row[f"speedup_{mode}"] = round(lp / o, 2) if o and lp else None
    # A timed op call that stopped matching would make its time meaningless.
    row["matches_reference_after_timing"] = bool(torch.equal(tokens, ref[0]))
    row["status"] = "passed" if row["matches_reference"] and row["matches_reference_after_timing"] else "failed"
    return row


def run_bench(deadline: float | None, iters: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in BENCH.items()}
    config["iters"] = iters
    make_inputs = _bench_inputs() if deadline is not None else None
    for regime in BENCH["regimes"]:
        for R in BENCH["batches"]:
            base = {"batch": R, "regime": regime}
            if deadline is None:
                rows.append({**base, "status": NOT_RUN})
            elif time.monotonic() > deadline:
                rows.append({**base, "status": NOT_RUN, "reason": "time budget"})
            else:
                try:
                    rows.append(bench_row(R, regime, make_inputs, iters))
                except Exception as exc:
                    rows.append({**base, "status": "error", "error": f"{type(exc).__name__}: {exc}"[-1500:]})
                torch.cuda.empty_cache()  # the row's inputs are gone with its frame
                print(f"  bench {regime} R={R}: {rows[-1].get('status')}", flush=True)
    if deadline is None:
        status = NOT_RUN
    else:
        status = "passed" if all(r["status"] == "passed" for r in rows) else "failed"
    return {"status": status, "config": config, "rows": rows}


# ------------------------------------------------------------------ 4. report
def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MiB"


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.3f}" if x < 10 else f"{x:.1f}"
    return str(x)


def markdown(rep: dict[str, Any]) -> str:
    env, b, t, bench, c = rep["environment"], rep["build"], rep["tests"], rep["bench"], rep["carry"]
    dev = env.get("device") or {}
    lines = [
        "# GPU check of the Markov draft op",
        "",
        f"Command: `{rep['command']}` ({rep['mode']}{': ' + rep['mode_reason'] if rep.get('mode_reason') else ''}). "
        f"Started {rep['started']}, {rep['wall_s']} s. Overall: **{rep['status']}**.",
        "",
        f"- device: {dev.get('name', NOT_RUN)} (sm {dev.get('capability', '-')}, {dev.get('sms', '-')} SMs, "
        f"{dev.get('memory_gib', '-')} GiB); torch {env['torch']} (CUDA {env['torch_cuda']}); "
        f"nvcc: {env['nvcc']}; Python {env['python']}; {env['cpus']} CPUs",
        f"- tree: commit {env['git_commit']}{' (with local changes)' if env.get('git_dirty') else ''}; "
        f"imports: vllm {'YES' if rep['imports']['vllm'] else 'no'}, "
        f"pytest {'YES' if rep['imports']['pytest'] else 'no'}",
        f"- carry: {c['status']}: the travelling tree is {_mib(c.get('tree_bytes'))} in "
        f"{c.get('tree_files', '?')} files (limit {_mib(c['limit_bytes'])}); what this check needs: "
        f"{_mib(c.get('needed_bytes'))}",
        "",
        "## Build",
        "",
        f"{b['status']}" + (f" in {b['seconds']} s" if "seconds" in b else "")
        + (f": `{b['command']}`" if "command" in b else "") + (f" ({b['reason']})" if "reason" in b else "")
        + (f"; error: {b['error']}" if "error" in b else ""),
        "",
        "## CUDA op checks (tests/ops/markov_cases.py `CUDA_CHECKS`)",
        "",
        f"{t['status']}: " + ", ".join(f"{v} {k}" for k, v in t["counts"].items())
        + (f" ({t['reason']})" if "reason" in t else ""),
    ]
    bad = [x for x in t["cases"] if x["status"] in ("failed", "error")]
    if bad:
        lines += ["", "| check | status | error |", "|---|---|---|"]
        for x in bad:
            first = (x.get("error") or "").splitlines()[:1]
            lines.append(f"| {x['name']} | {x['status']} | {first[0][:200] if first else ''} |")
    cfg = bench["config"]
    lines += [
        "",
        "## Kernel vs dense torch loop",
        "",
        f"{bench['status']}" + (f" ({bench['reason']})" if "reason" in bench else "")
        + f". vocab {cfg['vocab']}, rank {cfg['rank']}, block {cfg['block']}, {cfg['dtype']}, {cfg['mode']}; "
        f"median of {cfg['iters']} CUDA-event timings; warm = back to back, "
        "cold = after a 256 MiB L2 flush, graph = CUDA-graph replay. Loop: per position gather, "
        "`w1[prev] @ w2.T`, add, argmax.",
        "",
        "| batch | regime | op warm ms | loop warm ms | op cold ms | loop cold ms | op graph ms | loop graph ms "
        "| speed-up (graph) | exact scores / row | dense rows | == reference | == loop | status |",
        "|" + "---|" * 14,
    ]
    for r in bench["rows"]:
        lines.append("| " + " | ".join(_fmt(r.get(k)) for k in (
            "batch", "regime", "op_warm_ms", "loop_warm_ms", "op_cold_ms", "loop_cold_ms", "op_graph_ms",
            "loop_graph_ms", "speedup_graph", "exact_scores_per_row", "dense_rows", "matches_reference",
            "matches_loop")) + f" | {r['status']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="where report.json, report.md and build.log go (default: docs/benchmarks/gpu-check, "
                         "build/gpu-check for a dry run)")
    ap.add_argument("--dry-run", action="store_true", help="no build, nothing on CUDA (automatic without CUDA)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget of the whole check")
    ap.add_argument("--no-build", action="store_true", help="use the vllm_dspark._C that is already built")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per timing")
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    cuda = torch.cuda.is_available()
    dry = args.dry_run or not cuda
    reason = ("--dry-run" if args.dry_run else "no CUDA device") if dry else None
    if args.out is None:
        args.out = ROOT / "build" / "gpu-check" if dry else ROOT / "docs" / "benchmarks" / "gpu-check"
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = t_start + args.budget_s
    print(f"gpu_check: {'dry run (' + str(reason) + ')' if dry else 'CUDA'}; report in {args.out}", flush=True)

    rep: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": "dry-run" if dry else "cuda",
        "mode_reason": reason,
        "command": "python3 scripts/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": started,
        "environment": environment(cuda and not dry),
        "carry": carry(),
    }
    if dry:
        rep["build"] = {"status": NOT_RUN, "reason": str(reason)}
        rep["tests"] = {**run_checks(None), "reason": str(reason)}
        rep["bench"] = {**run_bench(None, args.iters), "reason": str(reason)}
    else:
        if args.no_build:
            ok = M.is_compiled_available("cuda")
            rep["build"] = {"status": "passed" if ok else "failed", "reason": "--no-build: the existing build",
                            **({} if ok else {"error": f"no CUDA kernel registered ({M._load_error})"})}
        else:
            print("gpu_check: building vllm_dspark._C with CUDA ...", flush=True)
            rep["build"] = build(args.out, deadline - BENCH_RESERVE_S - 60 - time.monotonic())
            print(f"gpu_check: build {rep['build']['status']} ({rep['build'].get('seconds')} s)", flush=True)
        if rep["build"]["status"] == "passed":
            print("gpu_check: CUDA op checks ...", flush=True)
            rep["tests"] = run_checks(deadline - BENCH_RESERVE_S)
            print("gpu_check: timing at K3 sizes ...", flush=True)
            rep["bench"] = run_bench(deadline, args.iters)
        else:
            why = "the build failed"
            rep["tests"] = {**run_checks(None), "reason": why}
            rep["bench"] = {**run_bench(None, args.iters), "reason": why}
    rep["imports"] = imported()
    parts = [rep[k]["status"] for k in ("build", "tests", "bench")]
    if dry:
        rep["status"] = "dry run" if not any(rep["imports"].values()) else "failed"
    else:
        rep["status"] = "passed" if all(s == "passed" for s in parts) and not rep["imports"]["vllm"] else "failed"
    rep["wall_s"] = round(time.monotonic() - t_start, 1)
    (args.out / "report.json").write_text(json.dumps(rep, indent=1) + "\n")
    (args.out / "report.md").write_text(markdown(rep))
    if os.environ.get("OUT"):  # the device tool's output folder: what is there comes back
        back = Path(os.environ["OUT"]) / "gpu-check"
        back.mkdir(parents=True, exist_ok=True)
        for name in ("report.json", "report.md", "build.log"):
            if (args.out / name).exists():
                shutil.copy(args.out / name, back / name)
    print(markdown(rep), flush=True)
    return 0 if rep["status"] in ("passed", "dry run") else 1


if __name__ == "__main__":
    sys.exit(main())
