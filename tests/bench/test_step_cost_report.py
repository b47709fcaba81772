"""The step-cost record's report is made from its results.json alone: the committed record's
report.md and plots come out again as committed (``bench_step_cost.py --render-only``), and the
analysis and report follow the cells they are made of."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.harness.step_cost_report import analyse, int_keys, report, slim

ROOT = Path(__file__).resolve().parents[2]
# The current step-cost record (docs/benchmarks/README.md).
RECORD = ROOT / "docs" / "benchmarks" / "step-cost-floor-in-pair"


def _load() -> dict:
    return json.loads((RECORD / "results.json").read_text(), object_hook=int_keys)


def test_the_committed_record_is_what_its_results_say():
    # The record keeps the analysis and a digest of its cells (slim), from which the report comes out
    # as committed; the results stay under the records' 100 KB.
    result = _load()
    assert all("cells" not in rec and "cells_digest" in rec for rec in result["dtypes"].values())
    assert report(result) == (RECORD / "report.md").read_text()
    assert (RECORD / "results.json").stat().st_size <= 100_000


def _cells(target_over_floor: float) -> list[dict]:
    """Three lockstep repeats at batch 1 of a plain step, k = 0 and k = 7 and the floor at q = 1 and 8."""
    def cell(kind, x, r, median_s, target=None):
        steps = [median_s * (1 + 0.01 * i) for i in range(6)]
        return {"kind": kind, "batch": 1, "x": x, "repeat": r, "median_s": median_s, "step_s": steps,
                "target_s": [target or median_s] * 6, "model_s": [0.8 * median_s] * 6, "context_mean": 300.0,
                "phases_mean_s": {"forward": 0.5 * median_s, "step": median_s},
                "timers_mean_s": {"drafter.layout": 0.001}, "lockstep_rounds": 6, "foreign_cpu_share": 0.01 * r}
    out = []
    for r in range(3):
        out += [cell("plain", 0, r, 0.010), cell("spec", 0, r, 0.0101), cell("floor", 1, r, 0.009),
                cell("floor", 8, r, 0.012), cell("spec", 7, r, 0.015, target=0.012 * target_over_floor)]
    return out


def _synthetic(target_over_floor: float) -> dict:
    result = _load()
    rec = result["dtypes"]["bfloat16"]
    rec.pop("cells_digest")
    rec["cells"], rec["profiles"] = _cells(target_over_floor), []
    rec["analysis"] = analyse(rec, [1], [0, 7])
    return result


def test_the_analysis_and_report_follow_the_cells():
    on_floor, slow = _synthetic(1.0), _synthetic(10.0)
    row = on_floor["dtypes"]["bfloat16"]["analysis"]["by_batch"][1]
    assert row["plain_s"]["median"] == 0.010 and row["floor_s"][8]["median"] == 0.012
    assert abs(row["spec"][7]["target_vs_floor"]["median"] - 1.0) < 1e-9
    lines = {name: next(ln for ln in report(r).splitlines() if ln.startswith("- batch 1:"))
             for name, r in (("on_floor", on_floor), ("slow", slow))}
    assert "verify-8 target step <= 1.1x floor(8): **met**" in lines["on_floor"], lines
    assert "verify-8 target step <= 1.1x floor(8): **missed**" in lines["slow"], lines


def test_a_slim_record_reports_what_its_cells_did():
    result = _synthetic(1.0)
    thin = slim(result)
    assert "cells" not in thin["dtypes"]["bfloat16"]
    assert report(thin) == report(result)
    assert "Lockstep position check" in report(thin)


def test_render_only_rewrites_report_and_plots(tmp_path):
    out = tmp_path / "rec"
    shutil.copytree(RECORD, out)
    (out / "report.md").write_text("stale")
    for png in out.glob("*.png"):
        png.unlink()
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_step_cost.py"), "--render-only", "--out",
                          str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert (out / "report.md").read_text() == (RECORD / "report.md").read_text()
    assert (out / "results.json").read_text() == (RECORD / "results.json").read_text()
    assert sorted(p.name for p in out.glob("*.png")) == ["phases.png", "ratio_to_floor.png", "step_time.png"]
    assert all(p.stat().st_size > 10_000 for p in out.glob("*.png"))
    missing = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_step_cost.py"), "--render-only",
                              "--out", str(tmp_path / "none")], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "--render-only needs" in missing.stderr


def test_the_records_command_makes_the_same_run_today():
    # The record was run with flags of modes that are now the only ones (its args keep them); the command
    # it gives parses, with today's script, to the settings it ran with.
    import shlex

    from benchmarks.bench_step_cost import parse_args

    result = _load()
    cmd = shlex.split(result["command"])
    assert cmd[1] == "benchmarks/bench_step_cost.py" and (ROOT / cmd[1]).is_file()
    args, ran = parse_args(cmd[2:]), result["args"]
    assert ran["lockstep"] and ran["share_weights"] and ran["floor_in_pair"] and ran["no_hf"]
    for name in ("dtypes", "batches", "ks", "profile_ks", "profile_steps", "repeats", "builds", "min_seconds",
                 "min_steps", "prompt_len", "floor_context", "kv_space", "max_foreign", "retries", "lockstep_gap_ms",
                 "tolerance", "cpu_setup"):
        assert getattr(args, name) == ran[name], name
    assert str(args.out) == ran["out"]
