"""``scripts/deploy/serve_k3.sh``: an API key unless told to serve openly, and a speculative config built as JSON.

No GPU and no server: ``DRY_RUN=1`` runs the script's checks (node environment, draft fit,
memory plan) on a tiny pair and prints the ``vllm serve`` command instead of starting it.
The draft directory's name has quotes, a space and a backslash in it.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "deploy" / "serve_k3.sh"
BIN = str(Path(sys.executable).parent)


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and drafter whose heads split over TP 8, the drafter at a path no string-pasted
    JSON survives."""
    from tests.helpers import tiny_pair

    p = tiny_pair(tmp_path_factory.mktemp("k3_script"), vocab=320, bigram_target=False, mode="random",
                  target={"hidden_size": 512, "num_layers": 3, "num_heads": 8, "num_kv_heads": 8, "head_dim": 64,
                          "intermediate_size": 256},
                  drafter={"block_size": 5, "markov_rank": 8, "target_layer_ids": (0, 1), "num_heads": 8,
                           "num_kv_heads": 8, "intermediate_size": 256},
                  draft_name='my "best" drafter\\v2 \'k3\'')
    return p.target, p.draft


def _run(args, *, key=None, open_env=None, dry=True, num_spec="5"):
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "ALLOW_OPEN")}
    env.update(PATH=BIN + os.pathsep + env.get("PATH", ""), VLLM_HOST_IP="127.0.0.1", HOST="127.0.0.1",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64, NUM_SPEC=num_spec)
    if dry:
        env["DRY_RUN"] = "1"
    if key is not None:
        env["VLLM_API_KEY"] = key
    if open_env is not None:
        env["ALLOW_OPEN"] = open_env
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


def _command(res) -> list[str]:
    assert res.returncode == 0, res.stderr[-3000:]
    last = [line for line in res.stdout.splitlines() if line.startswith("vllm serve ")]
    assert len(last) == 1, res.stdout
    return shlex.split(last[0])


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_without_a_key_it_refuses_before_doing_anything(pair):
    res = _run(["tp8", *pair], dry=False)
    assert res.returncode == 2
    assert "refusing to start an OpenAI server without an API key" in res.stderr
    assert "VLLM_API_KEY" in res.stderr and "--open" in res.stderr
    assert "vllm serve" not in res.stdout


def test_with_a_key_the_command_carries_valid_json_and_no_key(pair):
    key = "s3cret-key-for-the-test"
    res = _run(["tp8", *pair], key=key)
    cmd = _command(res)
    assert cmd[:3] == ["vllm", "serve", pair[0]]
    assert json.loads(_flag(cmd, "--speculative-config")) == {
        "method": "dspark", "model": pair[1], "num_speculative_tokens": 5}
    assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--tensor-parallel-size") == "8"
    assert "API key required" in res.stderr
    assert key not in res.stdout + res.stderr  # vLLM reads VLLM_API_KEY; the key is on no command line


def test_api_key_flag_and_open_mode(pair):
    res = _run(["--api-key", "k", "tp8pp2", *pair])
    cmd = _command(res)
    assert _flag(cmd, "--pipeline-parallel-size") == "2" and "API key required" in res.stderr
    assert "--api-key" not in cmd
    for args, open_env in ((["--open", "tp8", *pair], None),
                           (["tp8", *pair], "1")):
        res = _run(args, open_env=open_env)
        _command(res)
        assert "WARNING: no API key" in res.stderr and "anyone who can reach" in res.stderr
    res = _run(["--open", "tp8", *pair], key="k")
    assert res.returncode == 2 and "choose one" in res.stderr


def test_a_num_spec_that_is_not_an_integer_is_refused(pair):
    res = _run(["tp8", *pair], key="k", num_spec='7, "x": 1')
    assert res.returncode != 0 and "vllm serve" not in res.stdout
