"""The real CUDA kernel source, executed on the CPU by the SIMT harness.

``csrc/markov_draft_kernels.cu`` is compiled as host C++ with
``tests/ops/simt`` (fibers for CUDA threads, seeded random interleaving,
shared-memory race, barrier-divergence and bounds checks) by
``scripts/emulate_cuda.py``, whose ``--check`` runs the full grid (K3 sizes
included, a few minutes). Here:

* the CI subset of that grid matches ``markov_draft_reference`` (tokens
  equal, confidences within 1e-6, logits within 1e-6), draft-vocabulary
  cases (``d2t``: pair tables, certified sets, dense jobs, the dense path,
  max_norms on the device over a taller markov_w1) and gated / rnn heads
  (``head_type``: the walk's head step, dense jobs posting v, the dense
  path's head_kernel, bad anchors, d2t) included;
* the dense fallback also matches when several blocks run concurrently and
  fibers are pre-empted at random memory accesses (helpers steal tiles);
* the harness is not blind: a copy of the kernel with one ``__syncthreads``
  removed fails with a race / uninitialised-read report, a copy with an
  off-by-one token index fails (mismatch or out-of-bounds access), and a
  copy with a barrier inside ``if (threadIdx.x == 0)`` fails with a divergence
  report, and a copy that feeds the drafted DRAFT id (not its target id) to
  markov_w1 fails the draft-vocabulary cases; a copy that drafts a head's
  rows with e instead of v, or never advances the rnn state, fails the head
  cases.

Skipped without a C++ compiler or on a non-x86-64 host (the fiber switch is
x86-64 assembly).
"""

from __future__ import annotations

import importlib.util
import platform
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="no g++"),
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                       reason="the SIMT fibers switch stacks with x86-64 assembly"),
]


