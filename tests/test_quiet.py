"""The demo's output filter, on a recorded log: library warnings out, the demo's lines, the plugin's own
lines and every failure in."""

from __future__ import annotations

import io
import sys
from pathlib import Path

from vllm_dspark.tools.quiet import OutputFilter, run_filtered

LOG = Path(__file__).resolve().parent / "fixtures" / "logs" / "demo_unfiltered.log"


def test_the_filter_keeps_the_demo_and_failures_and_hides_library_warnings():
    lines = LOG.read_text().splitlines(keepends=True)
    flt = OutputFilter()
    kept = "".join(flt.lines(lines))
    shown_warnings = [ln for ln in kept.splitlines() if "WARNING" in ln or "Warning" in ln]
    assert shown_warnings == [ln for ln in shown_warnings if "vllm_dspark:" in ln]  # only the plugin's own
    for must in ("== DSpark on SmolLM2", "-- results", "| tokens/s", "identical to no speculation",
                 "Traceback", "ValueError", "    The capital of France is Paris."):
        assert must in kept, must
    for gone in ("Triton", "FutureWarning", "warnings.warn(", "[W1203", "chunked prefill", "Enforce eager"):
        assert gone not in kept, gone
    assert "vllm_dspark: the budget's cost profile" in kept
    assert flt.hidden == 9  # 5 log warnings, a Python warning and its echo, torch's C++ line, Triton


def test_run_filtered_streams_a_child_and_returns_its_code():
    out = io.StringIO()
    code = run_filtered([sys.executable, "-c", "import sys; print('mine'); "
                         "print('(EngineCore pid=1) WARNING 12-03 x', file=sys.stderr); sys.exit(3)"], out=out)
    assert code == 3
    assert out.getvalue() == "mine\n(1 lines of library warnings hidden; --verbose shows them)\n"
