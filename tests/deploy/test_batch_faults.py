"""Faults in long batch jobs: a full disk, a read-only output, a data-parallel replica killed mid-run.

* Disk full: the results file sits on a 64 KiB tmpfs (``mount -t tmpfs -o size=64k``, when
  this process may mount; otherwise, or with ``VLLM_DSPARK_TEST_NO_MOUNT=1``, ``ENOSPC`` is
  injected into the writer's one ``write`` call after 64 KiB, short write first, as a disk
  would). The run stops with one message naming the file,
  the cause and the fix; the file holds only complete records (the part of the record that
  did not fit is cut off again); after the disk grows, the same command finishes the job
  with no duplicate and no gap, and the first run's lines are kept byte for byte.
* Read-only output (a read-only tmpfs when root, a mode-555 directory otherwise): refused
  before the engine starts, one message; an existing results file there with a torn last
  line is reported the same way and left untouched.
* A replica killed (SIGKILL, with its engine process) in the middle of a data-parallel run
  over Ray: the others finish, the script exits 1 saying to rerun, and the rerun completes
  the file: every id once, every result right.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.deploy.test_batch import FakeEngine, read_results
from vllm_dspark.tools.deploy import batch

ROOT = Path(__file__).resolve().parents[2]


def write_long_prompts(path: Path, n: int, chars: int = 1500) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "prompt": f"{i:04d} " + "x" * chars}) + "\n")
    return path


@pytest.fixture
def fake_llm(monkeypatch):
    vllm = pytest.importorskip("vllm")

    class FakeLLM:
        def __init__(self, **kw):
            self.llm_engine = FakeEngine()

    monkeypatch.setattr(vllm, "LLM", FakeLLM)


def _try(cmd: list[str]) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at ``path`` (yields True), or nothing when this process may not mount (False)."""
    path.mkdir(parents=True, exist_ok=True)
    if (os.geteuid() != 0 or os.environ.get("VLLM_DSPARK_TEST_NO_MOUNT")  # forces the fallbacks
            or not _try(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)])):
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """(directory, grow) of a results directory that holds 64 KiB; ``grow()`` frees the space."""
    d = tmp_path / "small"
    with tmpfs(d, "size=64k,mode=0755") as mounted:
        if mounted:
            yield d, lambda: subprocess.run(["mount", "-o", "remount,size=4m", str(d)], check=True), "tmpfs"
            return
        limit = {"bytes": 64 * 1024}
        real = batch._write

        def write(fd, data):
            used = os.fstat(fd).st_size
            if used + len(data) > limit["bytes"]:
                room = max(0, limit["bytes"] - used)
                if room:
                    return real(fd, bytes(data[:room]))  # a short write, as on a real disk
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, data)

        monkeypatch.setattr(batch, "_write", write)
        yield d, lambda: limit.update(bytes=1 << 30), "simulated"


def test_disk_full_stops_with_one_message_and_resumes(tmp_path, fake_llm, full_disk, capsys):
    out_dir, grow, how = full_disk
    inp = write_long_prompts(tmp_path / "in.jsonl", 80)
    out = out_dir / "results.jsonl"
    args = ["--model", "m", "--input", str(inp), "--output", str(out), "--max-tokens", "5"]
    assert batch.main(args) == 1, how
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "cannot write results" in x]
    assert len(lines) == 1, err
    msg = lines[0]
    assert str(out) in msg and "no space left on the device" in msg and "rerun the same command" in msg, msg
    assert "Traceback" not in err
    first = out.read_bytes()
    assert first.endswith(b"\n")
    kept = read_results(out)  # every line a whole record: the partial one was cut off again
    assert 10 < len(kept) < 80, (how, len(kept))
    assert f"({len(kept)} from this run)" in msg
    grow()
    assert batch.main(args) == 0, capsys.readouterr().err
    assert out.read_bytes().startswith(first)
    ids = [r["id"] for r in read_results(out)]
    assert len(ids) == len(set(ids)) == 80, how


