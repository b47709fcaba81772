"""DeepSpec and speculators checkpoints on the V1 runner, without an engine: how vLLM is shown their config,
under which names their tensors load, and what becomes of a full-vocabulary ``embed_tokens`` / ``lm_head``
copy (dropped when equal to the target's, kept as the drafter's own when not).

The tiny layouts are re-saved from one SpecForge-layout drafter by ``tools/tiny_pair.py``'s converters;
the engine tests serving them are ``test_engine_family_*.py``.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.helpers import tiny_pair
from tests.tiny_pair import TOKEN_IDS, to_deepspec_layout, to_speculators_layout
from vllm_dspark.checkpoint.io import validate_checkpoint
from vllm_dspark.config import DSparkConfig

VOCAB = 384


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    pair = tiny_pair(root, vocab=VOCAB, seed=3, target={"num_layers": 4},
                     drafter={"block_size": 5, "markov_rank": 16, "target_layer_ids": (0, 2)}, backbone_scale=0.05)
    ids = torch.unique(torch.cat([pair.bigram, torch.tensor([TOKEN_IDS["eos"]])]))
    return types.SimpleNamespace(
        pair=pair, ids=ids,
        deepspec=to_deepspec_layout(pair.draft, root / "deepspec", target=pair.target),
        speculators=to_speculators_layout(pair.draft, root / "spec", target=pair.target, draft_ids=ids,
                                          sample_from_anchor=False))


def stored_names(path) -> list[str]:
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        return list(f.keys())  # noqa: SIM118 (a safetensors handle, not a dict)


# ---------------------------------------------------------------- the converters write valid checkpoints
def test_converted_layouts_validate_as_their_families(layouts):
    for path, family in ((layouts.deepspec, "deepspec"), (layouts.speculators, "speculators")):
        report = validate_checkpoint(path)
        assert report.ok, report.problems
        assert report.config is not None and report.config.family == family
    spec = DSparkConfig.from_json(layouts.speculators)
    assert spec.draft_vocab_size == layouts.ids.numel() < VOCAB
    assert (spec.query_layout, spec.num_draft_tokens) == ("one_plus_n", 4)  # sample_from_anchor absent: false
    assert spec.target_layer_ids == layouts.pair.config.target_layer_ids  # aux ids - 1
    deepspec = DSparkConfig.from_json(layouts.deepspec)
    assert deepspec.replace(family="specforge", architecture="DSparkDraftModel") == layouts.pair.config


# ---------------------------------------------------------------- how vLLM is shown the config
@pytest.mark.parametrize("layout", ["deepspec", "speculators"])
def test_a_family_config_is_presented_to_vllm_as_a_specforge_export(layouts, layout):
    from vllm_dspark.patch.config_speculative import specforge_hf_config

    cfg = DSparkConfig.from_json(getattr(layouts, layout))
    hf = specforge_hf_config(cfg)
    assert hf.architectures == ["DFlashDSparkDraftModel"]  # this plugin's V1 model, whatever the file said
    dc = hf.dflash_config
    # The runner taps dflash_config.target_layer_ids + 1: speculators' aux ids, DeepSpec's ids + 1.
    assert [i + 1 for i in dc["target_layer_ids"]] == list(cfg.vllm_aux_layer_ids)
    assert dc["mask_token_id"] == TOKEN_IDS["mask"] and dc["markov_rank"] == cfg.markov_rank
    assert dc.get("sample_from_anchor", True) == cfg.sample_from_anchor
    assert getattr(hf, "draft_vocab_size", None) == cfg.draft_vocab_size
    assert (hf.hidden_size, hf.num_hidden_layers, hf.head_dim, hf.vocab_size) == (
        cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.vocab_size)


# ---------------------------------------------------------------- tensor names
def test_every_family_loads_under_the_specforge_names(layouts):
    from vllm_dspark.spec_decode.v1.model import loader_name

    specforge = set(stored_names(layouts.pair.draft))
    deepspec = {loader_name(n) for n in stored_names(layouts.deepspec)}
    assert deepspec == specforge | {"embed_tokens.weight", "lm_head.weight"}
    spec_names = stored_names(layouts.speculators)
    assert "t2d" in spec_names
    assert {loader_name(n) for n in spec_names} - {None} == specforge | {"embed_tokens.weight", "lm_head.weight",
                                                                         "d2t"}


@pytest.mark.parametrize("stored,loaded", [
    ("model.layers.0.self_attn.q_proj.weight", "layers.0.self_attn.q_proj.weight"),
    ("model.embed_tokens.weight", "embed_tokens.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("model.fc.weight", "fc.weight"),
    ("d2t", "d2t"),
    ("model.d2t", "d2t"),
    ("t2d", None),
    ("model.t2d", None),
    ("logit_head.markov_head.markov_w2.weight", "markov_head.markov_w2.weight"),
    ("logit_head.confidence_head.proj.bias", "confidence_head.proj.bias"),
    ("markov_head.gate_proj.weight", "markov_head.gate_proj.weight"),
])
def test_loader_name(stored, loaded):
    from vllm_dspark.spec_decode.v1.model import loader_name

    assert loader_name(stored) == loaded


def test_the_draft_vocabulary_tensors_are_sliced_and_mapped(layouts):
    from safetensors.torch import load_file

    src = load_file(str(layouts.pair.draft) + "/model.safetensors")
    out = load_file(str(layouts.speculators) + "/model.safetensors")
    ids, vd = layouts.ids, layouts.ids.numel()
    assert torch.equal(torch.arange(vd) + out["d2t"], ids)  # offsets: target id = draft id + d2t[draft id]
    assert torch.equal(out["t2d"].nonzero().flatten(), ids)
    assert torch.equal(out["markov_head.markov_w2.weight"], src["markov_head.markov_w2.weight"][ids])
    assert out["lm_head.weight"].shape == (vd, layouts.pair.config.hidden_size)
    assert torch.equal(out["markov_head.markov_w1.weight"], src["markov_head.markov_w1.weight"])  # target ids


def test_a_shifted_map_is_valid_but_wrong(layouts, tmp_path):
    bad = to_speculators_layout(layouts.pair.draft, tmp_path / "shifted", target=layouts.pair.target,
                                draft_ids=layouts.ids, shift=1)
    assert validate_checkpoint(bad).ok  # in range, one-to-one, t2d agrees: nothing to refuse at start-up
    from safetensors.torch import load_file

    d2t = load_file(str(bad / "model.safetensors"))["d2t"]
    assert torch.equal(torch.arange(layouts.ids.numel()) + d2t, torch.roll(layouts.ids, -1))


# ---------------------------------------------------------------- a full-vocabulary copy: dropped or kept
class _Head(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


class _Draft(torch.nn.Module):
    """What vLLM's proposer and ``vocab_tensor_notes`` read of ``DSparkV1DraftModel``."""

    has_own_lm_head = True
    has_own_embed_tokens = False

    def __init__(self, lm_head: torch.Tensor, draft_vocab: int | None = None):
        import weakref

        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = _Head(torch.zeros(8, 4))
        self.lm_head = _Head(lm_head)
        self.vocab_size = 8
        self.config = types.SimpleNamespace(draft_vocab_size=draft_vocab)
        self._vocab_copies = {"lm_head": weakref.ref(self.lm_head)}  # as load_weights records it

    def _vocab_modules(self):
        return {"embed_tokens": self.model.embed_tokens, "lm_head": self.lm_head}


