"""The V2 hook against vLLM 0.33.0's own ``DSparkSpeculator._sample_sequential``, on the CPU.

``tests/spec_decode/test_model_v2.py`` drives the hook with a hand-written
stand-in for upstream's speculator. This file runs upstream's code itself. The
vLLM 0.33.0 sdist is downloaded from PyPI once (``tests.upstream``:
sha256 from PyPI's JSON checked, atomic write, cached under
``vllm_dspark.cache.cache_dir()/upstream``) and the files below are executed
straight out of the tarball as private modules (``_vllm033.vllm....``): nothing
of vLLM 0.33 is installed or copied into this repository, and the installed
vLLM (0.32, CPU build) is not modified. Without network access (and no cached
copy) every test here skips, saying why.

Executed from the 0.33.0 sdist
    * ``vllm/v1/worker/gpu/spec_decode/dspark/speculator.py``: ``DSparkSpeculator``
      with its real ``__init__``, ``load_draft_model``, ``_sample_sequential``
      (the hook call, then the dense per-position loop) and ``_sample_logits``;
    * ``.../spec_decode/dflash/speculator.py``: ``DFlashSpeculator.__init__``
      (the sample buffers) and ``prepare_dflash_inputs``, whose Triton kernel
      writes the anchors, mask tokens, ``sample_indices`` / ``sample_pos`` /
      ``sample_idx_mapping`` and per-state temperature/seeds as in serving;
    * ``.../spec_decode/speculator.py``: ``DraftModelSpeculator.__init__``,
      ``load_model``, ``_maybe_predict_acceptance``;
    * ``vllm/v1/worker/gpu/sample/gumbel.py``: ``gumbel_sample`` (probabilistic
      drafting: Gumbel-max draw and the draft-logits cache write);
    * ``vllm/v1/worker/gpu/cp_utils.py``: ``cp_local_slot`` (for the prepare kernel);
    * ``vllm/model_executor/models/qwen3_dspark.py``: ``Qwen3DSparkForCausalLM``,
      the plain upstream draft model of run (a).

    Every other import in these files resolves to the installed vLLM 0.32.
    Mostly those are names only (annotations, base classes whose methods do not
    run). The installed code the path does execute is pinned byte for byte to
    0.33.0's source by ``test_installed_code_on_the_path_is_0_33s`` (``SAME_AS_0_33``):
    qwen3_dspark.py (b's base class), logits_processor.py, ``InputBuffers``,
    ``get_parallel_drafting_token_id``, ``get_eagle3_aux_layers_from_config``,
    ``dflash_has_any_non_causal``. Not pinned, and different in 0.33.0 in ways
    the CPU path does not reach: ``ParallelLMHead`` (0.33 adds an optional
    ``quant_method`` argument), ``ReplicatedLinear`` (ROCm padding, online FP8),
    the DFlash backbone base class (not run), and the config objects (0.32's).

Stubs (each replaces an import that can't work on a CPU; nothing else)
    * ``vllm.triton_utils`` -> ``real_triton_utils()``: vLLM 0.32's CPU build hands
      out placeholders for ``triton``/``tl`` when no GPU driver is active, so
      upstream's ``@triton.jit`` kernels could not even be defined. The stub
      exposes the real ``triton`` and ``triton.language``; the three files with
      kernels (gumbel, dflash speculator, cp_utils) are executed with
      ``TRITON_INTERPRET=1``, so upstream's kernel source runs in Triton's CPU
      interpreter. ``triton_interpreter_fixes()`` closes two interpreter gaps
      the kernels hit (helpers jitted before the variable was set, integer
      masks from ``block_mask & scalar_flag``); see its docstring.

Test doubles (attributes, not imports)
    * ``load_dspark_model``, read by upstream's ``load_draft_model``, is replaced
      in the private module by a function returning the already-built draft
      model: upstream's builds it with vLLM's model loader from a live target
      model, which needs an engine. Upstream's ``load_draft_model`` and
      ``load_model`` bodies still run (``use_confidence_head``, the estimator
      switch).
    * ``enable_adaptive_verification`` (what makes upstream use the confidence
      head) and ``draft_sample_method`` are set on the speculative config just
      for the speculator's construction: 0.32's config check refuses adaptive
      verification for its V1 runner.
    * In ``test_probabilistic_teacher_forced`` only, speculator (a) gets a
      ``draft_watermarker`` whose ``sample`` calls upstream's own
      ``gumbel_sample`` (which writes the logits cache) and then returns the
      hook's token for that step: upstream's loop computes its q on the hook's
      prefix.

The draft models (the project's)
    A tiny Qwen3 target and a SpecForge-layout DSpark drafter from
    ``tests.tiny_pair`` (the confidence head's hidden weights scaled
    down so confidences stay off the sigmoid's flat ends, and without
    ``dflash_config.sample_from_anchor``: see below). (b) is the project's
    ``DSparkV2DraftModel`` built by ``model_v2._build_class()``, the class the
    plugin registers, constructed and loaded by its own ``__init__`` and
    ``load_weights`` (so ``_prepare_markov`` ran) on a real ``VllmConfig``, in
    vLLM's single-process gloo groups, then ``process_weights_after_loading``
    as vLLM's loader does. (a) is the sdist's ``Qwen3DSparkForCausalLM``, same
    weights. The checkpoint has no LM head: upstream's loader shares the
    target's, here it is copied in. (a) is built second and reads the DSpark
    keys (``markov_rank`` ...) that (b)'s constructor exposed on the shared HF
    config (upstream 0.33 reads only top-level keys; SpecForge nests them).
    The backbone does not run: ``head_hidden`` (its output, all the sequential
    stage reads of it) is random.

What is compared (batch sizes 1, 3, 8; 3 real requests in 5 CUDA-graph rows)
    * the hook fired: ``sample_sequential`` returned True, ``run_markov_stage``
      ran with the compiled op (its default), and upstream's loop never called
      (b)'s ``markov_embed``, while (a)'s loop called it N times;
    * greedy: draft tokens equal exactly; confidences within 1e-5 abs / 1e-5 rel
      (fp32 throughout; only the summation order differs);
    * probabilistic (fp32 logits cache, per-request temperatures, fixed seeds):
      tokens are NOT comparable draw for draw: the op takes its Gumbel noise
      from its own hash of (seed XOR anchor position << 32, block position,
      token), upstream from murmur3 of (seed XOR step << 32, position + salt,
      token), so the same seeds give different, equally distributed tokens.
      Compared instead: with upstream's loop forced onto the hook's tokens, the
      cached proposal q at every (state, step) within 1e-4 abs / 1e-5 rel, the
      confidences within 1e-5 and every other cache slot untouched; and, in an
      unforced upstream run, the states at temperature 1e-3 draw the same
      tokens and q (a per-state temperature read from the wrong slot fails it);
    * with ``VLLM_DSPARK_CONFIDENCE_THRESHOLD`` set (a V1-only knob) the V2 hook
      warns and still drafts all N positions, equal to upstream's.

Found and fixed: a blocker outside the hook
    vLLM 0.33.0's ``DFlashSpeculator.__init__`` (which ``DSparkSpeculator``'s runs
    first) raises ``ValueError: sample_from_anchor=True is not supported for
    DFlash`` when the draft's ``dflash_config`` has ``sample_from_anchor: true``,
    which ``DSparkConfig.to_hf_dict`` used to write into every export.
    It now writes the key only where it differs from what ``projector_type``
    implies, as SpecForge's exports do (``tests/fixtures/qwen3-8b-dspark.config.json``);
    ``test_project_export_dflash_config_is_accepted_by_upstream_speculator`` checks it.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.upstream import (
    Sdist,
    UpstreamModules,
    UpstreamUnavailable,
    fetch_sdist,
    module_path,
    real_triton_utils,
    triton_interpreter_fixes,
)
from vllm_dspark.spec_decode.v2 import model as model_v2

VERSION = "0.33.0"
M_DSPARK = "vllm.v1.worker.gpu.spec_decode.dspark.speculator"
M_DFLASH = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"
M_BASE = "vllm.v1.worker.gpu.spec_decode.speculator"
M_GUMBEL = "vllm.v1.worker.gpu.sample.gumbel"
M_CP = "vllm.v1.worker.gpu.cp_utils"
M_MODEL = "vllm.model_executor.models.qwen3_dspark"
FROM_SDIST = (M_DSPARK, M_DFLASH, M_BASE, M_GUMBEL, M_CP, M_MODEL)
INTERPRETED = (M_GUMBEL, M_DFLASH, M_CP)
# Installed (vLLM 0.32) code that the tested path executes, pinned to 0.33.0's source (None: the whole file).
SAME_AS_0_33 = (
    ("vllm.model_executor.models.qwen3_dspark", None),  # (b)'s base class
    ("vllm.model_executor.layers.logits_processor", None),  # compute_draft_logits, markov_bias
    ("vllm.v1.worker.gpu.input_batch", "InputBuffers"),  # DraftModelSpeculator.__init__
    ("vllm.v1.worker.gpu.spec_decode.utils", "get_parallel_drafting_token_id"),  # DFlashSpeculator.__init__
    ("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils", "get_eagle3_aux_layers_from_config"),  # same
    ("vllm.model_executor.models.qwen3_dflash", "dflash_has_any_non_causal"),  # same
)

N = 7  # num_speculative_tokens = the drafter's block size
VOCAB, HIDDEN, RANK = 384, 128, 16
MAX_REQS, MAX_TOKENS, MAX_LEN, BLOCK = 8, 256, 512, 16
CONF_TOL = dict(atol=1e-5, rtol=1e-5)
LOGITS_TOL = dict(atol=1e-4, rtol=1e-5)


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def upstream():
    try:
        path = fetch_sdist("vllm", VERSION)
    except UpstreamUnavailable as exc:
        pytest.skip(f"vLLM {VERSION}'s sdist could not be fetched from PyPI (no network?): {exc}")
    sdist = Sdist(path)
    sdist.read_many([module_path(m) for m in FROM_SDIST] + [module_path(m) for m, _ in SAME_AS_0_33])  # one pass
    mods = UpstreamModules(sdist, FROM_SDIST, stubs={"vllm.triton_utils": real_triton_utils()},
                           interpret_triton=INTERPRETED, prefix="_vllm033")
    for name in FROM_SDIST:
        mods.load(name)
    with triton_interpreter_fixes():
        yield mods
    mods.close()


@pytest.fixture(scope="module")
def stack(upstream, tmp_path_factory):
    """A real VllmConfig, vLLM's single-process groups, and the two draft models (b: hooked, a: plain)."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from tests.helpers import tiny_pair

    pair = tiny_pair(tmp_path_factory.mktemp("v2_upstream"), vocab=VOCAB, bigram_target=False, mode="random",
                     target={"hidden_size": HIDDEN, "num_layers": 2}, drafter={"block_size": N, "markov_rank": RANK},
                     draft_name="drafter", draft_seed=1, scale=0.3)
    root, target, config, drafter = pair.root, Path(pair.target), pair.config, Path(pair.draft)
    # Served exactly as exported: vLLM 0.33.0's speculator would refuse dflash_config.sample_from_anchor.
    assert "sample_from_anchor" not in json.loads((drafter / "config.json").read_text())["dflash_config"]
    vc = EngineArgs(model=str(target), dtype="float32", max_model_len=MAX_LEN, enforce_eager=True,
                    max_num_seqs=MAX_REQS, max_num_batched_tokens=MAX_TOKENS, seed=0,
                    speculative_config={"method": "dspark", "model": str(drafter),
                                        "num_speculative_tokens": N}).create_engine_config()
    draft_weights = load_file(str(drafter / "model.safetensors"))
    # Keep the confidences off the sigmoid's flat ends (head_hidden is O(3) per coordinate), so that a
    # confidence computed from the wrong previous token shows.
    draft_weights["confidence_head.proj.weight"][:, :HIDDEN] *= 0.05
    lm_head = load_file(str(target / "model.safetensors"))["lm_head.weight"]
    with contextlib.ExitStack() as cleanup:
        cleanup.enter_context(set_current_vllm_config(vc))
        if not ps.model_parallel_is_initialized():
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                            distributed_init_method=f"file://{root / 'dist'}")
            ps.initialize_model_parallel(1, 1)
            cleanup.callback(ps.destroy_distributed_environment)
            cleanup.callback(ps.destroy_model_parallel)

        def build(cls, prefix):
            model = cls(vllm_config=vc, prefix=prefix)
            model.load_weights(draft_weights.items())
            with torch.no_grad():
                model.lm_head.weight.copy_(lm_head)  # upstream's loader shares the target's LM head
            # What vLLM's loader does next (on CPU: picks the GEMM for each linear / LM head).
            process_weights_after_loading(model, vc.speculative_config.draft_model_config, torch.device("cpu"))
            return model.eval()

        hooked = build(model_v2._build_class(), "hooked")  # exposes the DSpark keys on the shared HF config
        plain = build(upstream[M_MODEL].Qwen3DSparkForCausalLM, "upstream")
        yield SimpleNamespace(vc=vc, hooked=hooked, plain=plain, build=build, config=config)


