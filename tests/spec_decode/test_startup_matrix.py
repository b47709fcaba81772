"""Every published layout x vocabulary x Markov head through the start-up profile and one draft step,
below the engine.

A cell is a real ``VllmConfig`` (the plugin's config patch translates the checkpoint's family and
reads ``speculative_config['dspark']``), V1's real draft model class built and loaded by its own
``load_weights``, and a stand-in proposer holding what the start-up profile and a step's sources
read (block, drafts per block, the hidden-row buffer, no-op dummy runs): the profile's draft timing
then runs exactly as at start-up, and the step runs ``DSparkProposer._draft_model`` on the rows the
layout samples. The drafter is an exact oracle of the tiny target's bigram table
(``tests.helpers.family_draft``), so one step's drafts from zero backbone rows are the target's
greedy continuation, in target ids, through every vocabulary map and head.

Layouts: anchor-first (SpecForge's export) and 1 + N (``sample_from_anchor`` false: block 7, 6
drafts). Vocabularies: the target's, the checkpoint's own (``d2t``: SpecForge's draft-vocabulary
layout anchor-first, speculators' 1 + N), a serve-time ``draft_vocab`` from a frequency table.
"""

from __future__ import annotations

import contextlib
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import VOCAB, family_draft, tiny_pair
from tests.tiny_pair import TOKEN_IDS, bigram_chain, make_drafter, to_speculators_layout

LAYOUTS = ("anchor_first", "one_plus_n")
VOCABS = ("full", "checkpoint_d2t", "serve_draft_vocab")
HEADS = ("vanilla", "gated", "rnn")
MAX_SEQS = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix_pair")
    return tiny_pair(root, seed=3, target={"arch": "qwen3", "num_layers": 2},
                     drafter={"block_size": 7, "markov_rank": 64, "target_layer_ids": (0, 1)}).as_dict()


@pytest.fixture(scope="module")
def vllm_groups(tmp_path_factory):
    """vLLM's single-process groups (gloo), once for the module: the draft model's layers need them."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with contextlib.ExitStack() as cleanup:
        if not ps.model_parallel_is_initialized():
            root = tmp_path_factory.mktemp("matrix_dist")
            with set_current_vllm_config(VllmConfig()):
                ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                distributed_init_method=f"file://{root / 'dist'}")
                ps.initialize_model_parallel(1, 1)
            cleanup.callback(ps.destroy_distributed_environment)
            cleanup.callback(ps.destroy_model_parallel)
        yield


def _checkpoint(pair: dict, root: Path, layout: str, vocab: str, head: str) -> Path:
    if vocab == "checkpoint_d2t":
        if layout == "anchor_first":
            return family_draft(pair, root, "specforge-vocab", head=head)[0]
        return family_draft(pair, root, "speculators", head=head)[0]  # the 1 + N layout, as speculators ship it
    src = family_draft(pair, root, "specforge", head=head)[0]
    if layout == "anchor_first":
        return src
    from vllm_dspark.config import DSparkConfig

    cfg = DSparkConfig.from_json(src).replace(sample_from_anchor=False)
    return make_drafter(root / "one_plus_n", cfg, mode="oracle", bigram=pair["bigram"], seed=5)


def _frequency_table(pair: dict, root: Path) -> tuple[Path, int]:
    """A table ranking the bigram's ids (and end-of-sequence) first: a draft vocabulary that holds them."""
    from vllm_dspark.checkpoint.token_frequency import table_from_counts, write_frequency_table

    ids = torch.unique(torch.cat([pair["bigram"], torch.tensor([TOKEN_IDS["eos"]])]))
    counts = np.ones(VOCAB, dtype=np.int64)
    counts[ids.numpy()] = 1000
    path = write_frequency_table(root / "token_frequency.json",
                                 table_from_counts(counts.tolist(), vocab_size=VOCAB, source="the matrix test"))
    return path, int(ids.numel()) + 8


