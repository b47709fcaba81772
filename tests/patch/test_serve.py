"""``vllm serve`` with the plugin on CPU: OpenAI completions (streaming too), /metrics, the API key,
one-line start-up errors, and the README's ``vllm serve`` line started as written on the default pair."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import default_pair_dirs, free_port, readme_command, serve_command, serving, tiny_pair
from vllm_dspark.serving import cpu_flags

pytestmark = pytest.mark.engine
VLLM = str(Path(sys.executable).with_name("vllm"))
API_KEY = "test-key-0123456789"  # the shared server requires it on every /v1 request


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    p = tiny_pair(tmp_path_factory.mktemp("serve_pair"), seed=21, target={"num_layers": 3},
                  drafter={"block_size": 6, "markov_rank": 64, "target_layer_ids": (0, 1)}, backbone_scale=0.05)
    return p.target, p.draft, p.root


def _serve_cmd(target, draft, port, extra=()):
    return serve_command(target, draft, port, extra=("--gpu-memory-utilization", "0.15", *extra))


@pytest.fixture(scope="module")
def server(pair):
    """The module's one tiny-pair server, with an API key."""
    target, draft, root = pair
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_API_KEY", None)
    cmd = _serve_cmd(target, draft, free_port(), extra=("--api-key", API_KEY))
    with serving(cmd, root / "serve.log", env) as srv:
        yield srv.base, str(target)


def _post(url: str, body: dict, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_completions_and_streaming(server):
    from openai import OpenAI

    base, model = server
    client = OpenAI(base_url=base + "/v1", api_key=API_KEY)
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


def test_the_api_key_is_required(server):
    base, model = server
    body = {"model": model, "prompt": "def main(", "max_tokens": 4, "temperature": 0}
    for key in (None, "wrong-key"):
        status, reply = _post(base + "/v1/completions", body, key)
        assert status == 401, (key, status, reply)
        req = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 401
    status, reply = _post(base + "/v1/completions", body, API_KEY)
    assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply


def test_bad_draft_fails_with_one_message(pair, tmp_path):
    target, draft, root = pair
    bad = tmp_path / "bad"
    shutil.copytree(draft, bad)
    (bad / "model.safetensors").unlink()
    res = subprocess.run(_serve_cmd(target, bad, free_port()), capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))
    assert res.returncode != 0
    assert "vllm_dspark: DSpark draft" in res.stderr and "model.safetensors: missing" in res.stderr
    assert "Traceback" not in res.stderr, res.stderr[-3000:]


def test_memory_that_cannot_be_had_fails_with_one_line_naming_the_setting(pair):
    """vLLM's CPU worker would refuse --gpu-memory-utilization 1.0 with a traceback per process; the
    plugin refuses it while the config is built, in one line, before any engine process starts."""
    target, draft, _ = pair
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    res = subprocess.run(_serve_cmd(target, draft, free_port(), extra=("--gpu-memory-utilization", "1.0")),
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode != 0
    lines = [line for line in res.stderr.splitlines() if line.startswith("vllm_dspark: ")]
    assert len(lines) == 1 and "--gpu-memory-utilization 1.0 reserves" in lines[0], res.stderr[-3000:]
    assert "VLLM_CPU_KVCACHE_SPACE" in lines[0]
    out = res.stdout + res.stderr
    assert "Traceback" not in out and "EngineCore" not in out, out[-3000:]


# ---------------------------------------------------------------- the README's line, as written
@pytest.fixture(scope="module")
def default_pair():
    return default_pair_dirs()


def test_the_readme_serve_line_starts_as_written(default_pair, tmp_path):
    """README.md's ``vllm serve TARGET --api-key API_KEY --speculative-config '...'`` on the default
    pair, with nothing added but a loopback address (the tests bind nothing else) and no
    VLLM_CPU_KVCACHE_SPACE: the plugin's KV-cache default must make it start on a machine like this
    one. The key it names is the one a client must send."""
    key = "readme-key"
    cmd = readme_command("vllm", "serve", placeholders={"TARGET": default_pair["target"],
                                                         "DRAFT_DIR": default_pair["draft"], "API_KEY": key})
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "dspark" and spec["model"] == default_pair["draft"]
    cmd = [VLLM, *cmd[1:], "--host", "127.0.0.1", "--port", str(free_port())]
    user_set = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_API_KEY", "VLLM_ENABLE_V1_MULTIPROCESSING")  # none of them a user's
    env = {k: v for k, v in os.environ.items() if k not in user_set}
    log_path = tmp_path / "readme_serve.log"
    with serving(cmd, log_path, env, timeout=900) as srv:
        body = {"model": default_pair["target"], "prompt": "The capital of France is", "max_tokens": 8,
                "temperature": 0}
        status, reply = _post(srv.base + "/v1/completions", body, key)
        assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply
        assert _post(srv.base + "/v1/completions", body, None)[0] == 401
    log = log_path.read_text()
    assert "vllm_dspark: CPU KV cache:" in log and "VLLM_CPU_KVCACHE_SPACE is unset" in log
    # The README line leaves the dtype to vLLM (bf16 for this target): where bf16 is emulated, the user is told.
    assert ("no native bf16" in log) == (not cpu_flags.has_native_bf16()), log[-3000:]
