"""The serve-time draft vocabulary's LM head rows go through the GEMM vLLM's own linear layers take on its CPU
backend (a oneDNN handle), not ``torch.nn.functional.linear`` (3-4x slower at a draft step's shapes)."""

from __future__ import annotations

import pytest
import torch

from vllm_dspark.spec_decode.v1.model import row_linear


def test_draft_vocab_rows_take_vllms_cpu_gemm(monkeypatch):
    # float32: vLLM's CPU dispatch takes oneDNN for it on any x86 build with oneDNN (bf16 only with native
    # bf16; without it vLLM's own layers fall back to torch's linear, and so do these rows).
    from vllm import _custom_ops as ops

    if not ops._supports_onednn:
        pytest.skip("this vLLM build has no oneDNN GEMM")
    dtype = torch.float32
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(1024, 64, generator=g) * 0.05).to(dtype)
    hidden = torch.randn(7, 64, generator=g).to(dtype)
    expected = torch.nn.functional.linear(hidden.float(), rows.float())
    fn = row_linear(rows)

    def refuse(*args, **kwargs):
        raise AssertionError("the fallback (torch.nn.functional.linear) ran")

    monkeypatch.setattr(torch.nn.functional, "linear", refuse)
    got = fn(hidden)
    assert got.shape == (7, 1024)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