@contextlib.contextmanager
def readonly_dir(path: Path, seed_files: dict[str, bytes] | None = None):
    """A directory this process cannot write (read-only tmpfs as root, mode 555 otherwise)."""
    seed_files = seed_files or {}
    if os.geteuid() == 0:
        with tmpfs(path, "size=1m") as mounted:
            if not mounted:
                pytest.skip("root without the right to mount: a read-only directory cannot be made")
            for name, data in seed_files.items():
                (path / name).write_bytes(data)
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
            yield path
        return
    path.mkdir(parents=True, exist_ok=True)
    for name, data in seed_files.items():
        (path / name).write_bytes(data)
        os.chmod(path / name, 0o444)
    os.chmod(path, 0o555)
    try:
        yield path
    finally:
        os.chmod(path, 0o755)


def test_read_only_output_is_refused_before_the_engine_starts(tmp_path, monkeypatch, capsys):
    vllm = pytest.importorskip("vllm")
    started = []
    monkeypatch.setattr(vllm, "LLM", lambda **kw: started.append(kw))
    inp = write_long_prompts(tmp_path / "in.jsonl", 3, chars=10)
    with readonly_dir(tmp_path / "ro") as d:
        out = d / "results.jsonl"
        assert batch.main(["--model", "m", "--input", str(inp), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert not started, "the engine must not start for an output that cannot be written"
    msg = [x for x in err.splitlines() if "cannot write results" in x]
    assert len(msg) == 1 and str(out) in msg[0], err
    assert ("read-only" in msg[0] or "permission denied" in msg[0]) and "writable" in msg[0], msg[0]
    assert "Traceback" not in err


def test_read_only_results_with_a_torn_line_are_reported_and_untouched(tmp_path, capsys):
    inp = write_long_prompts(tmp_path / "in.jsonl", 3, chars=10)
    body = b'{"id": "p0", "text": "a"}\n{"id": "p1", "te'
    with readonly_dir(tmp_path / "ro", {"results.jsonl": body}) as d:
        out = d / "results.jsonl"
        assert batch.main(["--model", "m", "--input", str(inp), "--output", str(out)]) == 2
        assert out.read_bytes() == body
    err = capsys.readouterr().err
    msg = [x for x in err.splitlines() if "cannot write results" in x]
    assert len(msg) == 1 and str(out) in msg[0] and "rerun the same command" in msg[0], err


# ------------------------------------------------------------------ a replica killed over Ray
def _replica_pids(session: int) -> list[int]:
    from tests.listeners import session_pids

    pids = []
    for pid in session_pids(session):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmd.startswith(b"ray::_Replica"):
            pids.append(pid)
    return pids


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


@pytest.mark.ray
@pytest.mark.engine
@pytest.mark.timeout(900)
def test_replica_killed_mid_run_loses_and_duplicates_nothing(tiny_models, engine_env, ray_cluster, tmp_path):
    from tests.deploy.ray_cpu import RAY_CPU_TEST_RESOURCE
    from tests.deploy.test_batch_engine import base_cmd, check_results, write_prompts

    n = 24
    inp = write_prompts(tmp_path / "prompts.jsonl", n)
    out = tmp_path / "results.jsonl"
    env = {**os.environ, **engine_env, "RAY_ADDRESS": ray_cluster["address"]}
    cmd = base_cmd(tiny_models, inp, out, "--data-parallel", "2", "--max-num-seqs", "1",
                   "--replica-resources", json.dumps({RAY_CPU_TEST_RESOURCE: 1}))
    log_path = tmp_path / "run1.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 400
            while not (out.exists() and out.read_bytes().count(b"\n") >= 3):
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.time() < deadline, "no results after 400 s:\n" + log_path.read_text()[-3000:]
                time.sleep(0.2)
            victims = _replica_pids(ray_cluster["proc"].pid)
            assert len(victims) == 2, victims
            victim = victims[0]
            for pid in [victim, *_descendants(victim)]:  # the replica and its vLLM engine process
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            rc = proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    log = log_path.read_text()
    assert rc == 1, log[-3000:]
    assert "1 replica(s) failed" in log and "Rerun the same command" in log, log[-3000:]
    first = out.read_bytes()
    assert first.endswith(b"\n")
    k = first.count(b"\n")
    assert 3 <= k < n, k
    ids = [r["id"] for r in read_results(out)]
    assert len(ids) == len(set(ids)), "a result was written twice"
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{k} already in" in r.stderr
    assert out.read_bytes().startswith(first)
    check_results(tiny_models, out, n)
