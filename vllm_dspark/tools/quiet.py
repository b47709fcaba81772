"""A quiet run: a command's output with the library warnings a user cannot act on taken out.

The demo's engines print vLLM's start-up warnings (Triton missing, eager mode, the V1 runner
fallback, reserved CPUs, ...) and Python warnings from torch and vLLM, once per engine and
process. :func:`run_filtered` runs a command with its stdout and stderr merged into one
pipe (engine processes inherit it) and prints every line :class:`OutputFilter` keeps.
Nothing of the libraries is edited; ``--verbose`` in the demo bypasses all of it.

Kept always: the command's own lines, the plugin's own log lines (``vllm_dspark: ...``), and
anything that looks like a failure (a traceback, an exception, ``ERROR``), so that a run that
goes wrong still says why. A log record is judged by its level: a ``WARNING`` record whose
message quotes an exception (vLLM's oneDNN fallback does) is still a warning. A hidden warning
that bears on the result is summarised once, in the closing line (:data:`_SUMMARIES`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence

# A line that reports a failure is never hidden.
_FAILURE = re.compile(r"Traceback|Error\b|Exception\b|\bERROR\b|FAILED")
# Log records at WARNING from vLLM, Ray and the plugin's shared handler: "(EngineCore pid=1) WARNING 12-03 ...".
_LOG_WARNING = re.compile(r"\bWARNING\b( \d\d-\d\d)?")
_LOG_RECORD_WARNING = re.compile(r"^(\(\w+ pid=\d+\) )?WARNING \d\d-\d\d ")
# Python's warnings module: "path.py:12: FutureWarning: ..." (its next line echoes the source).
_PY_WARNING = re.compile(r"^\s*\S+:\d+: \w*Warning: ")
_NOISE = (re.compile(r"^Triton is installed, but doesn't include CPU backend"),  # vLLM's import-time print
          re.compile(r"^\[W\d{4} "),  # torch's C++ warnings ("[W1203 09:12:00.000 ...]")
          re.compile(r"^(\(\w+ pid=\d+\) )?Loading safetensors checkpoint shards:"),  # vLLM's loader bar
          re.compile(r"^OMP: Info #\d+: "))  # Intel OpenMP's notes (preloaded by the CPU set-up)
# Hidden warnings that bear on the result: one line each in the closing summary, however often seen.
_SUMMARIES = ((re.compile(r"Failed to create oneDNN linear, fallback to torch linear"),
               "bf16 matmuls ran on torch's fallback, not oneDNN (no native bf16 on this CPU)"),)


class OutputFilter:
    """Decides line by line what a quiet run shows; counts what it hid."""

    def __init__(self) -> None:
        self.hidden = 0
        self.notes: list[str] = []  # summaries of hidden warnings that bear on the result, in order seen
        self._echo = False  # the line after a Python warning echoes its source: hide it too
        self._after_hidden = False  # a blank line right after a hidden one is the library's, too

    def keep(self, line: str) -> bool:
        hidden_before, self._after_hidden = self._after_hidden, False
        keep = self._keep(line, hidden_before)
        self._after_hidden = not keep
        return keep

    def _keep(self, line: str, hidden_before: bool) -> bool:
        echo, self._echo = self._echo, False
        if "vllm_dspark:" in line:  # the plugin's own warnings are for the user
            return True
        if _LOG_RECORD_WARNING.search(line) and "Traceback" not in line:
            self._note(line)
            self.hidden += 1
            return False
        if _FAILURE.search(line):
            return True
        if hidden_before and not line.strip():
            return False
        if echo and line[:1].isspace():
            self.hidden += 1
            return False
        if _PY_WARNING.search(line):
            self._echo = True
            self.hidden += 1
            return False
        if _LOG_WARNING.search(line) or any(p.search(line) for p in _NOISE):
            self.hidden += 1
            return False
        return True

    def _note(self, line: str) -> None:
        for pattern, note in _SUMMARIES:
            if pattern.search(line) and note not in self.notes:
                self.notes.append(note)

    def lines(self, source: Iterable[str]) -> Iterable[str]:
        return (line for line in source if self.keep(line))

    def closing_line(self) -> str | None:
        if not self.hidden:
            return None
        notes = "".join(f"; {n}" for n in self.notes)
        return f"({self.hidden} lines of library warnings hidden{notes}; --verbose shows them)\n"


def run_filtered(cmd: Sequence[str], env: dict | None = None, out=None) -> int:
    """Run ``cmd`` (stdout and stderr merged) and print the lines :class:`OutputFilter` keeps;
    returns its exit code. The last line says how many lines were hidden, when any were."""
    out = out or sys.stdout
    flt = OutputFilter()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, **(env or {})}, errors="replace")
    assert proc.stdout is not None
    try:
        for line in flt.lines(proc.stdout):
            out.write(line)
            out.flush()
    except KeyboardInterrupt:
        proc.terminate()
        raise
    code = proc.wait()
    closing = flt.closing_line()
    if closing:
        out.write(closing)
    return code