def _load():
    spec = importlib.util.spec_from_file_location("emulate_cuda", ROOT / "scripts" / "emulate_cuda.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


E = _load()


@pytest.fixture(scope="module")
def exe():
    return E.build_harness()


def test_quick_grid_matches_reference(exe):
    failures = []
    for name, case, temp, kw in E.grid(quick=True):
        ok, msg, _ = E.check_case(exe, name, case, temp, **kw)
        if not ok:
            failures.append(msg)
    assert not failures, "\n".join(failures)


def test_dense_fallback_with_concurrent_blocks_and_preemption(exe):
    # All-equal rows are never certified: every row is a dense job, served by
    # the walker and, with 4 resident blocks, by helper blocks too.
    case = E.adversarial("all_equal", torch.float32, seed=3)
    case["base_logits"] = case["base_logits"][:, :, :1200].contiguous()
    case["markov_w1"] = case["markov_w1"][:1200].contiguous()
    case["markov_w2"] = case["markov_w2"][:1200].contiguous()
    case["anchor_ids"] = case["anchor_ids"] % 1200
    for seed in (1, 2):
        ok, msg, out = E.check_case(exe, "all_equal-resident", case, E.temperatures(2, "greedy"),
                                    seed=seed, resident=4, preempt=0.002)
        assert ok, msg
        assert bool((out["stats"] == 1200).all())


def test_counters_report_the_launches(exe):
    case = E.make_case(2, 7, 4099, 32, torch.bfloat16, seed=5, peaky=True)
    out = E.emulate(exe, case, E.temperatures(2, "greedy"))
    launches = out["counters"]["launches"]
    assert [L["name"] for L in launches] == ["cand", "walk"]
    cand = launches[0]
    assert cand["blocks"] == 2 * 7 * 1 and cand["threads"] == 512  # 8192-token tiles
    # The candidate pass reads every base logit once (distinct sectors).
    assert cand["dram_read"] >= 2 * 7 * 4099 * 2
    assert cand["dram_read"] < 2 * 7 * 4099 * 2 * 1.1
    # max_norms not passed: two more launches compute it on the device.
    out = E.emulate(exe, case, E.temperatures(2, "greedy"), pass_max_norms=False)
    assert [L["name"] for L in out["counters"]["launches"]] == ["parts", "final_", "cand", "walk"]


# --- the harness catches what it claims to catch -------------------------------------

def _mutant(tmp_path, edit) -> Path:
    src = (ROOT / "csrc" / "markov_draft_kernels.cu").read_text()
    new = edit(src)
    assert new != src, "the mutation did not apply"
    dst = tmp_path / "markov_draft_kernels.cu"
    dst.write_text(new)
    return dst


def _remove_second_barrier_of_block_max(src: str) -> str:
    start = src.index("float block_max(")
    first = src.index("__syncthreads();", start)
    second = src.index("__syncthreads();", first + 1)
    return src[:second] + "/* barrier removed */" + src[second + len("__syncthreads();"):]


def _replace_once(src: str, old: str, new: str) -> str:
    """``src`` with its one occurrence of ``old`` replaced (a mutation that no longer applies fails)."""
    assert src.count(old) == 1, old
    return src.replace(old, new)


def _off_by_one_token_index(src: str) -> str:
    return _replace_once(src, "gst(out + pos, Entry{jx[e], xs[e]});", "gst(out + pos, Entry{jx[e] + 1, xs[e]});")


def _barrier_in_thread_zero(src: str) -> str:
    return _replace_once(src, "  if (tid == 0) s_count[0] = 0;\n",
                         "  if (tid == 0) { s_count[0] = 0; __syncthreads(); }\n")


def _draft_id_as_w1_row(src: str) -> str:
    return _replace_once(src, "    s_prev[0] = w1_row_of(p, tok);", "    s_prev[0] = tok;")


def _small_case():
    return E.make_case(2, 3, 1000, 8, torch.float32, seed=9, peaky=True)


def test_harness_catches_a_removed_barrier(tmp_path):
    exe = E.build_harness(_mutant(tmp_path, _remove_second_barrier_of_block_max), opt="-O0")
    with pytest.raises(E.HarnessError, match="race|uninitialised"):
        E.emulate(exe, _small_case(), E.temperatures(2, "greedy"))


def test_harness_catches_a_wrong_index(tmp_path):
    exe = E.build_harness(_mutant(tmp_path, _off_by_one_token_index), opt="-O0")
    ok, msg, _ = E.check_case(exe, "off-by-one", _small_case(), E.temperatures(2, "greedy"))
    assert not ok, msg
    assert "MISMATCH" in msg or "outside every registered buffer" in msg


def test_harness_catches_barrier_divergence(tmp_path):
    exe = E.build_harness(_mutant(tmp_path, _barrier_in_thread_zero), opt="-O0")
    with pytest.raises(E.HarnessError, match="divergence|deadlock"):
        E.emulate(exe, _small_case(), E.temperatures(2, "greedy"))


def test_harness_catches_an_unmapped_draft_token(tmp_path):
    exe = E.build_harness(_mutant(tmp_path, _draft_id_as_w1_row), opt="-O0")
    for name, case, temp, kw in E.draft_vocab_grid(quick=True):
        ok, msg, _ = E.check_case(exe, name, case, temp, **kw)
        if not ok:
            assert "MISMATCH" in msg, msg
            return
    pytest.fail("no draft-vocabulary case noticed markov_w1 read at the draft id")


def _head_as_vanilla(src: str) -> str:
    return _replace_once(src, "    v_put(k, v);\n", "    v_put(k, static_cast<float>(e_at(k)));\n")


def _rnn_state_never_advances(src: str) -> str:
    return _replace_once(src, "      gst(s + k, rnn_state(gld(z + k), gld(z + rank + k), gld(s + k)));\n", "")


@pytest.mark.parametrize("mutation,heads", [(_head_as_vanilla, ("gated", "rnn")),
                                            (_rnn_state_never_advances, ("rnn",))], ids=["v-is-e", "rnn-state-frozen"])
def test_harness_catches_a_wrong_head(tmp_path, mutation, heads):
    exe = E.build_harness(_mutant(tmp_path, mutation), opt="-O0")
    caught = set()
    for name, case, temp, kw in E.head_grid(quick=True):
        head = name.split("-")[1]
        if head in heads and head not in caught:
            ok, msg, _ = E.check_case(exe, name, case, temp, **kw)
            if not ok:
                assert "MISMATCH" in msg, msg
                caught.add(head)
    assert caught == set(heads), f"no mismatch for {set(heads) - caught}"
