"""The compiled row_argmax against torch.argmax: values, ties, NaN, -inf, row selection, errors."""

import pytest
import torch

from vllm_dspark.ops import argmax as A
from vllm_dspark.ops import is_compiled_available

pytestmark = pytest.mark.skipif(not is_compiled_available("cpu"), reason="vllm_dspark._C is not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 7, 511, 512, 513, 49152])
def test_matches_torch_argmax_of_the_chosen_rows(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(40, vocab, generator=g).to(dtype)
    rows = torch.randint(0, 40, (25,), generator=g)
    for r in (rows, rows.to(torch.int32), None):
        got = A.row_argmax(x, r)
        assert A.last_path == "compiled"
        want = (x if r is None else x[r.long()]).argmax(-1)
        assert got.dtype == torch.int64 and torch.equal(got, want)


def test_ties_nan_and_minus_inf_rows_give_torchs_index():
    x = torch.full((5, 1000), -float("inf"))
    x[1, [3, 700, 999]] = 2.0            # a tie: the first one
    x[2, 600] = float("nan")             # a NaN wins, as in torch
    x[2, 10] = 5.0
    x[3, [20, 900]] = float("nan")       # the first NaN
    x[4, 999] = -1.0                     # the last column
    for dtype in (torch.float32, torch.bfloat16):
        y = x.to(dtype)
        assert A.row_argmax(y).tolist() == y.argmax(-1).tolist() == [0, 3, 600, 20, 999]


def test_a_non_contiguous_input_and_bad_calls():
    x = torch.randn(64, 300)[::2]
    assert torch.equal(A.row_argmax(x), x.argmax(-1))
    with pytest.raises(RuntimeError, match="row 40 of 32"):
        torch.ops.vllm_dspark.row_argmax(x, torch.tensor([40]))
    with pytest.raises(RuntimeError, match="rows must be int32 or int64"):
        torch.ops.vllm_dspark.row_argmax(x, torch.tensor([1.0]))
    # What the op does not take runs torch's argmax, and says so.
    d = torch.randn(3, 9, dtype=torch.float64)
    assert torch.equal(A.row_argmax(d), d.argmax(-1)) and A.last_path == "torch"