def make_speculator(upstream, vc, model, monkeypatch, *, probabilistic: bool):
    """Upstream's DSparkSpeculator, built by its own __init__ and load_model around ``model``."""
    spec_cfg = vc.speculative_config
    with monkeypatch.context() as mp:
        mp.setattr(spec_cfg, "draft_sample_method", "probabilistic" if probabilistic else "greedy")
        # Adaptive verification is what makes upstream read the confidence head (vLLM 0.32's config
        # check refuses it for its V1 runner, so it is switched on here, for the speculator only).
        mp.setattr(spec_cfg, "enable_adaptive_verification", True)
        spec = upstream[M_DSPARK].DSparkSpeculator(vc, torch.device("cpu"))
        # Test double: upstream's load_dspark_model builds the model via vLLM's loader from a live target.
        mp.setitem(upstream[M_DSPARK].__dict__, "load_dspark_model", lambda target_model, vllm_config: model)
        spec.load_model(None)
    assert spec.model is model and spec.use_confidence_head and spec.acceptance_estimator is None
    assert (spec.draft_logits is not None) == probabilistic
    return spec


def prepare_inputs(upstream, spec, *, states, seed, temperature=None):
    """Fill ``spec``'s inputs with upstream's ``prepare_dflash_inputs`` for a decode step of ``states``.

    Each request had ``num_ctx`` tokens verified by the target this step, of
    which ``num_rejected`` were rejected; its bonus token (the anchor) is
    ``last_sampled[state]``. Returns what was given per state slot.
    """
    g = torch.Generator().manual_seed(seed)
    R, max_reqs, max_tokens, max_len = len(states), spec.max_num_reqs, spec.max_num_tokens, spec.max_model_len
    num_ctx = torch.randint(1, N + 2, (R,), generator=g)
    num_rejected = (torch.rand(R, generator=g) * num_ctx).long().clamp(max=num_ctx - 1)
    prefix = torch.randint(N + 2, max_len - 2 * N - 2, (R,), generator=g)
    positions = torch.cat([p - c + torch.arange(c) for p, c in zip(prefix.tolist(), num_ctx.tolist())])
    qsl = torch.zeros(R + 1, dtype=torch.int32)
    qsl[1:] = num_ctx.cumsum(0)
    batch = SimpleNamespace(num_reqs=R, num_scheduled_tokens=num_ctx.numpy().astype(np.int32), positions=positions,
                            query_start_loc=qsl, idx_mapping=torch.tensor(states, dtype=torch.int32))
    given = SimpleNamespace(last_sampled=torch.randint(0, 256, (max_reqs,), generator=g),
                            temperature=torch.rand(max_reqs, generator=g) * 1.5 + 0.25,
                            seeds=torch.randint(0, 2**62, (max_reqs,), generator=g),
                            # the bonus token sits right after the last accepted context token
                            anchor_pos=positions[qsl[1:].long() - 1 - num_rejected] + 1)
    if temperature is not None:
        given.temperature = temperature
    num_blocks = max_len // BLOCK + 1
    block_table = torch.randperm(max_reqs * num_blocks, generator=g).view(max_reqs, num_blocks).int() + 1
    slots = [torch.zeros(max_tokens, dtype=torch.int64) for _ in range(3)]  # query slots, context positions/slots
    upstream[M_DFLASH].prepare_dflash_inputs(
        spec.input_buffers, *slots, spec.sample_indices, spec.sample_pos, spec.sample_idx_mapping,
        spec.temperature, spec.seeds, batch, torch.ones(R, dtype=torch.int32), num_rejected.int(),
        given.last_sampled, torch.zeros(max_reqs, dtype=torch.int64), given.temperature, given.seeds, block_table,
        BLOCK, 0, 1, 1, spec.parallel_drafting_token_id, spec.num_query_per_req, N, max_reqs, max_tokens, max_len,
        spec.sample_from_anchor, R)
    return given


