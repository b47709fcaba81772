"""The one-command GPU check (``scripts/gpu_check.py``), on a CPU machine.

* Its dry run runs in a subprocess that refuses any import of vLLM or pytest
  (a ``sys.meta_path`` blocker), both with ``--dry-run`` and with no CUDA device.
  It writes the report's schema to a temporary directory, with the build, every
  CUDA check and every timing row marked "not run".
* What it needs fits in the 64 MiB that travel to a GPU machine. The whole
  travelling tree (tracked plus untracked-not-ignored files, what the device
  tool sends) is counted the same way. It is ~88 MiB with four tracked weight
  files; ``scripts/device_tree.py slim`` takes them off it for the device run
  and ``restore`` puts them back. Both run here on a throwaway clone: slim, the
  tree fits and the check's files are all in it; restore, git sees exactly what
  it saw before. The files that travel once slim run the dry run on their own.
* The CUDA checks it runs (``tests/ops/markov_cases.py``, ``CUDA_CHECKS``) are
  shared with ``test_markov_cuda.py``. Their device-agnostic, small ones run here
  on the CPU twin, so their logic is exercised without a GPU; so do the script's
  check runner (pass / fail / error / out of time) and one timing row at a small
  vocabulary.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .markov_cases import CUDA_CHECKS, Check

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
LIMIT = 64 * 2**20

# Runs the script as __main__ after installing an import blocker for vLLM and pytest.
_BOOT = """
import runpy, sys
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "pytest"):
            raise ImportError("gpu_check must not import " + name)
        return None