def _load_model(draft: _Draft, target_head: torch.Tensor) -> torch.nn.Module:
    """vLLM's own LM-head step of the DFlash proposer's ``load_model`` (llm_base_proposer)."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    target = torch.nn.Module()
    target.model = torch.nn.Module()
    target.lm_head = _Head(target_head)
    proposer = types.SimpleNamespace(model=draft, vllm_config=types.SimpleNamespace(speculative_config=None),
                                     use_local_argmax_reduction=False)
    DFlashProposer._maybe_share_lm_head(proposer, target)
    return target


def test_an_lm_head_copy_equal_to_the_targets_is_dropped_and_said_so():
    from vllm_dspark.spec_decode.v1.model import vocab_tensor_notes

    head = torch.randn(8, 4)
    draft = _Draft(head.clone())
    target = _load_model(draft, head)
    assert draft.lm_head is target.lm_head  # the copy is gone: the target's is shared
    notes = vocab_tensor_notes(draft)
    assert notes[0] == "embed_tokens: not in the checkpoint, the target's is shared"
    assert notes[1].startswith("lm_head: the checkpoint's copy equals the target's") and "dropped" in notes[1]


def test_an_lm_head_that_differs_in_one_entry_is_the_drafters_own():
    from vllm_dspark.spec_decode.v1.model import vocab_tensor_notes

    head = torch.randn(8, 4)
    own = head.clone()
    own[3, 1] += 1e-3
    draft = _Draft(own)
    target = _load_model(draft, head)
    assert draft.lm_head is not target.lm_head and torch.equal(draft.lm_head.weight, own)
    assert vocab_tensor_notes(draft)[1] == ("lm_head: the checkpoint's [8 rows] differs from the target's, so it "
                                            "is the drafter's own and is used")


def test_a_draft_vocabulary_lm_head_is_kept():
    from vllm_dspark.spec_decode.v1.model import vocab_tensor_notes

    head = torch.randn(8, 4)
    draft = _Draft(head[:5].clone(), draft_vocab=5)  # its rows equal the target's, its shape does not
    target = _load_model(draft, head)
    assert draft.lm_head is not target.lm_head
    assert vocab_tensor_notes(draft)[1] == "lm_head: the drafter's own over its draft vocabulary (5 of 8 tokens), used"