class Spy:
    """Counts the calls a draft model gets from upstream's loop and from the hook."""

    def __init__(self, model, monkeypatch):
        self.embeds = 0
        self.hook_returns: list[bool] = []
        self.stage_ops: list[object] = []
        embed = model.markov_embed
        monkeypatch.setattr(model, "markov_embed", lambda ids: (self._count(), embed(ids))[1])
        hook = getattr(model, "sample_sequential", None)
        if hook is not None:
            def spied_hook(*args):
                self.hook_returns.append(hook(*args))
                return self.hook_returns[-1]

            monkeypatch.setattr(model, "sample_sequential", spied_hook)
            stage = model_v2.run_markov_stage

            def spied_stage(*args, **kwargs):
                self.stage_ops.append(kwargs.get("op"))
                return stage(*args, **kwargs)

            monkeypatch.setattr(model_v2, "run_markov_stage", spied_stage)

    def _count(self):
        self.embeds += 1


def run_both(upstream, stack, monkeypatch, *, states, num_reqs=None, probabilistic=False, seed=0, hooked=None):
    """Upstream's loop (a) and the hook (b) on identical inputs; returns both speculators and the spies."""
    num_reqs = num_reqs or len(states)
    specs, spies = [], []
    head_hidden = torch.randn(num_reqs * N + 3, HIDDEN, generator=torch.Generator().manual_seed(seed + 100)) * 3
    for model in (stack.plain, hooked or stack.hooked):
        spec = make_speculator(upstream, stack.vc, model, monkeypatch, probabilistic=probabilistic)
        given = prepare_inputs(upstream, spec, states=states, seed=seed)
        spy = Spy(model, monkeypatch)
        spec._sample_sequential(num_reqs, head_hidden)
        specs.append(spec)
        spies.append(spy)
    return specs, spies, head_hidden, given


