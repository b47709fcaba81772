"""``scripts/batch_generate.py`` exactly as README.md gives it, on the default pair, out of the box.

The command is read from the README (the test breaks when the README changes) and run with
its placeholders filled in and nothing added, without ``VLLM_CPU_KVCACHE_SPACE``: the plugin's
KV-cache default must make it start on a machine like this one, and the script's ``--dtype native``
must run the CPU's fast dtype. One engine for the module; its prompts file also holds a chat
(``messages``), answered through the instruct target's chat template.
Also: a memory setting that cannot be had fails in one line naming the setting, before any
engine starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, default_pair_dirs, readme_command

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]
PROMPTS = [{"id": "capital", "prompt": "What is the capital of France?"},
           {"id": 7, "prompt": "Write one sentence about the sea."}]
CHAT = {"id": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def _env_without_kv_setting() -> dict[str, str]:
    # As a user runs it: no KV-cache setting, and vLLM's own engine process (the suite's in-process default
    # is the conftest's, not the user's).
    return {k: v for k, v in os.environ.items()
            if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")}


def _command(tmp, pair) -> list[str]:
    cmd = readme_command(".venv/bin/python", "scripts/batch_generate.py", placeholders={
        "TARGET": pair["target"], "DRAFT_DIR": pair["draft"],
        "prompts.jsonl": str(tmp / "prompts.jsonl"), "results.jsonl": str(tmp / "results.jsonl")})
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv/ in the checkout (README command 1, scripts/setup_env.sh, makes it)")
    return cmd


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readme_batch")
    pair = default_pair_dirs()
    with open(tmp / "prompts.jsonl", "w") as f:
        for p in [*PROMPTS, CHAT]:
            f.write(json.dumps(p) + "\n")
    cmd = _command(tmp, pair)
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1000, env=_env_without_kv_setting())
    return {"cmd": cmd, "res": res, "tmp": tmp, "pair": pair}


def test_readme_batch_command_runs_as_written(readme_run):
    res = readme_run["res"]
    assert res.returncode == 0, res.stderr[-4000:]
    results = [json.loads(line) for line in (readme_run["tmp"] / "results.jsonl").read_text().splitlines()]
    assert sorted(map(str, (r["id"] for r in results))) == sorted(str(p["id"]) for p in [*PROMPTS, CHAT])
    assert all(r["completion_tokens"] >= 1 and r["finish_reason"] in ("stop", "length") for r in results), results
    # The chat went through SmolLM2-Instruct's template: its prompt is the template's tokens.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(readme_run["pair"]["target"])
    rendered = tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True, tokenize=False)
    chat = next(r for r in results if r["id"] == "chat")
    assert chat["prompt_tokens"] == len(tok.encode(rendered, add_special_tokens=False)), chat
    log = res.stdout + res.stderr  # vLLM logs to stdout by default
    default_line = [line for line in log.splitlines() if "vllm_dspark: CPU KV cache:" in line]
    assert len(default_line) == 1 and "VLLM_CPU_KVCACHE_SPACE is unset" in default_line[0], log[-4000:]
    # --dtype native (the default): float32 where this CPU would emulate bf16, so the plugin's warning never fires.
    from vllm_dspark.serving import cpu_flags

    assert ("batch_generate: --dtype native: float32" in res.stderr) == (not cpu_flags.has_native_bf16())
    assert "bf16 matmuls are emulated" not in log, log[-4000:]


def test_rerunning_it_skips_what_is_done(readme_run):
    res = subprocess.run(readme_run["cmd"], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=_env_without_kv_setting())
    assert res.returncode == 0, res.stderr[-3000:]
    assert "3 prompts, 3 already in" in res.stderr and "0 to generate" in res.stderr


def test_memory_that_cannot_be_had_fails_in_one_line(tmp_path):
    """--gpu-memory-utilization 1.0 can never be had (the node's available memory is below its total)."""
    (tmp_path / "prompts.jsonl").write_text(json.dumps(PROMPTS[0]) + "\n")
    cmd = [sys.executable, str(REPO / "scripts" / "batch_generate.py"), "--model", default_pair_dirs()["target"],
           "--input", str(tmp_path / "prompts.jsonl"), "--output", str(tmp_path / "results.jsonl"),
           "--gpu-memory-utilization", "1.0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))  # the flag wins over it, and says so
    assert res.returncode == 2, res.stderr[-3000:]
    assert "--gpu-memory-utilization is given, so VLLM_CPU_KVCACHE_SPACE=1 from the environment is ignored" \
        in res.stderr
    ours = [line for line in res.stderr.splitlines() if line.startswith("batch_generate: --gpu-memory-utilization 1.0")]
    assert len(ours) == 1 and "VLLM_CPU_KVCACHE_SPACE" in ours[0], res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "Traceback" not in out and "EngineCore" not in out, out[-3000:]