def _build(pair: dict, root: Path, layout: str, vocab: str, head: str):
    """The cell's VllmConfig and V1's draft model, loaded as vLLM's loader loads it."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    import vllm_dspark.plugin as plugin
    from vllm_dspark.spec_decode.v1.model import DSparkV1DraftModel

    plugin.register()
    draft = _checkpoint(pair, root, layout, vocab, head)
    dspark: dict = {}
    if vocab == "serve_draft_vocab":
        table, size = _frequency_table(pair, root)
        dspark = {"draft_vocab": size, "draft_vocab_table": str(table)}
    vc = EngineArgs(model=pair["target"], dtype="float32", max_model_len=256, enforce_eager=True,
                    max_num_seqs=MAX_SEQS, max_num_batched_tokens=256, seed=0,
                    speculative_config={"method": "dspark", "model": str(draft), "dspark": dspark}
                    ).create_engine_config()
    tensors = load_file(str(draft / "model.safetensors"))
    with set_current_vllm_config(vc):
        model = DSparkV1DraftModel(vllm_config=vc, prefix="draft")
        model.load_weights(tensors.items())
        if "lm_head.weight" not in tensors:  # upstream's load_model shares the target's LM head
            with torch.no_grad():
                model.lm_head.weight.copy_(load_file(str(Path(pair["target"]) / "model.safetensors"))["lm_head.weight"])
        process_weights_after_loading(model, vc.speculative_config.draft_model_config, torch.device("cpu"))
    return vc, model.eval()


def _stand_in(vc, model):
    """What the start-up profile and ``_draft_model`` read off the proposer, and nothing else."""
    from vllm_dspark.serving.settings import settings_of
    from vllm_dspark.spec_decode.v1.proposer import DSparkProposer

    s = settings_of(vc.speculative_config.draft_model_config.hf_config)
    dummy_runs: list[int] = []
    p = types.SimpleNamespace(
        vllm_config=vc, settings=s, model=model, block=s.block_size, n_draft=s.num_draft_tokens,
        hidden_states=torch.randn(MAX_SEQS * s.block_size, model.config.hidden_size),
        dummy_run=lambda n, use_cudagraphs=True: dummy_runs.append(n),
        runner=types.SimpleNamespace(_dummy_run=lambda n, force_attention=False: (torch.zeros(n, 4),) * 2,
                                     model=types.SimpleNamespace(compute_logits=lambda hidden: hidden)),
        _stage=None, _stage_src=None, _lap=lambda part, since: time.perf_counter(), dummy_runs=dummy_runs)
    p.markov_stage = DSparkProposer.markov_stage.fget(p)
    return p, s


CELLS = [(layout, vocab, head) for layout in LAYOUTS for vocab in VOCABS for head in HEADS]


@pytest.mark.parametrize(("layout", "vocab", "head"), CELLS, ids=["-".join(c) for c in CELLS])
def test_the_cell_profiles_and_drafts_the_targets_continuation(pair, vllm_groups, tmp_path, layout, vocab, head):
    from vllm_dspark.spec_decode.common import profile
    from vllm_dspark.spec_decode.common.budget import Plan, PlanMode
    from vllm_dspark.spec_decode.v1.proposer import DSparkProposer
    from vllm_dspark.spec_decode.v1.step_state import Decision

    vc, model = _build(pair, tmp_path, layout, vocab, head)
    p, s = _stand_in(vc, model)
    block, n = s.block_size, s.num_draft_tokens
    assert (s.query_layout, block, n) == (layout, 7, 7 if layout == "anchor_first" else 6)
    want_vocab = {"full": None, "checkpoint_d2t": "checkpoint", "serve_draft_vocab": "serve"}[vocab]
    has_d2t = model.markov.d2t is not None
    assert has_d2t == (want_vocab is not None) and (model.draft_ids is not None) == (want_vocab == "serve")
    assert p.markov_stage.head.kind == head

    # The start-up profile's draft timing, as on_engine_ready runs it (the verify side is a no-op here).
    costs = profile.profile(p)
    assert [r for r, _ in costs.draft] == [1, 2, 4] and all(t > 0 for _, t in costs.draft)
    assert p.dummy_runs and set(p.dummy_runs) == {r * block for r in (1, 2, 4)}

    # One draft step: three requests, the rows the layout samples (zero backbone rows: the oracle's
    # drafts are its Markov table's, the target's greedy chain).
    anchors = torch.tensor([5, 77, 140])
    rows = torch.zeros(len(anchors) * n, model.config.hidden_size)
    d = Decision(t1=0.0, batch=len(anchors), req_ids=["a", "b", "c"], cap=n, caps=[n] * 3,
                 sampled=np.zeros(3, dtype=bool), plan=Plan(PlanMode.DRAFT))
    meta = types.SimpleNamespace(temperature=None, top_k=None, top_p=None)
    drafts = DSparkProposer._draft_model(p, d, rows, anchors, meta, None)
    assert drafts.path == "compiled", drafts.path  # the op, not the reference fallback
    want = [bigram_chain(pair["bigram"], int(a), n) for a in anchors]
    assert drafts.tokens.tolist() == want


def test_a_speculators_one_plus_n_d2t_checkpoint_used_to_crash_the_profile(pair, vllm_groups, tmp_path):
    """The reported crash, kept as its own case: block 7, 6 drafts, a d2t draft vocabulary. The profile took
    the block's 7 rows per request where the layout drafts from 6 and failed to reshape the logits."""
    from vllm_dspark.spec_decode.common import profile

    vc, model = _build(pair, tmp_path, "one_plus_n", "checkpoint_d2t", "vanilla")
    p, s = _stand_in(vc, model)
    assert s.block_size - s.num_draft_tokens == 1 and model.markov.d2t is not None
    profile._draft_fn(p, 2)()  # RuntimeError: shape '[2, 6, Vd]' is invalid ... before the fix


def test_a_speculators_layout_built_here_is_what_speculators_ships(pair, tmp_path):
    """The 1 + N d2t cells use tiny_pair's converter: its config says what a speculators checkpoint says."""
    import json

    src = family_draft(pair, tmp_path, "specforge")[0]
    ids = torch.unique(torch.cat([pair["bigram"], torch.tensor([TOKEN_IDS["eos"]])]))
    out = to_speculators_layout(src, tmp_path / "spec", target=pair["target"], draft_ids=ids, sample_from_anchor=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and "sample_from_anchor" not in cfg
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 6