def assert_paths(spies, calls=1):
    up, ours = spies
    assert up.embeds == N and not up.hook_returns  # (a): upstream's dense loop, N Markov steps
    assert ours.hook_returns == [True] * calls  # (b): the hook took the stage ...
    assert ours.stage_ops == [None] * calls  # ... on the compiled op (run_markov_stage's default op)
    assert ours.embeds == 0  # ... and upstream's loop never ran


# ------------------------------------------------------------------------------------------- tests
def test_only_the_named_files_come_from_the_sdist(upstream, stack):
    assert set(upstream.loaded) == set(FROM_SDIST)
    stubbed = {k for k, v in upstream.resolved.items() if v == "stub"}
    assert stubbed == {"vllm.triton_utils"}
    for name in INTERPRETED:  # their kernels run in Triton's interpreter
        mod = upstream[name]
        kernels = [v for v in vars(mod).values() if type(v).__name__ == "InterpretedFunction"]
        assert kernels, name
    assert all(type(v).__name__ != "InterpretedFunction" for v in vars(upstream[M_DSPARK]).values())
    assert upstream[M_DSPARK].DSparkSpeculator.__mro__[1] is upstream[M_DFLASH].DFlashSpeculator


@pytest.mark.parametrize("module,name", SAME_AS_0_33, ids=[f"{m.rsplit('.', 1)[1]}:{n}" for m, n in SAME_AS_0_33])
def test_installed_code_on_the_path_is_0_33s(upstream, module, name):
    """What the path runs from the installed vLLM 0.32 is byte-identical to 0.33.0's source."""
    theirs = upstream.sdist.read(module_path(module))
    installed = importlib.import_module(module)
    if name is None:
        ours = inspect.getsource(installed)
    else:
        ours = inspect.getsource(getattr(installed, name))
        node = next(n for n in ast.parse(theirs).body if getattr(n, "name", None) == name)
        theirs = "".join(theirs.splitlines(keepends=True)[node.lineno - 1 - len(node.decorator_list):node.end_lineno])
    assert ours == theirs, f"installed {module}{':' + name if name else ''} differs from vLLM {VERSION}'s"


