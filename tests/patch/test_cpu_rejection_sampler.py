"""vLLM's rejection sampler on the CPU backend, with the plugin's patches applied (no engine).

vLLM 0.32's CPU override of the ``_expand`` kernel never wrote float32/int32
outputs. Per-token temperatures, top-k and top-p were then uninitialised
memory, so spec-decode sampling at temperature > 0 drew from the wrong
distribution and seeded requests did not repeat. ``v1_sample_rejection_sampler``
fixes this. These tests check the expansion, the scaled logits, and that the
first output token of a verified draft follows the target distribution.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_dspark.ops import is_compiled_available
from vllm_dspark.patch import v1_sample_rejection_sampler as patch_module

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


@pytest.fixture(scope="module")
def rs():
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    from vllm_dspark.patch import triton_utils_dispatcher as scan

    # The override scan as a worker with the plugin runs it: with llvmlite loaded by another test
    # module (numba), upstream's scan fails on llvmlite's handle (kernel-scan-fake-dict).
    scan_was_applied = scan.PATCH.applied
    scan.PATCH.apply()
    if current_platform.is_cpu() and EXPAND_KERNEL not in dispatcher._registry:
        current_platform.register_triton_kernel_overrides()  # as every vLLM worker does at start-up
    import vllm.v1.sample.rejection_sampler as module

    was_applied = patch_module.PATCH.applied
    patch_module.PATCH.apply()
    yield module
    if not was_applied:
        patch_module.PATCH.restore()
    if not scan_was_applied:
        scan.PATCH.restore()


def test_expand_keeps_dtype_values_and_replacement(rs):
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # request 1 has no draft tokens
    temp = rs.expand_batch_to_tokens(torch.tensor([0.7, 0.5, -1.0, 1.3]), cu, 6, replace_from=-1, replace_to=1)
    assert temp.dtype == torch.float32
    assert temp.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])
    top_k = rs.expand_batch_to_tokens(torch.tensor([3, 9, 0, 4], dtype=torch.int32), cu, 6)
    assert top_k.dtype == torch.int32 and top_k.tolist() == [3, 3, 0, 0, 0, 4]


def test_sampling_constraints_divide_by_each_requests_temperature(rs):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g)
    md = SimpleNamespace(all_greedy=False, temperature=torch.tensor([0.5, 2.0]), top_k=None, top_p=None)
    out = rs.apply_sampling_constraints(logits.clone(), torch.tensor([2, 5], dtype=torch.int32), md)
    expected = torch.cat([logits[:2] / 0.5, logits[2:] / 2.0])
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_first_token_follows_the_tempered_target(rs, with_draft_probs):
    """One draft per request: the emitted token must follow softmax(logits / T), whatever was drafted."""
    vocab, per_group = 6, 20000
    temps = (0.6, 1.4)
    g = torch.Generator().manual_seed(1)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    draft_dist = torch.tensor([0.05, 0.1, 0.4, 0.3, 0.1, 0.05])
    batch = per_group * len(temps)
    draft_ids = torch.multinomial(draft_dist, batch, replacement=True, generator=g).to(torch.int32)
    md = SimpleNamespace(all_greedy=False, all_random=True, generators={}, top_k=None, top_p=None,
                         temperature=torch.tensor([t for t in temps for _ in range(per_group)]))
    cu = torch.arange(1, batch + 1, dtype=torch.int32)
    target_logits = rs.apply_sampling_constraints(base.expand(batch, vocab).clone(), cu, md)
    draft_probs = draft_dist.expand(batch, vocab).contiguous() if with_draft_probs else None
    out = rs.rejection_sample(draft_ids, [1] * batch, 1, cu, draft_probs, target_logits,
                              torch.zeros(batch, 1, dtype=torch.int64), md)
    first = out[:, 0].long()
    for k, t in enumerate(temps):
        tokens = first[k * per_group:(k + 1) * per_group]
        freq = torch.bincount(tokens, minlength=vocab).double() / per_group
        want = torch.softmax(base.double() / t, dim=0)
        # draft_probs None (n-gram) means a one-hot draft: the output still follows the target.
        assert (freq - want).abs().max().item() < 0.015, (t, freq.tolist(), want.tolist())
    # The two temperatures must give visibly different outputs (they did not when both were junk).
    f0 = torch.bincount(first[:per_group], minlength=vocab).double() / per_group
    f1 = torch.bincount(first[per_group:], minlength=vocab).double() / per_group
    assert (f0 - f1).abs().max().item() > 0.1


def test_seeded_requests_repeat(rs):
    vocab, batch = 50, 8
    g = torch.Generator().manual_seed(2)
    base = torch.randn(batch, vocab, generator=g)
    draft_ids = torch.randint(0, vocab, (batch,), generator=g, dtype=torch.int32)
    cu = torch.arange(1, batch + 1, dtype=torch.int32)

    def run():
        md = SimpleNamespace(all_greedy=False, all_random=True, top_k=None, top_p=None,
                             temperature=torch.full((batch,), 0.8),
                             generators={i: torch.Generator().manual_seed(100 + i) for i in range(batch)})
        torch.empty(batch * 4, vocab).normal_()  # disturb the allocator between runs
        logits = rs.apply_sampling_constraints(base.clone(), cu, md)
        return rs.rejection_sample(draft_ids, [1] * batch, 1, cu, None, logits,
                                   torch.zeros(batch, 1, dtype=torch.int64), md).tolist()

    assert run() == run() == run()


def test_a_batch_without_drafts_is_sampled_once_without_a_copy():
    """The no-draft shortcut hands the logits themselves to the sampler and counts the step."""
    seen = []

    class Sampler:
        def __call__(self, logits, sampling_metadata, predict_bonus_token):
            seen.append((logits, predict_bonus_token))
            return SimpleNamespace(sampled_token_ids=logits.argmax(-1, keepdim=True))

    forward = patch_module._make_forward(lambda *a: pytest.fail("the full rejection path ran"))
    me = SimpleNamespace(sampler=Sampler())
    logits = torch.randn(3, 17, generator=torch.Generator().manual_seed(1))
    md = SimpleNamespace(max_spec_len=0, bonus_logits_indices=torch.arange(3))
    # Not greedy: the sampler itself samples (a greedy batch takes the compiled argmax, below).
    sm = _greedy_metadata(3, all_greedy=False, temperature=torch.ones(3))
    out = forward(me, md, None, logits, sm)
    assert seen[0][0] is logits and seen[0][1] is True
    assert out.sampled_token_ids.dtype == torch.int32 and out.sampled_token_ids.shape == (3, 1)
    assert out.sampled_token_ids.view(-1).tolist() == logits.argmax(-1).tolist()
    assert me.dspark_no_draft_steps == 1
    # Rows beyond the bonus rows (not a shape the runner sends without drafts) are gathered.
    md2 = SimpleNamespace(max_spec_len=0, bonus_logits_indices=torch.tensor([0, 2]))
    out2 = forward(me, md2, None, logits, sm)
    assert out2.sampled_token_ids.view(-1).tolist() == logits[[0, 2]].argmax(-1).tolist()
    # A batch with drafts of a sampling request takes the full path.
    with pytest.raises(pytest.fail.Exception):
        forward(me, SimpleNamespace(max_spec_len=2, bonus_logits_indices=torch.arange(3)), None, logits, sm)
    assert not hasattr(me, "dspark_argmax_bonus_steps")


@pytest.mark.skipif(not is_compiled_available("cpu"), reason="vllm_dspark._C is not built")
def test_a_greedy_batch_without_drafts_takes_the_compiled_argmax():
    from vllm_dspark.ops import argmax

    forward = patch_module._make_forward(lambda *a: pytest.fail("the full rejection path ran"))
    me = SimpleNamespace(sampler=lambda **kw: pytest.fail("the sampler ran"))
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for idx in (torch.arange(4), torch.tensor([1, 3])):
        out = forward(me, SimpleNamespace(max_spec_len=0, bonus_logits_indices=idx), None, logits,
                      _greedy_metadata(4))
        assert argmax.last_path == "compiled"
        assert out.sampled_token_ids.dtype == torch.int32 and out.sampled_token_ids.shape == (len(idx), 1)
        assert out.sampled_token_ids.view(-1).tolist() == logits[idx].argmax(-1).tolist()
    assert me.dspark_argmax_bonus_steps == 2 and me.dspark_no_draft_steps == 2


def _greedy_metadata(batch: int, **over):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    kw = dict(temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
              max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
              frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
              repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
              allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    kw.update(over)
    return SamplingMetadata(**kw)


def _verify_case(seed: int, batch: int, max_k: int, vocab: int, dtype=torch.bfloat16):
    """Drafts that match the target's argmax 70% of the time, 0..max_k per request (at least one somewhere)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max_k + 1, (batch,), generator=g).tolist()
    counts[0] = max(counts[0], 1)
    logits = torch.randn(sum(counts) + batch, vocab, generator=g).to(dtype)
    drafts, target, bonus, row = [], [], [], 0
    for n in counts:  # the runner's layout: each request's draft positions, then its bonus position
        best = logits[row:row + n].argmax(-1).tolist()
        drafts += [b if torch.rand(1, generator=g).item() < 0.7 else int(torch.randint(0, vocab, (1,), generator=g))
                   for b in best]
        target += range(row, row + n)
        bonus.append(row + n)
        row += n + 1
    n = torch.tensor(counts, dtype=torch.int32)
    md = SpecDecodeMetadata(draft_token_ids=torch.tensor(drafts, dtype=torch.int32), num_draft_tokens=counts,
                            cu_num_draft_tokens=torch.cumsum(n, 0, dtype=torch.int32),
                            cu_num_sampled_tokens=torch.cumsum(n + 1, 0, dtype=torch.int32),
                            target_logits_indices=torch.tensor(target, dtype=torch.int32),
                            bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
                            logits_indices=torch.arange(row, dtype=torch.int32))
    return md, logits


