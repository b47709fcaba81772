"""The benchmark records stay light: each is its report, the command and the machine, and a results
file of at most 100 KB; plots are drawn again from the results (``benchmarks/plot_record.py``), not
kept; the whole of ``docs/benchmarks`` stays under 600 KB."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.plot_record import plot_record

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "docs" / "benchmarks"
RESULTS_LIMIT = 100_000
TOTAL_LIMIT = 600_000
NOT_KEPT = (".png", ".log")  # drawn or written again by the commands (.gitignore)


def _kept_files() -> list[Path]:
    """The files a clone has under docs/benchmarks (git's list where there is one)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", str(RECORDS)], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout.decode()
        tracked = [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        tracked = []
    if tracked:
        return [p for p in tracked if p.exists()]
    return [p for p in RECORDS.rglob("*") if p.is_file() and p.suffix not in NOT_KEPT]


def test_docs_benchmarks_is_light():
    files = _kept_files()
    assert files, "no records found"
    assert not [p for p in files if p.suffix in NOT_KEPT], "plots and logs are not committed"
    total = sum(p.stat().st_size for p in files)
    assert total < TOTAL_LIMIT, f"docs/benchmarks holds {total:,} bytes (limit {TOTAL_LIMIT:,})"


@pytest.mark.parametrize("record", sorted(p.name for p in RECORDS.iterdir() if p.is_dir()))
def test_each_record_is_a_report_and_a_small_results_file(record):
    d = RECORDS / record
    assert list(d.glob("*.md")), f"{record} has no report"
    results = d / "results.json"
    if results.exists():
        assert results.stat().st_size <= RESULTS_LIMIT, f"{results} is {results.stat().st_size:,} bytes"
        json.loads(results.read_text())


@pytest.mark.parametrize("record, plots", [
    ("copy-default-bf16", {"speedup.png", "acceptance_per_position.png", "step_breakdown.png"}),
    ("step-cost-floor-in-pair", {"step_time.png", "ratio_to_floor.png", "phases.png"}),
    ("load-test", {"latency.png"}),
    ("long-context", {"acceptance_vs_context.png"}),
])
def test_plots_are_drawn_again_from_the_results(record, plots, tmp_path):
    out = tmp_path / record
    shutil.copytree(RECORDS / record, out, ignore=shutil.ignore_patterns("*.png", "*.log"))
    made = plot_record(out)
    assert set(made) == plots
    assert all((out / p).stat().st_size > 10_000 for p in plots)


def test_plot_record_names_a_folder_without_results(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plot_record.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "has no results.json" in run.stderr