def test_hooked_class_is_the_registered_class_on_upstream_model_code(stack):
    import vllm.model_executor.models.qwen3_dspark as installed

    assert type(stack.hooked).__name__ == "DSparkV2DraftModel"
    assert type(stack.hooked).__module__ == "vllm_dspark.spec_decode.v2.model"
    assert type(stack.hooked).__mro__[1] is installed.Qwen3DSparkForCausalLM  # pinned to 0.33.0 above
    assert stack.hooked._markov is not None and stack.hooked._markov_reason is None
    names = [n for n, _ in stack.plain.named_parameters() if "embed_tokens" not in n]  # (shared from the target)
    assert {"model.markov_head.markov_w1.weight", "model.confidence_head.proj.weight", "lm_head.weight"} <= set(names)
    for name in names:  # same weights in (a) and (b)
        p = stack.plain.get_parameter(name)
        torch.testing.assert_close(stack.hooked.get_parameter(name), p, atol=0, rtol=0)


@pytest.mark.parametrize("states", [[5], [3, 0, 6], [7, 2, 0, 4, 1, 6, 3, 5]], ids=["bs1", "bs3", "bs8"])
def test_greedy_equals_upstream_loop(upstream, stack, monkeypatch, states):
    (up, ours), spies, head_hidden, given = run_both(upstream, stack, monkeypatch, states=states, seed=len(states))
    assert_paths(spies)
    R = len(states)
    assert torch.equal(ours.draft_tokens[:R], up.draft_tokens[:R]), (ours.draft_tokens[:R], up.draft_tokens[:R])
    torch.testing.assert_close(ours.draft_token_confidence_probs[:R], up.draft_token_confidence_probs[:R], **CONF_TOL)
    # The inputs are what serving feeds: anchors = bonus tokens, sample_pos = anchor position + 1 + step.
    st = torch.tensor(states)
    assert torch.equal(up.input_buffers.input_ids[up._anchor_idx[:R]].long(), given.last_sampled[st])
    assert torch.equal(up.sample_pos[: R * N].view(R, N), given.anchor_pos[:, None] + 1 + torch.arange(N))
    assert torch.equal(up.sample_idx_mapping[: R * N].view(R, N), st[:, None].expand(R, N))
    # Not vacuous: the Markov stage changes some greedy token (bs>1), and the confidences vary.
    base = stack.plain.compute_draft_logits(head_hidden[up.sample_indices[: R * N]]).argmax(-1).view(R, N)
    assert R == 1 or not torch.equal(base, up.draft_tokens[:R])
    conf = up.draft_token_confidence_probs[:R]
    assert float(((conf > 0.02) & (conf < 0.98)).float().mean()) > 0.8


