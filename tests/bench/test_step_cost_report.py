"""The step-cost record's report is made from its results.json alone: the committed record's
analysis, report.md and plots come out again as committed (``bench_step_cost.py --render-only``)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from vllm_dspark.tools.bench.step_cost_report import analyse, int_keys, report

ROOT = Path(__file__).resolve().parents[2]
# The current step-cost record (docs/benchmarks/README.md).
RECORD = ROOT / "docs" / "benchmarks" / "step-cost-floor-in-pair"


def _load() -> dict:
    return json.loads((RECORD / "results.json").read_text(), object_hook=int_keys)


def test_the_committed_record_is_what_its_measurements_say():
    result = _load()
    for dt, rec in result["dtypes"].items():
        again = analyse(rec, rec["args"]["batches"], rec["args"]["ks"])
        assert json.loads(json.dumps(again), object_hook=int_keys) == rec["analysis"], dt
    assert report(result) == (RECORD / "report.md").read_text()


def test_the_report_follows_the_measurements():
    # One verify-8 step at batch 1 made 10x slower in every repeat: the goal's ratio moves with it.
    result = _load()
    rec = result["dtypes"]["bfloat16"]
    for c in rec["cells"]:
        if c.get("kind") == "spec" and c.get("batch") == 1 and c.get("k") == 7:
            c["target_s"] = [10 * t for t in c["target_s"]]
            c["median_s"] = 10 * c["median_s"]
    rec["analysis"] = analyse(rec, rec["args"]["batches"], rec["args"]["ks"])
    text = report(result)
    assert text != (RECORD / "report.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("- batch 1:"))
    assert "verify-8 target step <= 1.1x floor(8): **missed**" in line, line


def test_render_only_rewrites_report_and_plots(tmp_path):
    out = tmp_path / "rec"
    shutil.copytree(RECORD, out)
    (out / "report.md").write_text("stale")
    for png in out.glob("*.png"):
        png.unlink()
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_step_cost.py"), "--render-only", "--out",
                          str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert (out / "report.md").read_text() == (RECORD / "report.md").read_text()
    assert sorted(p.name for p in out.glob("*.png")) == sorted(p.name for p in RECORD.glob("*.png"))
    assert all(p.stat().st_size > 10_000 for p in out.glob("*.png"))
    missing = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_step_cost.py"), "--render-only",
                              "--out", str(tmp_path / "none")], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "--render-only needs" in missing.stderr
