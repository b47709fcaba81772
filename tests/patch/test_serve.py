"""``vllm serve`` with the plugin on CPU: OpenAI completions (streaming too) and /metrics."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_dspark.testing.tiny import drafter_config_for, make_drafter, make_target, random_bigram

pytestmark = pytest.mark.engine
VLLM = str(Path(sys.executable).with_name("vllm"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_pair")
    bigram = random_bigram(384, seed=21)
    target = make_target(root / "target", vocab_size=384, bigram=bigram, num_layers=3)
    cfg = drafter_config_for(target, block_size=6, markov_rank=64, target_layer_ids=(0, 1))
    draft = make_drafter(root / "draft", cfg, mode="oracle", bigram=bigram, backbone_scale=0.05)
    return target, draft, root


def _serve_cmd(target, draft, port, extra=()):
    spec = json.dumps({"method": "dspark", "model": str(draft), "num_speculative_tokens": 6})
    return [VLLM, "serve", str(target), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "512", "--enforce-eager", "--gpu-memory-utilization", "0.15",
            "--speculative-config", spec, *extra]


@pytest.fixture(scope="module")
def server(pair):
    target, draft, root = pair
    port = _free_port()
    log = open(root / "serve.log", "w")  # noqa: SIM115 (the server outlives this function)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.Popen(_serve_cmd(target, draft, port), stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {proc.returncode}:\n"
                                     + (root / "serve.log").read_text()[-4000:])
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("vllm serve did not become healthy in 300 s:\n"
                                     + (root / "serve.log").read_text()[-4000:])
            time.sleep(2)
        yield base, str(target)
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        log.close()


def test_completions_and_streaming(server):
    from openai import OpenAI

    base, model = server
    client = OpenAI(base_url=base + "/v1", api_key="none")
    full = client.completions.create(model=model, prompt="def main(", max_tokens=24, temperature=0)
    text = full.choices[0].text
    assert full.usage.completion_tokens == 24
    chunks = client.completions.create(model=model, prompt="def main(", max_tokens=24, temperature=0, stream=True)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text


def test_metrics_show_spec_decode_counters(server):
    base, _ = server
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        body = r.read().decode()
    values = {}
    for line in body.splitlines():
        if line.startswith("vllm:spec_decode_num_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
    assert values.get("vllm:spec_decode_num_drafts_total", 0) > 0, values
    assert values.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0, values


def test_bad_draft_fails_with_one_message(pair, tmp_path):
    target, draft, root = pair
    bad = tmp_path / "bad"
    shutil.copytree(draft, bad)
    (bad / "model.safetensors").unlink()
    res = subprocess.run(_serve_cmd(target, bad, _free_port()), capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))
    assert res.returncode != 0
    assert "vllm_dspark: DSpark draft" in res.stderr and "model.safetensors: missing" in res.stderr
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