def test_greedy_with_cuda_graph_padding_rows(upstream, stack, monkeypatch):
    states = [4, 0, 2]
    (up, ours), spies, _, _ = run_both(upstream, stack, monkeypatch, states=states, num_reqs=5, seed=11)
    assert_paths(spies)
    assert up.sample_idx_mapping[3 * N: 5 * N].eq(-1).all()  # upstream's prepare kernel padded them
    assert torch.equal(ours.draft_tokens[:5], up.draft_tokens[:5])  # padded rows too (anchor 0, greedy)
    torch.testing.assert_close(ours.draft_token_confidence_probs[:5], up.draft_token_confidence_probs[:5], **CONF_TOL)


def test_threshold_env_does_not_truncate_v2_drafts(upstream, stack, monkeypatch, caplog):
    monkeypatch.setenv("VLLM_DSPARK_CONFIDENCE_THRESHOLD", "0.9")
    with caplog.at_level(logging.WARNING, logger="vllm_dspark"):
        thresholded = stack.build(model_v2._build_class(), "thresholded")
    warned = [r.getMessage() for r in caplog.records if "not applied on vLLM 0.33's V2 path" in r.getMessage()]
    assert len(warned) == 1 and "VLLM_DSPARK_CONFIDENCE_THRESHOLD" in warned[0], caplog.text
    states = [1, 6, 3]
    (up, ours), spies, _, _ = run_both(upstream, stack, monkeypatch, states=states, seed=21, hooked=thresholded)
    assert_paths(spies)
    assert bool((up.draft_token_confidence_probs[:3] < 0.9).any())  # the threshold would have cut somewhere
    assert torch.equal(ours.draft_tokens[:3], up.draft_tokens[:3])
    torch.testing.assert_close(ours.draft_token_confidence_probs[:3], up.draft_token_confidence_probs[:3], **CONF_TOL)


class ForcedDraws:
    """``draft_watermarker`` double for (a): upstream's gumbel_sample runs (and writes the cache); the hook's
    token is returned."""

    def __init__(self, gumbel_sample, forced):
        self.gumbel_sample, self.forced, self.upstream_draws = gumbel_sample, forced, []

    def sample(self, logits, idx_map, temperature, seeds, pos, **kwargs):
        self.upstream_draws.append(self.gumbel_sample(logits, idx_map, temperature, seeds, pos, **kwargs))
        step = int(kwargs["logits_cache_col"])
        return self.forced[: logits.shape[0], step].clone()