sys.meta_path.insert(0, _Refuse())
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def _dry_run(out: Path, *args: str) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a GPU runner still takes the dry path
    env.pop("OUT", None)  # (the device tool's output folder: the report would be copied there)
    proc = subprocess.run([sys.executable, "-c", _BOOT, str(SCRIPT), "--out", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return _dry_run(tmp_path_factory.mktemp("gpu-check"), "--dry-run")


def _load_script(name: str, path: Path):
    """A script of scripts/ imported as a module."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gpu_check():
    """The script as a module (its CUDA parts take ``device``, so they run on the CPU too)."""
    return _load_script("gpu_check", SCRIPT)


def test_dry_run_writes_the_schema_with_cuda_parts_not_run(report):
    assert report["schema"] == "gpu-check/1" and report["mode"] == "dry-run"
    assert report["imports"] == {"vllm": False, "pytest": False}
    for key in ("command", "started", "wall_s", "environment", "carry", "build", "tests", "bench", "status"):
        assert key in report, key
    assert report["build"]["status"] == "not run"
    tests = report["tests"]
    assert tests["status"] == "not run"
    assert [c["name"] for c in tests["cases"]] == [c.name for c in CUDA_CHECKS]
    assert {c["status"] for c in tests["cases"]} == {"not run"}
    assert tests["counts"]["not run"] == len(CUDA_CHECKS) > 100
    bench = report["bench"]
    assert bench["status"] == "not run"
    cfg = bench["config"]
    assert (cfg["vocab"], cfg["rank"], cfg["block"], cfg["batches"]) == (163840, 256, 7, [1, 8, 64])
    assert sorted((r["batch"], r["regime"]) for r in bench["rows"]) == sorted(
        (b, g) for b in (1, 8, 64) for g in ("peaky", "flat"))
    assert {r["status"] for r in bench["rows"]} == {"not run"}
    names = [c["name"] for c in tests["cases"]]
    for must in ("R1-B7-V111", "V111-", "V163840", "greedy", "sampled", "graph_capture"):
        assert any(must in n for n in names), must


def test_no_cuda_device_means_a_dry_run(tmp_path):
    rep = _dry_run(tmp_path)  # no --dry-run: CUDA_VISIBLE_DEVICES="" hides any device
    assert rep["mode"] == "dry-run" and rep["mode_reason"] == "no CUDA device"
    assert (tmp_path / "report.md").read_text().count("not run") >= 3


def _git_tree_bytes(root: Path = ROOT) -> int | None:
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                             capture_output=True, check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum((root / f).lstat().st_size for f in out.split("\0") if f and os.path.lexists(root / f))


def test_what_the_check_needs_fits_the_carry_limit(report, gpu_check):
    assert report["carry"]["limit_bytes"] == LIMIT
    if report["carry"]["status"] == "not run":
        pytest.skip(report["carry"]["reason"])
    carry = gpu_check.carry()
    assert carry["tree_bytes"] == _git_tree_bytes()  # what the device tool sends, counted alike
    assert carry["needed_ok"] and 0 < carry["needed_bytes"] < 2 * 2**20
    assert carry["tree_ok"] == (carry["tree_bytes"] <= LIMIT)
    assert set(carry) == set(report["carry"])


# --- scripts/device_tree.py: slim the travelling tree for the device run, then restore it ----------
# The real checkout's tree is ~88 MiB (four tracked weight files). These tests slim and restore a
# throwaway clone of it (git clone --shared: the real index and .git/info/exclude are never touched).
TREE_SCRIPT = ROOT / "scripts" / "device_tree.py"
WEIGHTS = ["tests/fixtures/toy_pair/drafter/model.safetensors", "tests/fixtures/toy_pair/target/model.safetensors",
           "training/assets/smollm2/dflash/model.safetensors", "vllm_dspark/assets/smollm2/dspark/model.safetensors"]


@pytest.fixture(scope="module")
def device_tree():
    return _load_script("device_tree", TREE_SCRIPT)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def _tree(repo: Path, cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TREE_SCRIPT), "--repo", str(repo), cmd],
                          capture_output=True, text=True, timeout=120)


def _state(repo: Path) -> dict:
    """Everything slim and restore may touch: status, the index (with stage), the exclude file, the marker."""
    exclude = repo / ".git" / "info" / "exclude"
    return {"status": _git(repo, "status", "--porcelain", "--untracked-files=all"),
            "index": _git(repo, "ls-files", "--stage"),
            "exclude": exclude.read_bytes() if exclude.exists() else None,
            "marker": (repo / ".git" / "device-tree-slim.json").exists()}


@pytest.fixture
def clone(tmp_path) -> Path:
    if _git_tree_bytes() is None:
        pytest.skip("not a git checkout (or no git)")
    repo = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--shared", str(ROOT), str(repo)], check=True, timeout=120)
    if not all((repo / w).exists() for w in WEIGHTS):
        pytest.skip("the weight files are not committed here")
    return repo


def test_slim_takes_the_weights_off_the_travelling_tree_and_restore_puts_them_back(clone, device_tree):
    before = _state(clone)
    sizes = {w: (clone / w).stat().st_size for w in WEIGHTS}
    tree_before = _git_tree_bytes(clone)
    listed_before = set(_git(clone, "ls-files", "-co", "--exclude-standard").splitlines())
    assert tree_before > LIMIT  # (why slim exists)
    assert device_tree.candidates(clone, device_tree.needed(clone)) == WEIGHTS  # the rule picks these, only

    slim = _tree(clone, "slim")
    assert slim.returncode == 0, slim.stdout + slim.stderr
    tree = _git_tree_bytes(clone)
    assert tree <= LIMIT and tree == tree_before - sum(sizes.values())
    listed = set(_git(clone, "ls-files", "-co", "--exclude-standard").splitlines())
    assert listed == listed_before - set(WEIGHTS)  # nothing else left, nothing new travels
    assert {w: (clone / w).stat().st_size for w in WEIGHTS} == sizes  # still on disk, as they were
    status = _git(clone, "status", "--porcelain", "--untracked-files=all").splitlines()
    assert sorted(status) == sorted(f"D  {w}" for w in WEIGHTS)  # staged deletions, never untracked (??)
    need = device_tree.needed(clone)
    needed = {f for f in listed_before if device_tree.is_needed(f, need)}
    assert needed and needed <= listed  # every file the GPU check reads still travels
    assert "SLIM" in _tree(clone, "size").stdout

    slimmer = _state(clone)
    again = _tree(clone, "slim")
    assert again.returncode == 1 and "already slim" in again.stderr and "restore" in again.stderr
    assert _state(clone) == slimmer

    back = _tree(clone, "restore")
    assert back.returncode == 0, back.stdout + back.stderr
    assert _state(clone) == before and _git_tree_bytes(clone) == tree_before
    twice = _tree(clone, "restore")
    assert twice.returncode == 0 and "nothing to restore" in twice.stdout
    assert _state(clone) == before


def test_slim_refuses_a_weight_file_with_changes(clone):
    weight = clone / WEIGHTS[1]
    weight.write_bytes(weight.read_bytes() + b"\0")  # unstaged
    before = _state(clone)
    res = _tree(clone, "slim")
    assert res.returncode == 1 and WEIGHTS[1] in res.stderr and "git restore" in res.stderr
    assert _state(clone) == before  # refused before it changed anything
    _git(clone, "add", WEIGHTS[1])  # staged
    before = _state(clone)
    res = _tree(clone, "slim")
    assert res.returncode == 1 and WEIGHTS[1] in res.stderr
    assert _state(clone) == before


def test_restore_recovers_from_an_interrupted_slim_or_restore(clone):
    before = _state(clone)
    marker = clone / ".git" / "device-tree-slim.json"
    exclude = clone / ".git" / "info" / "exclude"
    assert _tree(clone, "slim").returncode == 0
    record = marker.read_text()
    # restore stopped after putting the index back: the exclude block and the marker are left
    _git(clone, "reset", "-q", "--", *WEIGHTS)
    assert _tree(clone, "restore").returncode == 0 and _state(clone) == before
    # slim stopped right after writing its marker: nothing else changed yet
    marker.write_text(record)
    assert _tree(clone, "restore").returncode == 0 and _state(clone) == before
    # the marker lost: the exclude block still names the paths (back to HEAD's entries)
    assert _tree(clone, "slim").returncode == 0
    marker.unlink()
    assert "SLIM" in _tree(clone, "size").stdout
    assert _tree(clone, "restore").returncode == 0 and _state(clone) == before
    assert exclude.read_bytes() == before["exclude"]


def test_the_slim_tree_is_enough_for_the_check(tmp_path, device_tree):
    """The files that travel once slim (from this working tree), alone in a folder: the dry run runs there."""
    if _git_tree_bytes() is None:
        pytest.skip("not a git checkout (or no git)")
    out = _git(ROOT, "ls-files", "-z", "-co", "--exclude-standard")
    off = set(device_tree.candidates(ROOT, device_tree.needed(ROOT)))
    dest = tmp_path / "tree"
    for f in out.split("\0"):
        if f and f not in off and os.path.lexists(ROOT / f) and not (ROOT / f).is_symlink():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / f, dest / f)
    assert not any((dest / w).exists() for w in WEIGHTS)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-c", _BOOT, str(dest / "scripts" / "gpu_check.py"), "--dry-run",
                           "--out", str(tmp_path / "out")], cwd=dest, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["mode"] == "dry-run"


CPU_CHECKS = [c for c in CUDA_CHECKS if c.device_agnostic and not c.big]


def _fake_report(row: dict) -> dict:
    """A CUDA-mode report around one timing row (for the markdown writer)."""
    return {
        "command": "python3 scripts/gpu_check.py", "mode": "cuda", "mode_reason": None, "started": "now",
        "wall_s": 1.0, "status": "passed", "imports": {"vllm": False, "pytest": False},
        "environment": {"torch": "x", "torch_cuda": "13.0", "nvcc": "13.0", "python": "3.12", "cpus": 16,
                        "git_commit": None, "git_dirty": None, "device": {"name": "H200"}},
        "carry": {"status": "not run", "limit_bytes": LIMIT},
        "build": {"status": "passed", "seconds": 60.0, "command": "setup.py build_ext --inplace"},
        "tests": {"status": "passed", "counts": {"passed": 1}, "cases": [{"name": "x", "status": "passed"}]},
        "bench": {"status": "passed", "rows": [row],
                  "config": {"vocab": 163840, "rank": 256, "block": 7, "dtype": "bf16", "mode": "greedy",
                             "iters": 2}},
    }


def test_every_cuda_check_is_listed_once():
    names = [c.name for c in CUDA_CHECKS]
    assert len(names) == len(set(names))
    assert len(CPU_CHECKS) > 50


@pytest.mark.parametrize("check", CPU_CHECKS, ids=lambda c: c.name)
def test_cuda_check_logic_on_the_cpu_twin(check: Check):
    from vllm_dspark.ops import markov as M

    assert M.is_compiled_available("cpu")
    check.run("cpu")


# --- the script's CUDA parts, on the CPU ------------------------------------------------

def test_run_checks_reports_pass_fail_and_budget(gpu_check):
    def fails(device):
        raise AssertionError("tokens differ")

    def errors(device):
        raise RuntimeError("illegal memory access")

    checks = [CPU_CHECKS[0], Check("fails", fails, {}), Check("errors", errors, {})]
    res = gpu_check.run_checks(float("inf"), device="cpu", checks=checks)
    assert [c["status"] for c in res["cases"]] == ["passed", "failed", "error"]
    assert res["status"] == "failed" and "tokens differ" in res["cases"][1]["error"]
    assert "illegal memory access" in res["cases"][2]["error"]
    late = gpu_check.run_checks(0.0, device="cpu", checks=checks[:1])
    assert late["cases"][0] == {"name": checks[0].name, "status": "not run", "reason": "time budget"}
    assert late["status"] == "failed"  # a check left out is not a pass
    assert gpu_check.run_checks(float("inf"), device="cpu", checks=checks[:1])["status"] == "passed"


@pytest.mark.parametrize("regime", ["peaky", "flat"])
def test_bench_row_on_the_cpu_twin(gpu_check, regime):
    row = gpu_check.bench_row(2, regime, gpu_check._bench_inputs(), 2, device="cpu", vocab=4096)
    assert row["status"] == "passed" and row["matches_reference"] and row["matches_reference_after_timing"]
    assert row["op_warm_ms"] > 0 and row["loop_warm_ms"] > 0 and row["speedup_warm"] > 0
    assert row["op_graph_ms"] is None and row["rows"] == 14 and row["vocab"] == 4096
    assert 1 <= row["exact_scores_per_row"] <= 4096
    json.dumps(row)  # goes into report.json as it is
    md = gpu_check.markdown(_fake_report(row))
    assert "| 2 | " + regime in md
