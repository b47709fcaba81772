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
    for gone in ("Triton", "FutureWarning", "warnings.warn(", "[W1203", "chunked prefill", "Enforce eager",
                 "oneDNN", "Loading safetensors"):
        assert gone not in kept, gone
    assert "\n\n" not in kept  # the loader bar's blank line went with it
    assert "vllm_dspark: the budget's cost profile" in kept
    # 7 log warnings (the oneDNN fallback twice: its message quotes an exception, it is still a warning),
    # a Python warning and its echo, torch's C++ line, Triton, the loader's bar (two updates: text mode
    # reads a carriage return as a line end, in the file as in the demo's pipe)
    assert flt.hidden == 13
    # The fallback bears on the bf16 timings: said once, in the closing line.
    assert flt.closing_line() == ("(13 lines of library warnings hidden; bf16 matmuls ran on torch's fallback, "
                                  "not oneDNN (no native bf16 on this CPU); --verbose shows them)\n")


def test_intel_openmps_notes_are_hidden_and_counted():
    flt = OutputFilter()
    assert not flt.keep("OMP: Info #277: omp_set_nested routine deprecated, please use omp_set_max_active_levels "
                        "instead.\n")
    assert flt.hidden == 1 and flt.keep("-- results (measured in this run: float32, batch 1) --\n")


def test_an_error_record_or_a_traceback_is_never_hidden():
    flt = OutputFilter()
    for line in ("(EngineCore pid=1) ERROR 12-03 09:00:00 [core.py:1] EngineCore failed to start.\n",
                 "Traceback (most recent call last):\n", "RuntimeError: out of memory\n",
                 "(Worker pid=2) WARNING 12-03 09:00:00 [x.py:1] Traceback follows\n"):
        assert flt.keep(line), line
    assert flt.hidden == 0


def test_run_filtered_streams_a_child_and_returns_its_code():
    out = io.StringIO()
    code = run_filtered([sys.executable, "-c", "import sys; print('mine'); "
                         "print('(EngineCore pid=1) WARNING 12-03 x', file=sys.stderr); sys.exit(3)"], out=out)
    assert code == 3
    assert out.getvalue() == "mine\n(1 lines of library warnings hidden; --verbose shows them)\n"
