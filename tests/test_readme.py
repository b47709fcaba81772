"""The README a user reads first: short, the two commands first, and every command it cites real.

The paths it cites are checked by ``test_docs_paths.py``; its ``vllm serve`` and batch lines are run
as written by ``tests/patch/test_serve.py`` and ``tests/deploy/test_batch_readme.py``; its settings
table by ``tests/serving/test_settings.py``. Here: its length, its first lines, the flags of every
script and ``vllm-dspark`` command it names, and the demo's result block.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers import REPO, readme_commands

README = (REPO / "README.md").read_text()


def test_it_is_short_and_starts_with_the_two_commands():
    lines = README.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200: the rest belongs in docs/)"
    first = re.search(r"```bash\n(.*?)```", README, flags=re.S)
    assert first is not None and README.index(first.group(0)) < 40, "the two commands must come first"
    commands = [ln for ln in first.group(1).splitlines() if ln.strip()]
    assert len(commands) == 2, commands
    assert "scripts/setup_env.sh" in commands[0] and "scripts/demo.py" in commands[0]
    assert "scripts/setup_env.sh" in commands[1] and "pytest" in commands[1] and "tests" in commands[1]


def _inline_commands(prog: str) -> list[list[str]]:
    """``prog ...`` commands quoted inline or in bash blocks, placeholders and all."""
    found = [shlex.split(m) for m in re.findall(rf"`({re.escape(prog)} [^`]+)`", README)]
    found += [c for c in readme_commands() if c[:1] == [prog]]
    return found


def _flags(argv: list[str]) -> list[str]:
    return [a.split("=")[0] for a in argv if a.startswith("--") and a != "--"]


def test_every_vllm_dspark_command_it_names_exists_with_its_flags():
    from vllm_dspark.tools.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    cmds = _inline_commands("vllm-dspark")
    assert {c[1] for c in cmds} >= {"inspect", "plan", "default"}, cmds
    for cmd in cmds:
        assert cmd[1] in sub.choices, f"README.md: `{' '.join(cmd)}`: no such vllm-dspark command"
        known = {s for a in sub.choices[cmd[1]]._actions for s in a.option_strings}
        unknown = set(_flags(cmd[2:])) - known
        assert not unknown, f"README.md: `{' '.join(cmd)}`: vllm-dspark {cmd[1]} takes no {sorted(unknown)}"


def _script_flags(script: str) -> set[str]:
    out = subprocess.run([sys.executable, str(REPO / script), "--help"], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(re.findall(r"--[\w-]+", out.stdout))


@pytest.mark.parametrize("script", sorted({a for c in readme_commands() for a in c if a.startswith("scripts/")
                                           and a.endswith(".py")}))
def test_every_script_it_runs_takes_the_flags_it_gives(script):
    given = {f for c in readme_commands() if script in c for f in _flags(c[c.index(script) + 1:])}
    missing = given - _script_flags(script)
    assert not missing, f"README.md gives {script} flags it does not take: {sorted(missing)}"


def test_the_demo_block_is_what_the_demo_prints():
    """The result block is pasted from a run: the demo's own header (with its date and CPU line) and
    result table, not a table written by hand."""
    block = README[README.index("<!-- demo-result -->"):README.index("<!-- /demo-result -->")]
    demo = (REPO / "scripts" / "demo.py").read_text()
    for marker in ("== DSpark on SmolLM2-135M-Instruct:", " UTC, ", " cores, ", "-- results (measured in this run",
                   "| workload", "n-gram |", "| copy-heavy", "DSpark on ", "acceptance length",
                   "greedy outputs identical to no speculation (float32):"):
        assert marker in block, f"README.md's demo block lacks {marker!r}: paste the demo's output"
        assert marker.strip(" ,|") in demo, f"scripts/demo.py no longer prints {marker!r}: update this test"
    assert re.search(r"\b20\d\d-\d\d-\d\d \d\d:\d\d UTC\b", block), "the run's date"


def test_the_check_sees_an_unknown_flag():
    parser = argparse.ArgumentParser()
    parser.add_argument("--known")
    assert _flags(["x", "--known=1", "--other", "--"]) == ["--known", "--other"]


def test_vllm_run_batch_takes_the_speculative_config():
    """The README sends one-engine OpenAI batch files to ``vllm run-batch`` with the same
    ``--speculative-config``: this vLLM's run-batch must take it."""
    assert "`vllm run-batch`" in README
    vllm = REPO / ".venv" / "bin" / "vllm"
    if not vllm.exists():
        pytest.skip("no .venv/ (README command 1 makes it)")
    out = subprocess.run([str(vllm), "run-batch", "--help=all"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in ("--speculative-config", "--input-file", "--output-file"):
        assert flag in out.stdout, flag
