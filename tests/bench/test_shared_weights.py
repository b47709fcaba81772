"""share_weights: one copy of equal weights, refused for models that differ."""

import pytest
import torch

from benchmarks.harness.shared_weights import share_weights


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    m[1].cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, w, b)  # as vLLM's CPU backend packs it
    return m


def test_equal_models_end_up_reading_one_copy():
    src, dst = _model(), _model()
    assert dst[1].weight.data_ptr() != src[1].weight.data_ptr()
    n = share_weights(dst, src)
    assert n == 6  # 5 parameters and the packed linear
    for p, q in zip(dst.parameters(), src.parameters(), strict=True):
        assert p.data_ptr() == q.data_ptr()
    assert dst[1].cpu_linear is src[1].cpu_linear
    x = torch.tensor([[1, 2]])
    assert torch.equal(dst(x), src(x))
    assert share_weights(dst, src) == 1  # the parameters are shared already; the packed linear is set again


def test_models_that_differ_are_refused():
    with pytest.raises(ValueError, match="0.weight differs"):
        share_weights(_model(1), _model(2))
    other = _model()
    other[1] = torch.nn.Identity()
    with pytest.raises(ValueError, match="module '1' differs"):
        share_weights(other, _model())
    plain = _model()
    del plain[1].cpu_linear
    with pytest.raises(ValueError, match="packed linear in one engine only"):
        share_weights(_model(), plain)
    with pytest.raises(ValueError, match="packed linear in one engine only"):
        share_weights(plain, _model())
