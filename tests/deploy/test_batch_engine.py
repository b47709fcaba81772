"""The batch script with real engines: SIGKILL mid-run + a torn line, then resume; data parallel on Ray.

Every result is also checked for content: the tiny target is a near-bigram
model, so its greedy continuation of ``[..., t]`` is the bigram chain from t.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny_pair import bigram_chain

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "batch_generate.py"
MAX_TOKENS = 40
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def write_prompts(path: Path, n: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"q{i}", "prompt_token_ids": [7 + i, 30 + 2 * i, 60 + i]}) + "\n")
    return path


def base_cmd(models, inp, out, *extra):
    return [sys.executable, str(SCRIPT), "--model", models["target"], "--draft", models["draft"],
            "--input", str(inp), "--output", str(out), "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
            "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", *extra]


def check_results(models, out: Path, n: int) -> list[dict]:
    res = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [r["id"] for r in res]
    assert len(ids) == len(set(ids)), "duplicate results"
    assert set(ids) == {f"q{i}" for i in range(n)}, "missing results"
    for r in res:
        i = int(r["id"][1:])
        assert r["token_ids"] == bigram_chain(models["bigram"], 60 + i, MAX_TOKENS), r["id"]
        assert r["completion_tokens"] == MAX_TOKENS and r["prompt_tokens"] == 3
    return res


def test_killed_run_resumes_without_duplicates_or_gaps(tiny_models, engine_env, tmp_path):
    n = 24
    inp = write_prompts(tmp_path / "prompts.jsonl", n)
    out = tmp_path / "results.jsonl"
    env = {**os.environ, **engine_env}
    # One sequence at a time, so results trickle in and the kill lands mid-run.
    cmd = base_cmd(tiny_models, inp, out, "--max-num-seqs", "1")
    log = open(tmp_path / "run1.log", "w")  # noqa: SIM115 (closed after the killed process)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (out.exists() and len(out.read_bytes().splitlines()) >= 3):
            assert proc.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
            assert time.time() < deadline, "no results after 300 s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the script, its engine core and workers
        proc.wait()
        log.close()
    first = out.read_bytes()
    first = first[:first.rfind(b"\n") + 1]  # the complete lines
    k = first.count(b"\n")
    assert 3 <= k < n, f"the kill should land mid-run, got {k} of {n}"
    with out.open("ab") as f:  # what a crash in the middle of a write leaves behind
        f.write(b'{"id": "q23", "text": "\\u00')
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torn last line" in r.stderr and f"{k} already in" in r.stderr
    assert out.read_bytes().startswith(first)  # finished lines kept byte for byte
    check_results(tiny_models, out, n)


@pytest.mark.ray
def test_data_parallel_over_ray_replicas(tiny_models, engine_env, ray_head, tmp_path):
    from tests.deploy.ray_cpu import RAY_CPU_TEST_RESOURCE

    n = 12
    inp = write_prompts(tmp_path / "prompts.jsonl", n)
    out = tmp_path / "results.jsonl"
    env = {**os.environ, **engine_env, "RAY_ADDRESS": ray_head}
    cmd = base_cmd(tiny_models, inp, out, "--data-parallel", "2",
                   "--replica-resources", json.dumps({RAY_CPU_TEST_RESOURCE: 1}))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = check_results(tiny_models, out, n)
    assert {x["replica"] for x in res} == {0, 1}
