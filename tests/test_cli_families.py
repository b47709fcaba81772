"""`vllm-dspark inspect` and `plan` on every checkpoint family: the family, the draft vocabulary, the head,
the layout and the drafts are printed; other backbones are counted and their KV cache sized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import K3_CONFIG, K3_PARAMS
from vllm_dspark.tools import cli

FAMILIES_DIR = Path(__file__).resolve().parent / "fixtures" / "families"
K3_MLA = FAMILIES_DIR / "k3-mla-dspark.constructed.json"
GATED = FAMILIES_DIR / "speculators-glm-5.2-gated-1pn.constructed.json"


def inspect_json(capsys, path: Path) -> tuple[int, dict]:
    rc = cli.main(["inspect", str(path), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_inspect_names_family_vocabulary_head_layout_and_drafts(capsys):
    rc, info = inspect_json(capsys, GATED)
    assert rc == 0, info["problems"]
    assert (info["family"], info["architecture"], info["backbone"]) == ("speculators", "DSparkDraftModel", "qwen3")
    assert info["draft_vocab_size"] == 32000 and info["markov_head_type"] == "gated"
    assert info["query_layout"] == "one_plus_n" and info["draft_tokens_per_step"] == 7
    assert info["vllm_aux_layer_ids"] == [2, 20, 39, 58, 77]
    assert info["v1_serving"] == []  # a speculators draft vocabulary and a gated head: served on V1
    cli.main(["inspect", str(GATED)])
    text = capsys.readouterr().out
    for needle in ("family          speculators", "draft vocabulary 32000", "rank 256 (gated)", "1 + N", "7 drafts",
                   "V1 runner       serves it"):
        assert needle in text, text


def test_inspect_counts_the_mla_drafter_and_names_what_serves_it(capsys):
    rc, info = inspect_json(capsys, K3_MLA)
    assert rc == 0, info["problems"]
    assert info["family"] == "other_backbone" and info["architecture"] == "K3DSparkModel"
    assert info["backbone"] == "mla" and info["kv_cache_bytes_per_token"] == 5760
    assert info["parameters"] == 2_387_907_841
    assert len(info["v1_serving"]) == 1 and "K3DSparkModel" in info["v1_serving"][0]


def test_inspect_keeps_the_k3_model_card_number(capsys):
    rc, info = inspect_json(capsys, K3_CONFIG)
    assert rc == 0 and info["parameters"] == K3_PARAMS and info["family"] == "specforge"
    assert info["v1_serving"] == []


def test_inspect_refuses_an_unknown_architecture_by_name(capsys):
    rc, info = inspect_json(capsys, FAMILIES_DIR / "specforge-kimi-k3-dspark-5mla.json")
    assert rc == 1 and "KimiK3DSpark5MLADraftModel" in info["problems"][0]


@pytest.mark.parametrize("draft,per_token", [(K3_MLA, 5_760), (None, 20_480)], ids=["mla", "gqa"])
def test_plan_sizes_the_mla_drafter_cache_from_its_latent(capsys, draft, per_token):
    args = ["plan", "--context", "65536", "--tp", "8", "--json"] + (["--draft", str(draft)] if draft else [])
    rc = cli.main(args)
    p = json.loads(capsys.readouterr().out)
    assert rc == 0, p["problems"]
    d = p["drafter"]
    assert d["kv_bytes_per_token"] == per_token
    if draft is K3_MLA:
        # One latent per token and layer, read by every head: TP does not split it.
        assert d["kv_bytes_per_token_per_gpu"] == per_token and d["mla_values_per_token_per_layer"] == 512 + 64
        assert any("kv_lora_rank + qk_rope_head_dim" in line for line in p["explanation"])
