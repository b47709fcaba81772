"""``vllm-dspark plan``: the K3 figures, and per-token figures checked against vLLM's KV-cache specs."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_dspark.config import DSparkConfig
from vllm_dspark.model.reference import count_parameters
from vllm_dspark.serving.compat import load_target_config
from vllm_dspark.tools.cli import main as cli_main
from vllm_dspark.tools.deploy import plan

GiB = 1024 ** 3
DRAFT_K3, TARGET_K3 = plan.bundled_k3_paths()


def run_plan_json(capsys, *args: str) -> tuple[int, dict]:
    rc = cli_main(["plan", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_k3_plan_numbers_from_the_issue(capsys):
    rc, p = run_plan_json(capsys, "--context", "1048576", "--tp", "8")
    assert rc == 0, p["problems"]
    d = p["drafter"]
    assert d["kv_bytes_per_token"] == 20_480  # 5 layers x 16 KV heads x 64 x (K, V) x 2 bytes
    assert d["kv_bytes_per_sequence"] == 20 * GiB
    assert d["kv_bytes_per_sequence_windowed"] == int(1.25 * GiB)
    assert d["window"] == 65_536
    assert d["kv_bytes_per_token_per_gpu"] == 20_480 // 8  # 16 KV heads split 8 ways
    assert d["parameters"] == 2_249_289_601
    t = p["target"]
    assert (t["mla_layers"], t["kda_layers"]) == (24, 69)
    assert t["mla_bytes_per_sequence"] == 27 * GiB  # FACTS.md: "about 27 GiB (bf16)"
    # The target-side figures are explained in the output.
    text = " ".join(p["explanation"])
    assert "MLA" in text and "KDA" in text and "every TP rank" in text
    assert p["compat"]["ok"] and p["compat"]["kimi_k3"]


def test_k3_plan_human_output(capsys):
    assert cli_main(["plan", "--context", "1048576", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "20,480 B" in out and "20.00 GiB without a window" in out and "1.25 GiB with the 65,536" in out
    assert "how these figures are made" in out and "target MLA cache" in out and "target KDA state" in out


def test_kv_dtype_batch_and_window(capsys):
    _, p = run_plan_json(capsys, "--context", "131072", "--tp", "8", "--kv-dtype", "fp8", "--batch", "4",
                         "--window", "4096")
    d = p["drafter"]
    assert d["kv_bytes_per_token"] == 10_240
    assert d["kv_bytes_per_gpu"] == 10_240 // 8 * 131072 * 4
    assert d["kv_bytes_per_gpu_windowed"] == 10_240 // 8 * 4096 * 4
    assert p["target"]["mla_bytes_per_token"] == 24 * 576


def test_pp_splits_target_layers_like_vllm(capsys, monkeypatch):
    utils = pytest.importorskip("vllm.distributed.utils")
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    for layers, pp in [(93, 2), (93, 4), (36, 3), (5, 4), (4, 4)]:
        assert plan.pp_partition(layers, pp) == [utils.get_pp_indices(layers, r, pp) for r in range(pp)]
    _, p = run_plan_json(capsys, "--tp", "8", "--pp", "2")
    first, last = p["per_gpu"]
    assert first["drafter_weights_bytes"] == 0 and last["drafter_weights_bytes"] > 0
    assert first["mla_layers"] + last["mla_layers"] == 24
    assert first["target_cache_bytes"] + last["target_cache_bytes"] == p["target"]["mla_bytes_per_sequence"]


def test_pp_boundary_on_an_aux_layer_is_a_problem(capsys):
    draft = DSparkConfig.from_json(DRAFT_K3)
    target = load_target_config(TARGET_K3)
    # 93 layers over 2 stages: stage 0 ends at 47. A drafter reading id 46 needs aux 47 there.
    d2 = draft.replace(target_layer_ids=(7, 23, 46, 67, 83))
    p = plan.make_plan(d2, target, plan.PlanInputs(context=1024, batch=1, tp=8, pp=2, kv_dtype="auto",
                                                   window=65536, num_speculative_tokens=7))
    assert any("ends at layer 47" in q and "VLLM_PP_LAYER_PARTITION" in q for q in p["problems"])


def test_drafter_weights_per_gpu_at_tp1_are_the_whole_model():
    draft = DSparkConfig.from_json(DRAFT_K3)
    w = plan.drafter_weights(draft, 1)
    assert w["parameters"] == w["parameters_per_gpu"] == count_parameters(draft)
    w8 = plan.drafter_weights(draft, 8)
    # fc (256,901,120) and markov_w1 (41,943,040) stay whole on every rank.
    assert w8["parameters_per_gpu"] > 256_901_120 + 41_943_040
    assert w8["parameters_per_gpu"] < w["parameters"] / 2


def test_bad_inputs_exit_2_with_a_message(capsys):
    assert cli_main(["plan", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--tp 3" in err and "64" in err
    assert cli_main(["plan", "--target", "/nonexistent/config.json"]) == 2
    assert "not found" in capsys.readouterr().err


# ------------------------------------------------------------------ against vLLM's own spec
@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from tests.tiny_pair import make_target

    return make_target(tmp_path_factory.mktemp("tiny") / "target", num_heads=4, num_kv_heads=2,
                       head_dim=64, num_layers=4, dtype=torch.bfloat16)


def _vllm_bytes_per_token(model_dir, tp: int) -> int:
    """Per-GPU KV bytes per token of a dense model, from vLLM's ModelConfig + FullAttentionSpec."""
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    mc = ModelConfig(model=str(model_dir), dtype="bfloat16", skip_tokenizer_init=True)
    pc = ParallelConfig(tensor_parallel_size=tp)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=mc.get_num_kv_heads(pc),
                             head_size=mc.get_head_size(), dtype=mc.dtype)
    return spec.page_size_bytes // spec.block_size * mc.get_num_layers(pc)