@pytest.mark.parametrize("seed", range(6))
def test_greedy_verify_shortcut_gives_upstreams_tokens(rs, seed):
    """The CPU greedy shortcut against upstream's full forward, same sampler, same logits: every token equal."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    batch = 1 + seed * 5
    md, logits = _verify_case(seed, batch, max_k=7, vocab=300, dtype=torch.bfloat16 if seed % 2 else torch.float32)
    sm = _greedy_metadata(batch)
    original = patch_module.FORWARD_PATCH._original or RejectionSampler.forward
    if getattr(original, "__dspark_patch__", None):
        pytest.skip("upstream's forward is not reachable (patched without a saved original)")
    me = RejectionSampler(Sampler())
    want = original(me, md, None, logits.clone(), sm).sampled_token_ids
    forward = patch_module._make_forward(lambda *a: pytest.fail("the full rejection path ran"))
    got = forward(me, md, None, logits.clone(), sm).sampled_token_ids
    assert me.dspark_greedy_verify_steps == me.dspark_argmax_bonus_steps == 1
    assert got.dtype == want.dtype == torch.int32
    assert got.tolist() == want.tolist()
    # Some drafts accepted, some rejected, and at least one bonus token (the case is not degenerate).
    assert (got >= 0).sum() > batch


def test_greedy_verify_keeps_upstreams_path_when_the_argmax_is_not_the_verdict(rs):
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    md, logits = _verify_case(0, 3, max_k=3, vocab=50)
    calls = []
    forward = patch_module._make_forward(lambda *a: calls.append(1) or "upstream")
    me = SimpleNamespace(sampler=None)
    min_tokens = object.__new__(MinTokensLogitsProcessor)
    min_tokens.min_toks = {0: (5, [], {2}, False)}
    from vllm.v1.sample.logits_processor import LogitsProcessors

    procs = LogitsProcessors()
    procs.non_argmax_invariant.append(min_tokens)
    for over in (dict(all_greedy=False, temperature=torch.ones(3)), dict(no_penalties=False),
                 dict(bad_words_token_ids={0: [[3]]}), dict(allowed_token_ids_mask=torch.zeros(3, 50, dtype=bool)),
                 dict(max_num_logprobs=0), dict(logitsprocs=procs)):
        assert forward(me, md, None, logits, _greedy_metadata(3, **over)) == "upstream", over
    assert len(calls) == 6
    assert not hasattr(me, "dspark_greedy_verify_steps")


def _logit_bias(batch: int, vocab: int, biases: dict[int, dict[int, float]]):
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor

    p = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
    p.biases = biases
    reqs = [r for r, lb in biases.items() for _ in lb]
    p.bias_tensor = torch.tensor([b for lb in biases.values() for b in lb.values()], dtype=torch.float32)
    p.logits_slice = (torch.tensor(reqs, dtype=torch.int32),
                      torch.tensor([t for lb in biases.values() for t in lb], dtype=torch.int32))
    return p


@pytest.mark.parametrize("active", [False, True])
def test_the_bonus_argmax_leaves_a_logit_bias_at_work_to_upstreams_sampler(rs, active):
    """Upstream biases the bonus rows only. An idle bias processor lets the bonus rows take the
    compiled argmax; one with biases sends them through the sampler. Both give upstream's tokens."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    batch, vocab = 4, 300
    md, logits = _verify_case(3, batch, max_k=5, vocab=vocab)
    # A bias large enough to make token 7 every request's bonus token.
    procs = LogitsProcessors([_logit_bias(batch, vocab, {i: {7: 1e4} for i in range(batch)} if active else {})])
    sm = _greedy_metadata(batch, logitsprocs=procs)
    original = patch_module.FORWARD_PATCH._original or RejectionSampler.forward
    if getattr(original, "__dspark_patch__", None):
        pytest.skip("upstream's forward is not reachable (patched without a saved original)")
    want = original(RejectionSampler(Sampler()), md, None, logits.clone(), sm).sampled_token_ids
    me = RejectionSampler(Sampler())
    forward = patch_module._make_forward(lambda *a: pytest.fail("the full rejection path ran"))
    got = forward(me, md, None, logits.clone(), sm).sampled_token_ids
    assert got.tolist() == want.tolist()
    assert getattr(me, "dspark_argmax_bonus_steps", 0) == (0 if active else 1)
    if active:  # the bias did reach the bonus tokens (the case is not degenerate)
        assert 7 in got.view(-1).tolist()


@pytest.mark.parametrize("batch", [1, 5, 64, 65, 200])
def test_greedy_accepts_python_and_torch_passes_agree(batch):
    """Both fills of greedy_accept (Python up to 64 requests, torch above) give the same rows."""
    g = torch.Generator().manual_seed(batch)
    for _ in range(10):
        counts = torch.randint(0, 8, (batch,), generator=g).tolist()
        counts[0] = max(counts[0], 1)
        argmax = torch.randint(0, 4, (sum(counts),), generator=g)
        drafts = torch.where(torch.rand(len(argmax), generator=g) < 0.8, argmax, torch.randint(0, 4, argmax.shape))
        bonus = torch.randint(0, 4, (batch, 1), generator=g)
        args = (drafts.to(torch.int32), argmax, counts, bonus, 7)
        py, pt = patch_module._greedy_accept_py(*args), patch_module._greedy_accept_torch(*args)
        assert py.dtype == pt.dtype == torch.int32 and torch.equal(py, pt)
        assert torch.equal(patch_module.greedy_accept(*args), py)
