"""DSparkConfig: the real exports parse to the facts in FACTS.md; bad combinations fail loudly."""

from __future__ import annotations

import json

import pytest

from tests.helpers import K3_CONFIG, QWEN3_CONFIG, k3_dict
from vllm_dspark.config import DSparkConfig, DSparkConfigError


def test_k3_config_parses_to_the_documented_shape():
    cfg = DSparkConfig.from_json(K3_CONFIG)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (7168, 5, 64, 16, 64, 14336, 163840)
    assert cfg.block_size == 7
    assert cfg.query_layout == "anchor_first"
    assert cfg.num_draft_tokens == 7  # 7 queries give 7 drafts (anchor-first), 8 verified tokens
    assert cfg.target_layer_ids == (7, 23, 51, 67, 83)
    assert cfg.num_target_layers == 93
    assert cfg.vllm_aux_layer_ids == (8, 24, 52, 68, 84)  # vLLM reads the stream entering layer id + 1
    assert cfg.mask_token_id == 163824
    assert cfg.markov_rank == 256 and cfg.markov_head_type == "vanilla" and cfg.has_markov_head
    assert cfg.enable_confidence_head and cfg.confidence_head_with_markov
    assert cfg.max_position_embeddings == 65536
    assert cfg.rope_type == "yarn"
    assert cfg.rope_theta == 10000.0
    assert cfg.rope_scaling["factor"] == 16.0
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert "rope_theta" not in cfg.rope_scaling
    assert cfg.aux_hidden_size == 5 * 7168
    assert cfg.kv_cache_bytes_per_token() == 20480  # 5 x 16 x 64 x 2 (K, V) x 2 bytes
    assert cfg.dtype == "bfloat16"
    assert cfg.problems() == []


def test_qwen3_config_parses_plain_rope():
    cfg = DSparkConfig.from_json(QWEN3_CONFIG)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4096, 32, 8, 128)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.num_target_layers == 36
    assert cfg.vllm_aux_layer_ids == (2, 10, 18, 26, 34)
    assert cfg.rope_type == "default" and cfg.rope_scaling is None and cfg.rope_theta == 1_000_000.0
    assert cfg.mask_token_id == 151669 and cfg.num_draft_tokens == 7
    assert cfg.kv_cache_bytes_per_token() == 5 * 8 * 128 * 2 * 2


def test_from_json_accepts_a_checkpoint_directory(tmp_path):
    (tmp_path / "config.json").write_text(K3_CONFIG.read_text())
    assert DSparkConfig.from_json(tmp_path) == DSparkConfig.from_json(K3_CONFIG)


@pytest.mark.parametrize("src", [K3_CONFIG, QWEN3_CONFIG], ids=["k3", "qwen3"])
def test_to_hf_dict_round_trips(src):
    cfg = DSparkConfig.from_json(src)
    again = DSparkConfig.from_dict(json.loads(json.dumps(cfg.to_hf_dict())))
    assert again == cfg


def _refused(d: dict) -> DSparkConfigError:
    with pytest.raises(DSparkConfigError) as info:
        DSparkConfig.from_dict(d)
    return info.value


def _only_problem(err: DSparkConfigError, field: str) -> str:
    hits = [p for p in err.problems if field in p]
    assert len(hits) == 1, err.problems
    return hits[0]


def test_kv_heads_not_dividing_heads_is_refused_with_a_fix():
    d = k3_dict()
    d["num_key_value_heads"] = 24  # 64 % 24 != 0
    msg = _only_problem(_refused(d), "num_key_value_heads")
    assert "24" in msg and "num_attention_heads=64" in msg
    assert "num_key_value_heads=8" in msg  # the suggested fix: gcd(64, 24), a divisor of 64


def test_target_layer_outside_the_target_is_refused():
    d = k3_dict()
    d["dflash_config"]["target_layer_ids"] = [7, 23, 51, 67, 93]  # 93 layers: valid ids 0..92
    msg = _only_problem(_refused(d), "target_layer_ids")
    assert "93" in msg and "0..92" in msg and "num_target_layers" in msg


def test_negative_target_layer_is_refused():
    d = k3_dict()
    d["dflash_config"]["target_layer_ids"] = [-1, 7]
    msg = _only_problem(_refused(d), "target_layer_ids")
    assert "-1" in msg


def test_rank_zero_with_markov_confidence_is_refused():
    d = k3_dict()
    d["dflash_config"]["markov_rank"] = 0
    msg = _only_problem(_refused(d), "confidence_head_with_markov")
    assert "markov_rank is 0" in msg
    assert "set markov_rank > 0 or confidence_head_with_markov: false" in msg
    # The fix it names works.
    d["dflash_config"]["confidence_head_with_markov"] = False
    cfg = DSparkConfig.from_dict(d)
    assert not cfg.has_markov_head and cfg.enable_confidence_head


def test_unknown_markov_head_type_is_refused():
    d = k3_dict()
    d["dflash_config"]["markov_head_type"] = "mlp"
    msg = _only_problem(_refused(d), "markov_head_type")
    assert "'mlp'" in msg and "vanilla" in msg


@pytest.mark.parametrize("mask_id", [163840, -5])
def test_mask_token_outside_vocab_is_refused(mask_id):
    d = k3_dict()
    d["dflash_config"]["mask_token_id"] = mask_id
    msg = _only_problem(_refused(d), "mask_token_id")
    assert str(mask_id) in msg and "vocab_size=163840" in msg


def test_missing_mask_token_is_reported():
    d = k3_dict()
    del d["dflash_config"]["mask_token_id"]
    err = _refused(d)
    assert any("mask_token_id: missing" in p for p in err.problems), err.problems


def test_missing_target_layer_count_is_allowed_but_ids_are_still_checked():
    d = k3_dict()
    del d["num_target_layers"]
    cfg = DSparkConfig.from_dict(d)
    assert cfg.num_target_layers is None
    assert "num_target_layers" not in cfg.to_hf_dict()
    d["dflash_config"]["target_layer_ids"] = [-1, 3]
    msg = _only_problem(_refused(d), "target_layer_ids")
    assert "-1" in msg


def test_every_problem_is_listed_at_once():
    d = k3_dict()
    d["num_key_value_heads"] = 24
    d["dflash_config"]["markov_head_type"] = "mlp"
    d["dflash_config"]["mask_token_id"] = 10 ** 6
    err = _refused(d)
    assert len(err.problems) == 3, err.problems
    text = str(err)
    for field in ("num_key_value_heads", "markov_head_type", "mask_token_id"):
        assert field in text


def test_direct_construction_is_validated_too():
    with pytest.raises(DSparkConfigError, match="num_key_value_heads"):
        DSparkConfig(num_attention_heads=32, num_key_value_heads=12)
    with pytest.raises(DSparkConfigError, match="head_dim: got 0"):
        DSparkConfig(head_dim=0)


def test_bad_json_and_missing_file_are_config_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(DSparkConfigError, match="not valid JSON"):
        DSparkConfig.from_json(bad)
    with pytest.raises(DSparkConfigError, match="not found"):
        DSparkConfig.from_json(tmp_path / "nope.json")
