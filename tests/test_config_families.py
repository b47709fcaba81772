"""Every DSpark checkpoint family's config.json becomes one DSparkConfig with the family named.

The published configs load verbatim (tests/fixtures/families/README.md says where each came from);
keys that mean different things in two families (layer ids, sample_from_anchor, num_target_layers)
are pinned per family; bad input is refused by name with the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import K3_CONFIG, K3_PARAMS, QWEN3_CONFIG, k3_dict
from vllm_dspark.checkpoint.shapes import count_parameters, required_shapes
from vllm_dspark.config import DSparkConfig, DSparkConfigError
from vllm_dspark.config.families import QWEN3_DEFAULTS, is_dspark_config

FAMILIES_DIR = Path(__file__).resolve().parent / "fixtures" / "families"


def raw(name: str) -> dict:
    return json.loads((FAMILIES_DIR / name).read_text())


def parse(d: dict) -> DSparkConfig:
    return DSparkConfig.from_dict(d)


def refused(d: dict) -> list[str]:
    with pytest.raises(DSparkConfigError) as info:
        DSparkConfig.from_dict(d)
    return info.value.problems


def only(problems: list[str], needle: str) -> str:
    hits = [p for p in problems if needle in p]
    assert len(hits) == 1, problems
    return hits[0]


# ---------------------------------------------------------------- the published files, verbatim
# file, family, architecture, block, drafts, target_layer_ids, num_target_layers, vocab, draft vocab
PUBLISHED = [
    ("specforge-qwen3-4b-dspark.json", "specforge", "DFlashDraftModel", 7, 7, (1, 9, 17, 25, 33), 36, 151936, None),
    ("specforge-glm-5.2-dspark.json", "specforge", "DSparkDraftModel", 7, 7, (1, 19, 38, 57, 76), 78, 154880, None),
    ("specforge-qwen3.6-27b-dspark.json", "specforge", "DSparkDraftModel", 16, 16, (2, 17, 32, 47, 62), 64, 248320,
     None),
    ("specforge-qwen3.8-27b-dspark.json", "specforge", "DSparkDraftModel", 7, 7, (5, 19, 33, 47, 61), 64, 248320,
     None),
    ("specforge-qwen3-8b-dspark-draftvocab32k.json", "specforge", "DSparkDraftModel", 7, 7, (1, 9, 17, 25, 33), 36,
     151936, 32000),
    ("speculators-qwen3.6-35b-a3b.json", "speculators", "Qwen3DSparkModel", 8, 8, (1, 9, 19, 29, 36), None, 248320,
     32000),
    ("speculators-glm-5.2-gated-1pn.constructed.json", "speculators", "DSparkDraftModel", 8, 7,
     (1, 19, 38, 57, 76), None, 154880, 32000),
    ("deepspec-qwen3-4b-block7.constructed.json", "deepspec", "Qwen3DSparkModel", 7, 7, (1, 9, 17, 25, 33), 36,
     151936, None),
    ("deepspec-gemma4.constructed.json", "other_backbone", "Gemma4DSparkModel", 7, 7, (1, 8, 15, 22, 28), 30,
     262144, None),
    ("k3-mla-dspark.constructed.json", "other_backbone", "K3DSparkModel", 7, 7, (2, 23, 47, 71, 89), 93, 163840,
     None),
]


@pytest.mark.parametrize("name,family,arch,block,drafts,ids,depth,vocab,dv", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_each_family_file_loads_verbatim(name, family, arch, block, drafts, ids, depth, vocab, dv):
    cfg = DSparkConfig.from_json(FAMILIES_DIR / name)
    assert (cfg.family, cfg.architecture) == (family, arch)
    assert (cfg.block_size, cfg.num_draft_tokens) == (block, drafts)
    assert cfg.target_layer_ids == ids and cfg.num_target_layers == depth
    assert cfg.vllm_aux_layer_ids == tuple(i + 1 for i in ids)
    assert (cfg.vocab_size, cfg.draft_vocab_size) == (vocab, dv)
    assert cfg.problems() == []
    assert is_dspark_config(raw(name))


def test_the_suite_s_own_specforge_fixtures_are_specforge():
    for path in (K3_CONFIG, QWEN3_CONFIG):
        cfg = DSparkConfig.from_json(path)
        assert (cfg.family, cfg.architecture, cfg.backbone) == ("specforge", "DSparkDraftModel", "qwen3")


def test_glm_dspark_config_block_is_read():
    # GLM-5.2 keeps the Markov / confidence keys in dspark_config, not dflash_config.
    cfg = parse(raw("specforge-glm-5.2-dspark.json"))
    assert cfg.markov_rank == 256 and cfg.markov_head_type == "vanilla"
    assert cfg.enable_confidence_head and cfg.confidence_head_with_markov
    assert cfg.rope_theta == 8_000_000 and cfg.head_dim == 64


def test_yarn_with_beta_keys_is_kept_for_the_rope():
    cfg = parse(raw("specforge-qwen3.8-27b-dspark.json"))
    assert cfg.rope_type == "yarn" and cfg.rope_theta == 10_000_000
    assert cfg.rope_scaling == {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                "original_max_position_embeddings": 8192, "rope_type": "yarn"}


def test_speculators_published_shape():
    cfg = parse(raw("speculators-qwen3.6-35b-a3b.json"))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2048, 16, 2, 256)
    assert cfg.sample_from_anchor and cfg.query_layout == "anchor_first"
    assert cfg.sliding_window == 2048  # every draft layer is a sliding_attention layer
    assert cfg.mask_token_id == 248077 and cfg.markov_rank == 256 and cfg.enable_confidence_head
    # Keys its transformer_layer_config leaves out take transformers' Qwen3Config defaults.
    assert cfg.max_position_embeddings == 32768 and cfg.rope_theta == 10000.0 and cfg.hidden_act == "silu"


def test_qwen3_defaults_are_transformers_own():
    transformers = pytest.importorskip("transformers")
    d = transformers.Qwen3Config().to_dict()
    theta = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta"))
    for key, value in QWEN3_DEFAULTS.items():
        got = theta if key == "rope_theta" else d[key]
        assert got == value, key


# ---------------------------------------------------------------- keys resolved by family, never by guess
def _deepspec_flat() -> dict:
    return raw("deepspec-qwen3-4b-block7.constructed.json")


def test_sample_from_anchor_absent_means_true_for_deepspec():
    d = _deepspec_flat()
    assert "sample_from_anchor" not in d
    cfg = parse(d)
    assert cfg.sample_from_anchor and cfg.num_draft_tokens == cfg.block_size == 7


def test_sample_from_anchor_absent_means_false_for_speculators():
    d = raw("speculators-glm-5.2-gated-1pn.constructed.json")
    assert "sample_from_anchor" not in d
    cfg = parse(d)
    assert not cfg.sample_from_anchor and cfg.query_layout == "one_plus_n"
    assert cfg.num_draft_tokens == cfg.block_size - 1 == 7


def test_sample_from_anchor_absent_follows_the_projector_for_specforge():
    d = k3_dict()
    assert parse(d).sample_from_anchor
    d["dflash_config"]["projector_type"] = "dflash"
    d["dflash_config"]["markov_rank"] = 0
    d["dflash_config"]["confidence_head_with_markov"] = False
    assert not parse(d).sample_from_anchor


def test_the_same_absent_key_means_different_layouts_by_family():
    """One drafter written by DeepSpec and by speculators, sample_from_anchor absent in both."""
    spec = raw("speculators-qwen3.6-35b-a3b.json")
    del spec["sample_from_anchor"]
    spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 7
    deep = {**spec["transformer_layer_config"], "architectures": ["Qwen3DSparkModel"], "block_size": 8,
            "mask_token_id": spec["mask_token_id"], "target_layer_ids": [1, 9, 19, 29, 36], "markov_rank": 256}
    assert parse(deep).num_draft_tokens == 8  # DeepSpec: absent means anchor-first, B drafts
    assert parse(spec).num_draft_tokens == 7  # speculators: absent means 1 + N, B - 1 drafts


def test_a_dflash_config_block_is_read_by_specforge_rules_under_the_runtime_name():
    # vLLM's V2 runner and SGLang rename SpecForge exports to Qwen3DSparkModel and keep dflash_config.
    d = k3_dict()
    d["architectures"] = ["Qwen3DSparkModel"]
    del d["dflash_config"]["enable_confidence_head"]  # SpecForge derives it from confidence_head_alpha > 0
    cfg = parse(d)
    assert cfg.family == "specforge" and cfg.enable_confidence_head
    assert cfg.replace(architecture="DSparkDraftModel") == parse(k3_dict())


def test_speculators_layer_ids_are_vllm_aux_indices():
    cfg = parse(raw("speculators-qwen3.6-35b-a3b.json"))
    assert cfg.vllm_aux_layer_ids == (2, 10, 20, 30, 37)  # aux_hidden_state_layer_ids as written
    assert cfg.target_layer_ids == (1, 9, 19, 29, 36)  # DeepSpec's convention: aux - 1


def test_deepspec_and_specforge_layer_ids_are_layer_outputs():
    assert parse(_deepspec_flat()).vllm_aux_layer_ids == (2, 10, 18, 26, 34)
    assert parse(k3_dict()).target_layer_ids == (7, 23, 51, 67, 83)


def test_speculators_architectures_do_not_decide_the_family():
    # RedHat's speculators exports may name Qwen3DSparkModel; speculators_model_type decides.
    d = raw("speculators-qwen3.6-35b-a3b.json")
    assert d["architectures"] == ["Qwen3DSparkModel"]
    assert parse(d).family == "speculators"


def test_k3_mla_num_target_layers_counts_taps():
    d = raw("k3-mla-dspark.constructed.json")
    cfg = parse(d)
    assert cfg.num_target_layers == 93  # target_num_hidden_layers, the target's depth
    d["num_target_layers"] = 93  # the SpecForge meaning, in the wrong family
    msg = only(refused(d), "num_target_layers")
    assert "number of tapped layers" in msg and "5" in msg


# ---------------------------------------------------------------- the speculators block / layout contract
def test_speculative_tokens_disagreeing_with_block_and_layout_is_refused():
    d = raw("speculators-qwen3.6-35b-a3b.json")
    del d["sample_from_anchor"]  # now the 1 + N layout: 8 - 1 = 7 drafts, but the file says 8
    msg = only(refused(d), "speculative_tokens")
    assert "got 8" in msg and "block_size 8" in msg and "proposes 7" in msg
    assert "set speculative_tokens to 7" in msg and "sample_from_anchor" in msg


def test_speculative_tokens_agreeing_in_either_layout_are_accepted():
    d = raw("speculators-glm-5.2-gated-1pn.constructed.json")
    assert parse(d).num_draft_tokens == 7
    d["sample_from_anchor"] = True
    d["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 8
    assert parse(d).num_draft_tokens == 8


def test_speculators_block_size_defaults_to_8():
    d = raw("speculators-glm-5.2-gated-1pn.constructed.json")
    del d["block_size"]
    assert parse(d).block_size == 8


def test_speculators_without_its_backbone_or_layers_is_refused():
    d = raw("speculators-qwen3.6-35b-a3b.json")
    del d["transformer_layer_config"]
    assert "transformer_layer_config: missing" in refused(d)[0]
    d = raw("speculators-qwen3.6-35b-a3b.json")
    del d["aux_hidden_state_layer_ids"]
    problems = refused(d)
    assert any(p.startswith("aux_hidden_state_layer_ids: missing") for p in problems), problems


# ---------------------------------------------------------------- heads and vocabularies
@pytest.mark.parametrize("name", ["speculators-glm-5.2-gated-1pn.constructed.json", "k3-mla-dspark.constructed.json",
                                  "deepspec-qwen3-4b-block7.constructed.json"])
def test_unknown_markov_head_type_is_refused_in_every_family(name):
    d = raw(name)
    d["markov_head_type"] = "mlp"
    msg = only(refused(d), "markov_head_type")
    assert "'mlp'" in msg and "vanilla" in msg and "gated" in msg and "rnn" in msg


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_every_head_type_parses(head):
    d = raw("speculators-glm-5.2-gated-1pn.constructed.json")
    d["markov_head_type"] = head
    assert parse(d).markov_head_type == head


def test_gated_head_without_markov_rank_is_refused():
    d = raw("speculators-glm-5.2-gated-1pn.constructed.json")
    d["markov_rank"] = 0
    d["confidence_head_with_markov"] = False
    msg = only(refused(d), "markov_head_type")
    assert "markov_rank is 0" in msg


def test_draft_vocab_as_large_as_the_target_is_the_full_vocabulary():
    d = raw("speculators-glm-5.2-gated-1pn.constructed.json")
    d["draft_vocab_size"] = 154880
    assert parse(d).draft_vocab_size is None
    d["draft_vocab_size"] = 200000
    msg = only(refused(d), "draft_vocab_size")
    assert "200000" in msg and "vocab_size=154880" in msg


def test_speculators_draft_vocab_defaults_to_speculators_own():
    d = raw("speculators-glm-5.2-gated-1pn.constructed.json")
    del d["draft_vocab_size"]
    assert parse(d).draft_vocab_size == 32000


# ---------------------------------------------------------------- refused by name
def test_unknown_dspark_architecture_is_refused_by_name():
    problems = refused(raw("specforge-kimi-k3-dspark-5mla.json"))
    assert len(problems) == 1
    assert "KimiK3DSpark5MLADraftModel" in problems[0] and "K3DSparkModel" in problems[0]


def test_causal_block_export_is_refused_by_name():
    problems = refused(raw("specforge-qwen3-8b-dspark-causal-noconf-b16.json"))
    assert problems == [p for p in problems if p.startswith("is_causal: true")]


def test_specforge_name_on_another_backbone_is_refused():
    d = k3_dict()
    d["model_type"] = "deepseek_v4"
    assert "model_type: got 'deepseek_v4'" in only(refused(d), "model_type")
    d = k3_dict()
    d["kv_lora_rank"] = 512
    assert "MLA" in only(refused(d), "kv_lora_rank")


def test_other_speculators_algorithms_are_refused():
    d = raw("speculators-qwen3.6-35b-a3b.json")
    d["speculators_model_type"] = "eagle3"
    assert "speculators_model_type: got 'eagle3'" in refused(d)[0]


def test_gemma4_counts_without_the_qwen3_checks():
    cfg = parse(raw("deepspec-gemma4.constructed.json"))
    assert cfg.backbone == "gemma4" and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.head_dim == 512 and cfg.num_key_value_heads == 2  # global heads, shared K/V projection
    assert cfg.gemma4 is not None and cfg.gemma4.shared_kv_projection
    with pytest.raises(ValueError, match="Gemma4DSparkModel"):
        cfg.to_hf_dict()


def test_sliding_window_mixed_across_layers_is_refused():
    d = raw("speculators-qwen3.6-35b-a3b.json")
    d["transformer_layer_config"]["layer_types"][0] = "full_attention"
    assert "mixes sliding and full attention" in only(refused(d), "layer_types")


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("name", ["specforge-qwen3-8b-dspark-draftvocab32k.json", "speculators-qwen3.6-35b-a3b.json"])
def test_to_hf_dict_keeps_draft_vocab_and_window(name):
    cfg = parse(raw(name))
    again = DSparkConfig.from_dict(json.loads(json.dumps(cfg.to_hf_dict())))
    assert again.family == "specforge"  # SpecForge's export format, whatever family it came from
    assert again.replace(family=cfg.family, architecture=cfg.architecture) == cfg


def test_yarn_without_original_context_takes_max_position_embeddings():
    # Hugging Face's standardize_rope_params: absent, original_max_position_embeddings = max_position_embeddings.
    d = k3_dict()
    del d["rope_parameters"]["original_max_position_embeddings"]
    assert parse(d).rope_scaling["original_max_position_embeddings"] == d["max_position_embeddings"]


@pytest.mark.parametrize("key,value,needle", [
    ("partial_rotary_factor", 0.5, "rope_parameters.partial_rotary_factor"),
    ("truncate", "no", "rope_parameters.truncate"),
    ("mscale", -1, "rope_parameters.mscale"),
    ("low_freq_factor", 1.0, "low_freq_factor"),
])
def test_yarn_keys_the_rope_cannot_apply_are_refused_by_name(key, value, needle):
    d = k3_dict()
    d["rope_parameters"][key] = value
    assert needle in only(refused(d), needle)


def test_yarn_mscale_keys_and_truncate_are_accepted():
    d = k3_dict()
    d["rope_parameters"].update(mscale=1.0, mscale_all_dim=1.0, truncate=False)
    assert parse(d).rope_scaling["truncate"] is False


# ---------------------------------------------------------------- parameter counts
def _qwen3_layer_params(h, heads, kvh, hd, inter):
    return h * heads * hd * 2 + h * kvh * hd * 2 + 2 * hd + 3 * h * inter + 2 * h


def test_k3_count_stays_the_model_card_number():
    assert count_parameters(DSparkConfig.from_json(K3_CONFIG)) == K3_PARAMS == 2_249_289_601


@pytest.mark.parametrize("cfg", [DSparkConfig.from_json(K3_CONFIG), DSparkConfig.from_json(QWEN3_CONFIG),
                                 parse(raw("specforge-glm-5.2-dspark.json"))], ids=["k3", "qwen3", "glm"])
def test_shapes_table_equals_the_reference_model(cfg):
    from vllm_dspark.model.reference import expected_tensor_shapes

    assert required_shapes(cfg) == expected_tensor_shapes(cfg)


def test_deepspec_count_excludes_its_embedding_and_head_copies():
    cfg = parse(_deepspec_flat())
    h, r, v = 2560, 256, 151936
    want = 5 * _qwen3_layer_params(h, 32, 8, 128, 9728) + h * 5 * h + 2 * h + 2 * v * r + (h + r + 1)
    assert count_parameters(cfg) == want == 615_221_249


def test_draft_vocab_count_has_its_own_lm_head_and_a_smaller_w2():
    full = parse({**raw("specforge-qwen3-8b-dspark-draftvocab32k.json"), "draft_vocab_size": None})
    small = parse(raw("specforge-qwen3-8b-dspark-draftvocab32k.json"))
    h, r, v, vd = 4096, 256, 151936, 32000
    assert count_parameters(full) == 1_126_422_017
    assert count_parameters(small) == count_parameters(full) - (v - vd) * r + vd * h


@pytest.mark.parametrize("head,extra", [("gated", lambda h, r: r * (h + r) + r),
                                        ("rnn", lambda h, r: 3 * r * (2 * r + h) + 3 * r)])
def test_gated_and_rnn_heads_add_their_projection(head, extra):
    d = raw("speculators-glm-5.2-gated-1pn.constructed.json")
    d["markov_head_type"] = "vanilla"
    vanilla = count_parameters(parse(d))
    d["markov_head_type"] = head
    assert count_parameters(parse(d)) - vanilla == extra(6144, 256)


def test_gemma4_count():
    cfg = parse(raw("deepspec-gemma4.constructed.json"))
    h, heads, kvh, ghd, inter, v, r = 2304, 8, 2, 512, 9216, 262144, 256
    layer = h * heads * ghd * 2 + h * kvh * ghd + 2 * ghd + 3 * h * inter + 4 * h  # no v_proj: k_eq_v
    want = 5 * layer + h * 5 * h + 2 * h + 2 * v * r + (h + r + 1)
    assert count_parameters(cfg) == want


def test_k3_mla_count_and_kv_bytes():
    cfg = parse(raw("k3-mla-dspark.constructed.json"))
    h, heads, ql, kl, nope, rope, vd, inter, v, r = 7168, 64, 1536, 512, 128, 64, 128, 14336, 163840, 256
    attn = ql * h + ql + heads * (nope + rope) * ql + (kl + rope) * h + kl + heads * (nope + vd) * kl + h * heads * vd
    layer = attn + 3 * h * inter + 2 * h
    want = 5 * layer + h * 5 * 7168 + 2 * h + 2 * v * r + (h + r + 1)
    assert count_parameters(cfg) == want
    assert cfg.kv_cache_bytes_per_token() == 5 * (512 + 64) * 2 == 5760
    assert DSparkConfig.from_json(K3_CONFIG).kv_cache_bytes_per_token() == 20480


def test_mla_output_gate_adds_g_proj():
    d = raw("k3-mla-dspark.constructed.json")
    base = count_parameters(parse(d))
    d["mla_use_output_gate"] = True
    assert count_parameters(parse(d)) - base == 5 * 64 * 128 * 7168  # g_proj [heads * v_head_dim, H] per layer