@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_target_and_drafter_per_token_match_vllm_spec(tiny_qwen3, tmp_path, tp):
    from tests.tiny_pair import drafter_config_for

    target = load_target_config(tiny_qwen3)
    draft = drafter_config_for(tiny_qwen3)
    p = plan.make_plan(draft, target, plan.PlanInputs(context=1000, batch=1, tp=tp, pp=1, kv_dtype="auto",
                                                      window=512, num_speculative_tokens=7))
    tp = p["inputs"]["tp"]
    assert p["per_gpu"][0]["target_cache_bytes_per_token"] == _vllm_bytes_per_token(tiny_qwen3, tp)
    # The drafter's backbone is a Qwen3 decoder stack: vLLM sizes its cache the same way.
    ddir = tmp_path / "draft_as_qwen3"
    ddir.mkdir()
    hf = draft.to_hf_dict()
    hf["architectures"] = ["Qwen3ForCausalLM"]
    (ddir / "config.json").write_text(json.dumps(hf))
    assert p["drafter"]["kv_bytes_per_token_per_gpu"] == _vllm_bytes_per_token(ddir, tp)
    assert p["drafter"]["kv_bytes_per_token"] == _vllm_bytes_per_token(ddir, 1)


def test_k3_per_token_figures_match_vllm_mla_and_kda_specs():
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    target = load_target_config(TARGET_K3)
    draft = DSparkConfig.from_json(DRAFT_K3)
    tc = target["text_config"]
    lin = tc["linear_attn_config"]
    for tp in (1, 8):
        p = plan.make_plan(draft, target, plan.PlanInputs(context=4096, batch=1, tp=tp, pp=1, kv_dtype="auto",
                                                          window=65536, num_speculative_tokens=7))
        # As vLLM's K3 MLA layer declares it (vllm/models/kimi_k3/nvidia/mla.py, get_kv_cache_spec).
        mla = MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1,
                               head_size=tc["kv_lora_rank"] + tc["qk_rope_head_dim"], dtype=torch.bfloat16)
        assert p["target"]["mla_bytes_per_token_per_layer"] == mla.page_size_bytes // 64
        # As vLLM's K3 KDA layer declares it (get_state_shape / get_state_dtype, no RecoverSSM).
        kda = MambaSpec(block_size=64,
                        shapes=MambaStateShapeCalculator.kda_state_shape(
                            tp, lin["num_heads"], lin["head_dim"],
                            conv_kernel_size=lin["short_conv_kernel_size"], num_spec=7),
                        dtypes=MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto"))
        assert p["target"]["kda_state_bytes_per_layer_per_gpu"] == kda.page_size_bytes


def test_dense_target_plan_for_the_qwen3_shape(capsys, tmp_path):
    tgt = tmp_path / "qwen3_8b.json"
    tgt.write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
                               "num_hidden_layers": 36, "vocab_size": 151936, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960}))
    draft = tmp_path / "draft.json"  # DSparkConfig's defaults are the Qwen3-8B drafter shape
    draft.write_text(json.dumps(DSparkConfig().to_hf_dict()))
    rc, p = run_plan_json(capsys, "--draft", str(draft), "--target", str(tgt), "--tp", "2")
    assert rc == 0, p["problems"]
    assert p["target"]["gqa_layers"] == 36 and p["target"]["mla_layers"] == 0
    assert p["target"]["gqa_bytes_per_token"] == 36 * 8 * 128 * 2 * 2
    # Served within the drafter's trained context: no window is needed, so none is set.
    assert p["inputs"]["context"] == 40960 and p["drafter"]["window"] is None