@pytest.mark.parametrize("states,num_reqs", [([2, 5, 0], 3), ([6, 1, 3, 7], 6)], ids=["bs3", "bs4-padded6"])
def test_probabilistic_teacher_forced(upstream, stack, monkeypatch, states, num_reqs):
    R = len(states)
    # (b): the hook samples with the op.
    ours = make_speculator(upstream, stack.vc, stack.hooked, monkeypatch, probabilistic=True)
    assert ours.draft_logits.dtype == torch.float32  # else the hook declines (see why_not_speculator)
    given = prepare_inputs(upstream, ours, states=states, seed=31 + R)
    spy = Spy(stack.hooked, monkeypatch)
    head_hidden = torch.randn(num_reqs * N + 3, HIDDEN, generator=torch.Generator().manual_seed(7)) * 3
    ours._sample_sequential(num_reqs, head_hidden)
    assert spy.hook_returns == [True] and spy.stage_ops == [None] and spy.embeds == 0
    # (a): upstream's loop, forced onto (b)'s tokens; its own gumbel_sample writes its cache.
    up = make_speculator(upstream, stack.vc, stack.plain, monkeypatch, probabilistic=True)
    prepare_inputs(upstream, up, states=states, seed=31 + R)
    forced = ForcedDraws(upstream[M_GUMBEL].gumbel_sample, ours.draft_tokens[:num_reqs].clone())
    up.draft_watermarker = forced
    up._sample_sequential(num_reqs, head_hidden)
    assert len(forced.upstream_draws) == N
    assert torch.equal(up.draft_tokens[:num_reqs], ours.draft_tokens[:num_reqs])
    torch.testing.assert_close(ours.draft_token_confidence_probs[:num_reqs],
                               up.draft_token_confidence_probs[:num_reqs], **CONF_TOL)
    # The proposal q the rejection sampler will read: equal at the live states, untouched elsewhere.
    torch.testing.assert_close(ours.draft_logits, up.draft_logits, **LOGITS_TOL)
    idle = sorted(set(range(MAX_REQS)) - set(states))
    assert bool((ours.draft_logits[idle] == 0).all())
    # Sampled, not greedy: with these temperatures some token differs from the argmax of q.
    q = ours.draft_logits[torch.tensor(states)]
    assert not torch.equal(q.argmax(-1), ours.draft_tokens[:R])
    assert bool((given.temperature[torch.tensor(states)] > 0.2).all())


def test_probabilistic_unforced_near_greedy_rows_match_upstream_draws(upstream, stack, monkeypatch):
    """Upstream's own sampled run, unforced. States at temperature 1e-3 draw (almost surely) the argmax in
    both samplers, so their tokens and cached q agree; the other states sample at temperature 1 and are free
    to differ. A hook reading another state's temperature would break the first group."""
    states, cold = [0, 3, 6, 1], [0, 6]
    temperature = torch.ones(MAX_REQS)
    temperature[cold] = 1e-3
    specs = []
    head_hidden = torch.randn(len(states) * N + 3, HIDDEN, generator=torch.Generator().manual_seed(9)) * 3
    for model in (stack.plain, stack.hooked):
        spec = make_speculator(upstream, stack.vc, model, monkeypatch, probabilistic=True)
        prepare_inputs(upstream, spec, states=states, seed=41, temperature=temperature)
        spec._sample_sequential(len(states), head_hidden)
        specs.append(spec)
    up, ours = specs
    rows = [states.index(s) for s in cold]
    assert torch.equal(ours.draft_tokens[rows], up.draft_tokens[rows])
    torch.testing.assert_close(ours.draft_logits[cold], up.draft_logits[cold], **LOGITS_TOL)
    torch.testing.assert_close(ours.draft_token_confidence_probs[rows], up.draft_token_confidence_probs[rows],
                               **CONF_TOL)


def test_project_export_dflash_config_is_accepted_by_upstream_speculator(upstream, stack, monkeypatch):
    """Upstream builds its speculator for this project's exports (it refuses sample_from_anchor=True)."""
    hf_config = stack.vc.speculative_config.draft_model_config.hf_config
    monkeypatch.setattr(hf_config, "dflash_config", stack.config.to_hf_dict()["dflash_config"])
    assert "sample_from_anchor" not in hf_config.dflash_config  # anchor-first is implied by projector_type
    upstream[M_DSPARK].DSparkSpeculator(stack.vc, torch.device("cpu"))
