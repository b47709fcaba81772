"""Target compatibility: a drafter that does not fit its target is refused with both numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_dspark.config import DSparkConfig
from vllm_dspark.serving import compat
from vllm_dspark.tools.cli import main as cli_main
from vllm_dspark.tools.deploy.plan import bundled_k3_paths

DRAFT_K3, TARGET_K3 = bundled_k3_paths()
ENV = compat.AUX_STREAM_ENV


@pytest.fixture
def k3_draft() -> DSparkConfig:
    return DSparkConfig.from_json(DRAFT_K3)


def qwen3_target(layers: int = 36, hidden: int = 4096, vocab: int = 151936) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
            "num_hidden_layers": layers, "vocab_size": vocab, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128}


def qwen3_draft(**changes) -> DSparkConfig:
    base = dict(hidden_size=4096, vocab_size=151936, target_layer_ids=(1, 9, 17, 25, 33),
                num_target_layers=36, mask_token_id=151669)
    base.update(changes)
    return DSparkConfig(**base)


def test_bundled_k3_fixture_is_what_facts_say():
    t = json.loads(TARGET_K3.read_text())
    tc = compat.text_config(t)
    assert (tc["num_hidden_layers"], tc["hidden_size"], tc["vocab_size"]) == (93, 7168, 163840)
    assert tc["max_position_embeddings"] == 1_048_576 and tc["num_experts"] == 896
    mla = tc["linear_attn_config"]["full_attn_layers"]
    assert mla == list(range(4, 93, 4)) + [93] and len(mla) == 24
    assert sorted(tc["linear_attn_config"]["kda_layers"] + mla) == list(range(1, 94))


def test_bundled_k3_fixture_loads_in_vllms_config_class():
    kimi_k3 = pytest.importorskip("vllm.transformers_utils.configs.kimi_k3")
    t = json.loads(TARGET_K3.read_text())
    cfg = kimi_k3.KimiK3Config(text_config=t["text_config"])
    tc = cfg.text_config
    assert tc.is_mla and tc.is_linear_attn
    assert sum(tc.is_kda_layer(i) for i in range(tc.num_hidden_layers)) == 69
    assert cfg.hidden_size == 7168 and cfg.vocab_size == 163840


def test_k3_drafter_fits_k3_target(k3_draft):
    rep = compat.check_target_compat(k3_draft, TARGET_K3, environ={})
    assert rep.ok, rep.problems
    assert rep.kimi_k3 and rep.needs_aux_attn_res_stream
    assert rep.vllm_aux_layer_ids == [8, 24, 52, 68, 84]
    d = rep.to_dict()
    assert "fits" in d["summary"] and "\n" not in d["summary"] and ENV in d["summary"]


def test_hidden_size_mismatch_names_both_numbers():
    rep = compat.check_target_compat(qwen3_draft(), qwen3_target(hidden=5120), environ={})
    (msg,) = [p for p in rep.problems if p.startswith("hidden size")]
    assert "4096" in msg and "5120" in msg
    assert "DOES NOT FIT" in rep.summary()


def test_vocab_and_mask_token_outside_vocab():
    rep = compat.check_target_compat(qwen3_draft(), qwen3_target(vocab=151000), environ={})
    text = "\n".join(rep.problems)
    assert "151936" in text and "151000" in text
    assert "mask_token_id: 151669" in text and "0..150999" in text


def test_layer_id_outside_target_under_aux_convention():
    # id 33 = output of layer 33 = vLLM aux index 34 > 30 layers.
    rep = compat.check_target_compat(qwen3_draft(), qwen3_target(layers=30), environ={})
    (msg,) = [p for p in rep.problems if p.startswith("target_layer_ids")]
    assert "layer 33" in msg and "aux index 34" in msg and "30 layers" in msg
    assert "ENTERING" in msg  # the message explains the convention
    assert any(p.startswith("num_target_layers") and "36" in p and "30" in p for p in rep.problems)


def test_last_layer_output_is_a_valid_aux_index():
    # id 33 -> aux 34 == num_hidden_layers: the last layer's output, allowed.
    rep = compat.check_target_compat(qwen3_draft(num_target_layers=34), qwen3_target(layers=34), environ={})
    assert rep.ok, rep.problems
    rep = compat.check_target_compat(qwen3_draft(num_target_layers=34), qwen3_target(layers=33), environ={})
    assert any("aux index 34" in p for p in rep.problems)


def test_unreadable_target_is_a_problem_not_a_crash(tmp_path, k3_draft):
    rep = compat.check_target_compat(k3_draft, tmp_path / "nope", environ={})
    assert not rep.ok and "not found" in rep.problems[0]
    assert rep.to_dict()["summary"]


@pytest.mark.parametrize("target,expected", [
    ({"model_type": "kimi_k3", "text_config": {"hidden_size": 8}}, True),
    ({"architectures": ["KimiK3ForConditionalGeneration"], "hidden_size": 8}, True),
    ({"model_type": "kimi_linear", "hidden_size": 8, "attn_res_block_size": 4}, True),
    ({"model_type": "kimi_linear", "hidden_size": 8, "attn_res_block_size": None}, False),
    ({"model_type": "qwen3", "hidden_size": 8}, False),
])
def test_k3_detection(target, expected):
    assert compat.is_kimi_k3(target) is expected


def test_inspect_target_exit_code_1_and_message(tmp_path, capsys):
    draft_dir = tmp_path / "draft"
    draft_dir.mkdir()
    (draft_dir / "config.json").write_text(json.dumps(qwen3_draft().to_hf_dict()))
    tgt = tmp_path / "target.json"
    tgt.write_text(json.dumps(qwen3_target(layers=30, hidden=5120)))
    rc = cli_main(["inspect", str(draft_dir / "config.json"), "--target", str(tgt)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "4096" in out and "5120" in out and "aux index 34" in out
    rc = cli_main(["inspect", str(DRAFT_K3), "--target", str(TARGET_K3), "--json"])
    info = json.loads(capsys.readouterr().out)
    assert rc == 0 and info["target"]["ok"] and info["valid"]


def test_inspect_target_console_script_exit_code(tmp_path):
    tgt = tmp_path / "target.json"
    tgt.write_text(json.dumps(qwen3_target(layers=30)))
    r = subprocess.run([sys.executable, "-m", "vllm_dspark.tools.cli", "inspect", str(DRAFT_K3), "--target", str(tgt)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "7168" in r.stdout and "hidden size" in r.stdout


# ------------------------------------------------------------ VLLM_KIMI_K3_AUX_ATTN_RES_STREAM
def test_env_switch_set_when_unset(k3_draft):
    env: dict[str, str] = {}
    assert compat.ensure_k3_aux_attn_res_stream(TARGET_K3, k3_draft, environ=env) == "set"
    assert env == {ENV: "1"}
    assert compat.ensure_k3_aux_attn_res_stream(TARGET_K3, k3_draft, environ=env) == "already-on"


def test_env_switch_set_in_os_environ_is_inherited_by_children(k3_draft, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert compat.ensure_k3_aux_attn_res_stream(TARGET_K3, k3_draft) == "set"
    out = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get('{ENV}'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "1"


@pytest.mark.parametrize("value", ["0", "00", "false"])
def test_env_switch_explicitly_off_is_refused(k3_draft, value):
    env = {ENV: value}
    with pytest.raises(compat.K3CaptureError) as ei:
        compat.ensure_k3_aux_attn_res_stream(TARGET_K3, k3_draft, environ=env)
    msg = str(ei.value)
    assert f"{ENV}={value!r}" in msg and f"{ENV}=1" in msg and "unset" in msg
    assert env == {ENV: value}  # never overridden behind the user's back
    rep = compat.check_target_compat(k3_draft, TARGET_K3, environ=env)
    assert any(ENV in p for p in rep.problems)


def test_env_switch_worker_check_only(k3_draft):
    with pytest.raises(compat.K3CaptureError, match="did not inherit"):
        compat.ensure_k3_aux_attn_res_stream(TARGET_K3, k3_draft, environ={}, set_env=False)
    assert compat.ensure_k3_aux_attn_res_stream(TARGET_K3, k3_draft, environ={ENV: "1"},
                                                set_env=False) == "already-on"


def test_env_switch_not_needed_for_other_targets():
    env: dict[str, str] = {}
    assert compat.ensure_k3_aux_attn_res_stream(qwen3_target(), qwen3_draft(), environ=env) == "not-needed"
    assert env == {}


def test_env_switch_from_a_vllm_like_config(k3_draft):
    class HF:
        def __init__(self, d):
            self.d = d

        def to_dict(self):
            return self.d

    class NS:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    vc = NS(model_config=NS(hf_config=HF(json.loads(TARGET_K3.read_text()))),
            speculative_config=NS(draft_model_config=NS(hf_config=HF(k3_draft.to_hf_dict()), model="d")))
    env: dict[str, str] = {}
    assert compat.ensure_for_vllm_config(vc, environ=env) == "set" and env[ENV] == "1"
    assert compat.ensure_for_vllm_config(NS(speculative_config=None), environ={}) == "not-needed"


def test_accepts_vllms_own_k3_config_object(k3_draft):
    # The plugin passes vLLM's hf_config (a PretrainedConfig), not a path.
    kimi_k3 = pytest.importorskip("vllm.transformers_utils.configs.kimi_k3")
    t = json.loads(TARGET_K3.read_text())
    hf = kimi_k3.KimiK3Config(text_config=t["text_config"], architectures=t["architectures"])
    rep = compat.check_target_compat(k3_draft, hf, environ={})
    assert rep.ok and rep.kimi_k3 and rep.target_num_hidden_layers == 93, rep.problems
    env: dict[str, str] = {}
    assert compat.ensure_k3_aux_attn_res_stream(hf, k3_draft, environ=env) == "set" and env[ENV] == "1"
