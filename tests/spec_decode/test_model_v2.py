"""vLLM 0.33 V2 hook (``vllm_dspark/spec_decode/v2/model.py``), tested on CPU with vLLM 0.32.

vLLM 0.33's classes can't be imported here (CUDA build). The hook's logic
lives in plain functions that read a ``DSparkSpeculator``'s attributes; a fake
speculator with those attributes (names, shapes, dtypes as in 0.33's
``DFlashSpeculator``/``DSparkSpeculator``) drives them, with the compiled CPU
op standing in for the CUDA kernel. Outputs are compared with
``markov_draft_reference`` and with a restatement of upstream's greedy loop.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from vllm_dspark.ops import is_compiled_available, markov_draft_reference
from vllm_dspark.spec_decode.v2 import model as model_v2
from vllm_dspark.spec_decode.v2.model import (
    MarkovWeights,
    derive_draft_seeds,
    request_sampling_params,
    run_markov_stage,
    why_not_speculator,
    why_not_weights,
)

H, RANK, N = 32, 8, 7
MAX_REQS = 8


class FakeEstimator:
    def __init__(self):
        self.calls = []


class FakeSpeculator:
    """The attributes of vLLM 0.33's DSparkSpeculator that the hook reads and writes.

    ``states[r]`` is request r's persistent state slot (``sample_idx_mapping``);
    rows ``num_real..num_reqs`` are CUDA-graph padding (state -1, sample index 0).
    """

    def __init__(self, *, vocab, states, num_reqs=None, cache_dtype=None, use_conf=True,
                 estimator=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        num_real = len(states)
        num_reqs = num_reqs or num_real
        self.num_reqs = num_reqs
        self.num_speculative_steps = N
        self.vocab_size = vocab
        max_tokens = MAX_REQS * N
        self.input_buffers = SimpleNamespace(input_ids=torch.zeros(max_tokens, dtype=torch.int32))
        self._anchor_idx = torch.arange(MAX_REQS, dtype=torch.int64) * N
        self._step_cols = torch.arange(N, dtype=torch.int32)
        self.sample_indices = torch.zeros(MAX_REQS * N, dtype=torch.int64)
        self.sample_pos = torch.zeros(MAX_REQS * N, dtype=torch.int64)
        self.sample_idx_mapping = torch.full((MAX_REQS * N,), -1, dtype=torch.int64)
        self.anchor_pos = torch.randint(5, 500, (num_real,), generator=g)
        for r, s in enumerate(states):
            self.input_buffers.input_ids[r * N] = int(torch.randint(0, vocab, (1,), generator=g))
            self.input_buffers.input_ids[r * N + 1:(r + 1) * N] = vocab - 1  # mask token
            rows = slice(r * N, (r + 1) * N)
            self.sample_indices[rows] = torch.arange(r * N, (r + 1) * N)
            self.sample_pos[rows] = self.anchor_pos[r] + 1 + torch.arange(N)
            self.sample_idx_mapping[rows] = s
        self.temperature = torch.rand(MAX_REQS, generator=g) + 0.5  # [max_num_reqs]
        self.seeds = torch.randint(0, 2 ** 62, (MAX_REQS,), generator=g)  # [max_num_reqs]
        self.draft_tokens = torch.zeros(MAX_REQS, N, dtype=torch.int64)
        self.draft_token_confidence_probs = torch.full((MAX_REQS, N), -7.0)
        self.use_confidence_head = use_conf
        self.draft_logits = (None if cache_dtype is None
                             else torch.full((MAX_REQS, N, vocab), -3.0, dtype=cache_dtype))
        self.acceptance_estimator = FakeEstimator() if estimator else None
        self.draft_watermarker = None
        self._draft_topk = None
        self._d2t_scatter_index = None

    def _maybe_predict_acceptance(self, logits, idx_mapping, draft_step):
        self.acceptance_estimator.calls.append((logits.clone(), idx_mapping.clone(), int(draft_step)))

    def anchors(self, num_real):
        return self.input_buffers.input_ids[self._anchor_idx[:num_real]].to(torch.int64)


def make_model(vocab, *, dtype=torch.float32, with_markov=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    lm_head = torch.randn(vocab, H, generator=g).to(dtype)
    w1 = (torch.randn(vocab, RANK, generator=g) * 0.7).to(dtype)
    w2 = (torch.randn(vocab, RANK, generator=g) * 0.7).to(dtype)
    proj = torch.randn(H + (RANK if with_markov else 0), generator=g) * 0.2
    bias = 0.3
    weights = MarkovWeights.build(vocab=vocab, markov_w1=w1, markov_w2=w2, conf_weight=proj,
                                  conf_bias=bias, hidden_size=H, conf_with_markov=with_markov)

    def compute_draft_logits(h):
        return h.to(dtype) @ lm_head.T

    return weights, compute_draft_logits, proj, bias


def run(spec, weights, logits_fn, seed=2):
    g = torch.Generator().manual_seed(seed)
    head_hidden = torch.randn(spec.num_reqs * N + 3, H, generator=g)  # padded token rows too
    run_markov_stage(spec, spec.num_reqs, head_hidden, weights, logits_fn)
    return head_hidden


def reference(spec, weights, logits_fn, head_hidden, num_real, temperature=None, seeds=None):
    rows = spec.sample_indices[:num_real * N]
    hid = head_hidden[rows]
    base = logits_fn(hid).view(num_real, N, -1)
    conf_base = weights.confidence_base(hid).view(num_real, N)
    return markov_draft_reference(base, spec.anchors(num_real), weights.markov_w1, weights.markov_w2,
                                  conf_base, weights.conf_w_markov, temperature, seeds,
                                  return_logits=True)


def test_compiled_cpu_op_is_loaded():
    # Everything below runs the compiled op through run_markov_stage, never a Python fallback.
    assert is_compiled_available("cpu")


@pytest.mark.parametrize("vocab", [111, 1024])
@pytest.mark.parametrize("padded", [False, True])
def test_greedy_matches_reference_and_upstream_loop(vocab, padded):
    states = [3, 0, 5]
    spec = FakeSpeculator(vocab=vocab, states=states, num_reqs=5 if padded else None)
    weights, logits_fn, proj, bias = make_model(vocab)
    head_hidden = run(spec, weights, logits_fn)
    R = len(states)
    tok, conf, _ = reference(spec, weights, logits_fn, head_hidden, R)
    # Upstream drafts greedily when draft_logits is None, whatever the requests' temperatures.
    assert torch.equal(spec.draft_tokens[:R], tok)
    torch.testing.assert_close(spec.draft_token_confidence_probs[:R], conf, atol=1e-6, rtol=0)

    # Restatement of DSparkSpeculator's default loop (fp32, no ties on random data).
    hid = head_hidden[spec.sample_indices[:R * N]]
    base = logits_fn(hid).view(R, N, vocab)
    prev = spec.anchors(R)
    for i in range(N):
        e = weights.markov_w1[prev]
        want = torch.argmax(base[:, i] + e @ weights.markov_w2.T, dim=-1)
        c = torch.sigmoid(torch.cat([hid.view(R, N, H)[:, i], e], -1) @ proj + bias)
        assert torch.equal(spec.draft_tokens[:R, i], want)
        torch.testing.assert_close(spec.draft_token_confidence_probs[:R, i], c, atol=1e-5, rtol=1e-5)
        prev = want


def test_bf16_weights_and_logits_match_reference():
    spec = FakeSpeculator(vocab=111, states=[1, 2])
    weights, logits_fn, _, _ = make_model(111, dtype=torch.bfloat16)
    head_hidden = run(spec, weights, logits_fn)
    tok, conf, _ = reference(spec, weights, logits_fn, head_hidden, 2)
    assert torch.equal(spec.draft_tokens[:2], tok)


def test_probabilistic_fp32_sampling_seeds_and_logits_cache():
    states = [6, 2, 4]
    spec = FakeSpeculator(vocab=111, states=states, num_reqs=4, cache_dtype=torch.float32)
    weights, logits_fn, _, _ = make_model(111)
    head_hidden = run(spec, weights, logits_fn)
    st = torch.tensor(states)
    temp = spec.temperature[st]
    seeds = spec.seeds[st] ^ (spec.anchor_pos << 32)
    tok, conf, logits = reference(spec, weights, logits_fn, head_hidden, 3, temp, seeds)
    assert torch.equal(spec.draft_tokens[:3], tok)
    # Cache: pre-temperature corrected logits at each request's state slot; other slots untouched
    # (the padded row, state -1, must not land anywhere).
    for r, s in enumerate(states):
        torch.testing.assert_close(spec.draft_logits[s], logits[r], atol=1e-6, rtol=0)
    for s in set(range(MAX_REQS)) - set(states):
        assert bool((spec.draft_logits[s] == -3.0).all()), s
    # Sampled, not greedy: with these temperatures the draws differ from the argmax somewhere.
    greedy, *_ = reference(spec, weights, logits_fn, head_hidden, 3)
    assert not torch.equal(tok, greedy)


def test_sampling_is_reproducible_and_fresh_per_step():
    weights, logits_fn, _, _ = make_model(111)
    a = FakeSpeculator(vocab=111, states=[0, 1, 2, 3], cache_dtype=torch.float32)
    b = FakeSpeculator(vocab=111, states=[0, 1, 2, 3], cache_dtype=torch.float32)
    run(a, weights, logits_fn)
    run(b, weights, logits_fn)
    assert torch.equal(a.draft_tokens, b.draft_tokens)  # same seeds, same positions
    b.sample_pos[: 4 * N] += 1  # next decoding step: the anchor moved
    run(b, weights, logits_fn)
    assert not torch.equal(a.draft_tokens[:4], b.draft_tokens[:4])


def test_seed_derivation():
    seeds = torch.tensor([0, 12345, 2 ** 62 + 7, -5])
    pos = torch.tensor([0, 3, 70000, 1])
    got = derive_draft_seeds(seeds, pos)
    assert got.tolist() == [s ^ (p << 32) for s, p in zip(seeds.tolist(), pos.tolist())]
    # Injective in the anchor position for one request seed.
    many = derive_draft_seeds(torch.full((1000,), 99), torch.arange(1000))
    assert many.unique().numel() == 1000


def test_request_params_greedy_without_cache_and_padding_rows_inert():
    spec = FakeSpeculator(vocab=111, states=[5, 1], num_reqs=3)
    t, s = request_sampling_params(spec, 3)
    assert t.tolist() == [0.0, 0.0, 0.0] and s.dtype == torch.int64
    spec = FakeSpeculator(vocab=111, states=[5, 1], num_reqs=3, cache_dtype=torch.float32)
    t, s = request_sampling_params(spec, 3)
    torch.testing.assert_close(t[:2], spec.temperature[[5, 1]])
    assert t[2].item() == 0.0 and s[2].item() == 0


def test_confidences_untouched_without_confidence_head_and_estimator_sees_corrected_logits():
    spec = FakeSpeculator(vocab=111, states=[2, 0], use_conf=False, estimator=True)
    weights, logits_fn, _, _ = make_model(111)
    head_hidden = run(spec, weights, logits_fn)
    assert bool((spec.draft_token_confidence_probs == -7.0).all())  # the estimator's buffer
    tok, _, logits = reference(spec, weights, logits_fn, head_hidden, 2)
    assert torch.equal(spec.draft_tokens[:2], tok)
    calls = spec.acceptance_estimator.calls
    assert [c[2] for c in calls] == list(range(N))
    for i, (lg, idx, _) in enumerate(calls):
        torch.testing.assert_close(lg, logits[:, i], atol=1e-6, rtol=0)
        assert idx.tolist() == [2, 0]


def test_confidence_head_without_markov_input():
    spec = FakeSpeculator(vocab=111, states=[0])
    weights, logits_fn, proj, bias = make_model(111, with_markov=False)
    head_hidden = run(spec, weights, logits_fn)
    hid = head_hidden[spec.sample_indices[:N]]
    torch.testing.assert_close(spec.draft_token_confidence_probs[0], torch.sigmoid(hid @ proj + bias),
                               atol=1e-6, rtol=1e-6)


def test_capture_warmup_with_all_rows_padding_writes_nothing():
    # capture() fills sample_idx_mapping with -1 before the warm-up pass: every row is padding.
    # Padding rows may fill their own per-row outputs (upstream ignores them), but must write
    # nothing into the per-state draft-logits cache, which real requests own.
    spec = FakeSpeculator(vocab=111, states=[], num_reqs=2, cache_dtype=torch.float32)
    before = spec.draft_logits.clone()
    weights, logits_fn, _, _ = make_model(111)
    run(spec, weights, logits_fn)
    assert torch.equal(spec.draft_logits, before)
    assert bool((spec.draft_tokens[2:] == 0).all())  # rows past num_reqs are not touched either


def test_why_not_speculator_reasons():
    spec = FakeSpeculator(vocab=111, states=[0])
    cpu = torch.device("cpu")
    assert why_not_speculator(spec, cpu) is None
    spec.draft_logits = torch.zeros(MAX_REQS, N, 111, dtype=torch.float32)
    assert why_not_speculator(spec, cpu) is None
    spec.draft_logits = spec.draft_logits.bfloat16()
    assert "head_dtype" in why_not_speculator(spec, cpu)
    spec.draft_logits = None
    # A draft vocabulary is served (test_model_v2_families.py); a scatter map the weights lack is not.
    for attr, value, word in [("_draft_topk", 8, "top-k"), ("_d2t_scatter_index", torch.arange(3), "does not match"),
                              ("draft_watermarker", object(), "watermark")]:
        s = FakeSpeculator(vocab=111, states=[0])
        setattr(s, attr, value)
        assert word in why_not_speculator(s, cpu)


def test_why_not_weights_reasons():
    w = torch.zeros(111, RANK)
    assert why_not_weights(w, w, 111) is None
    assert why_not_weights(w, w, 111 + 64 - 111 % 64) is not None  # fewer rows than the vocab
    assert "dtype" in why_not_weights(w.to(torch.int8), w.to(torch.int8), 111)
    assert "differ" in why_not_weights(w, w.bfloat16(), 111)
    assert "plain" in why_not_weights(None, w, 111)


def test_class_refuses_other_vllm_versions():
    import vllm

    if vllm.__version__.startswith("0.33"):
        pytest.skip("vLLM 0.33 installed")
    with pytest.raises(ImportError, match="vLLM 0.33"):
        model_v2.DSparkV2DraftModel  # noqa: B018


def _vllm_config(target: dict, draft: dict):
    class HF(dict):
        def to_dict(self):
            return dict(self)

    return SimpleNamespace(model_config=SimpleNamespace(hf_config=HF(target)),
                           speculative_config=SimpleNamespace(
                               draft_model_config=SimpleNamespace(hf_config=HF(draft), model="d")))


def test_k3_worker_check(monkeypatch):
    from vllm_dspark.serving import compat
    from vllm_dspark.tools.deploy.plan import bundled_k3_paths

    draft_path, target_path = bundled_k3_paths()
    draft, target = json.loads(draft_path.read_text()), json.loads(target_path.read_text())
    monkeypatch.delenv(compat.AUX_STREAM_ENV, raising=False)
    with pytest.raises(compat.K3CaptureError, match=compat.AUX_STREAM_ENV):
        model_v2.check_k3_worker(_vllm_config(target, draft))
    monkeypatch.setenv(compat.AUX_STREAM_ENV, "1")
    assert model_v2.check_k3_worker(_vllm_config(target, draft)) == "already-on"
    # Other targets: no draft parsing at all (upstream-format checkpoints must load too).
    monkeypatch.delenv(compat.AUX_STREAM_ENV)
    qwen = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64}
    assert model_v2.check_k3_worker(_vllm_config(qwen, {"not": "a dspark config"})) == "not-needed"
