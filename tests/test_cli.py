"""`vllm-dspark inspect`: the model card's numbers, exit codes 0 / 1 / 2, readable problems."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.helpers import K3_CONFIG, K3_PARAMS, QWEN3_CONFIG, k3_dict, tiny_config
from vllm_dspark.config import DSparkConfig
from vllm_dspark.model.reference import count_parameters
from vllm_dspark.tools import cli

SCRIPT = Path(sys.executable).with_name("vllm-dspark")

QWEN3_PARAMS = 1_126_422_017


def _run_script(*args: str) -> subprocess.CompletedProcess:
    assert SCRIPT.is_file(), f"console script missing: {SCRIPT} (pip install -e .)"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def _main(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------- console script
@pytest.fixture(scope="module")
def script_json() -> dict[str, subprocess.CompletedProcess]:
    """`vllm-dspark inspect CONFIG --json` for both reference shapes, run side by side (torch import dominates)."""
    assert SCRIPT.is_file(), f"console script missing: {SCRIPT} (pip install -e .)"
    procs = {name: subprocess.Popen([str(SCRIPT), "inspect", str(path), "--json"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, path in (("k3", K3_CONFIG), ("qwen3", QWEN3_CONFIG))}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("name, params, kv", [
    ("k3", K3_PARAMS, 20480),
    ("qwen3", QWEN3_PARAMS, 5 * 8 * 128 * 2 * 2),
], ids=["k3", "qwen3"])
def test_console_script_reports_the_model_card_numbers(script_json, name, params, kv):
    proc = script_json[name]
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)  # one JSON object, nothing else on stdout
    assert info["parameters"] == params and isinstance(info["parameters"], int)
    assert info["kv_cache_bytes_per_token"] == kv
    assert info["problems"] == []


def test_console_script_usage_errors_exit_2(tmp_path):
    proc = _run_script("inspect", str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert "no such file" in proc.stderr
    proc = _run_script("inspect", str(K3_CONFIG), "--bogus")
    assert proc.returncode == 2
    assert "--bogus" in proc.stderr
    proc = _run_script()
    assert proc.returncode == 2


# ---------------------------------------------------------------- in-process
def test_main_json_k3(capsys):
    rc, out, _ = _main(capsys, "inspect", str(K3_CONFIG), "--json")
    assert rc == 0
    info = json.loads(out)
    assert info["parameters"] == K3_PARAMS
    assert info["kv_cache_bytes_per_token"] == 20480
    assert info["problems"] == [] and info["valid"] is True
    assert info["target_layer_ids"] == [7, 23, 51, 67, 83]
    assert info["vllm_aux_layer_ids"] == [8, 24, 52, 68, 84]
    assert info["block_size"] == 7 and info["draft_tokens_per_step"] == 7 and info["verified_tokens_per_step"] == 8
    assert info["rope"] == "yarn" and info["markov_rank"] == 256


def test_main_json_qwen3(capsys):
    rc, out, _ = _main(capsys, "inspect", str(QWEN3_CONFIG), "--json")
    assert rc == 0
    assert json.loads(out)["parameters"] == QWEN3_PARAMS


def test_parameter_count_matches_the_facts_breakdown():
    # FACTS.md: 5 x 381,696,128 + fc 256,901,120 + Markov 2 x 163840 x 256 + confidence 7,425 + norms 14,336.
    assert K3_PARAMS == 5 * 381_696_128 + 256_901_120 + 2 * 163840 * 256 + 7_425 + 14_336
    assert count_parameters(DSparkConfig.from_json(K3_CONFIG)) == K3_PARAMS


def test_readable_summary(capsys):
    rc, out, _ = _main(capsys, "inspect", str(K3_CONFIG))
    assert rc == 0
    assert "2,249,289,601" in out
    assert "20,480 bytes per token" in out
    assert "anchor-first" in out and "7 drafts, 8 verified tokens" in out
    assert "[7, 23, 51, 67, 83] of 93" in out and "[8, 24, 52, 68, 84]" in out
    assert "rank 256" in out and "with Markov input" in out and "yarn" in out
    assert "OK: no problems found" in out


def test_kv_heads_not_dividing_heads_exits_1(tmp_path, capsys):
    d = k3_dict()
    d["num_key_value_heads"] = 24
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(d))

    rc, out, _ = _main(capsys, "inspect", str(bad))
    assert rc == 1
    assert "PROBLEMS" in out and "num_key_value_heads" in out

    rc, out, _ = _main(capsys, "inspect", str(bad), "--json")
    assert rc == 1
    info = json.loads(out)
    assert info["valid"] is False
    assert any("num_key_value_heads" in p and "24" in p for p in info["problems"]), info["problems"]

    rc, _, _ = _main(capsys, "inspect", str(tmp_path))  # the directory form too
    assert rc == 1


def test_missing_path_exits_2(tmp_path, capsys):
    rc, out, err = _main(capsys, "inspect", str(tmp_path / "nope"))
    assert rc == 2 and out == "" and "no such file" in err


def test_bad_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["inspect", str(K3_CONFIG), "--bogus"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli.main(["inspect"])  # PATH is required
    assert info.value.code == 2


def test_tiny_checkpoint_directory(tiny_ckpt, capsys):
    rc, out, _ = _main(capsys, "inspect", str(tiny_ckpt), "--json")
    assert rc == 0
    info = json.loads(out)
    assert info["parameters"] == count_parameters(tiny_config())
    assert info["tensors"] == len(load_file(str(tiny_ckpt / "model.safetensors")))
    assert info["weights_file_bytes"] == (tiny_ckpt / "model.safetensors").stat().st_size


def test_corrupt_checkpoint_exits_1_naming_the_tensor(tiny_ckpt, tmp_path, capsys):
    bad = shutil.copytree(tiny_ckpt, tmp_path / "c")
    state = load_file(str(bad / "model.safetensors"))
    state["layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(state, str(bad / "model.safetensors"))

    rc, out, _ = _main(capsys, "inspect", str(bad))
    assert rc == 1
    assert "layers.0.mlp.down_proj.weight: contains 1 NaN" in out
    # --no-scan skips exactly the value scan.
    rc, _, _ = _main(capsys, "inspect", str(bad), "--no-scan")
    assert rc == 0

    state.pop("fc.weight")
    save_file(state, str(bad / "model.safetensors"))
    rc, out, _ = _main(capsys, "inspect", str(bad), "--json", "--no-scan")
    assert rc == 1
    assert any(p.startswith("fc.weight: missing") for p in json.loads(out)["problems"])
