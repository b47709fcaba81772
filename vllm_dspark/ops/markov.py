"""The Markov draft op: DSpark's sequential stage as one compiled op.

What it removes
    DSpark picks the block's draft tokens left to right: position i adds the
    Markov bias ``markov_w2 @ markov_w1[prev]`` to its base logits, picks a token
    and hands it to position i + 1. Done the obvious way (upstream vLLM's loop)
    that is, per position, a gather, one full vocabulary x rank matmul reading
    all of ``markov_w2``, an add and a full-vocabulary argmax: at Kimi K3's size
    (vocab 163840 x rank 256 x 7 positions) 28 kernel launches and 7 reads of
    ``markov_w2`` per draft step on a GPU, ~0.3 s at batch 1 on a 2-core CPU.
    The op bounds every token's score by ``base_j +- ||w2_j|| * ||e||`` (plus the
    token's Gumbel noise bounds when sampling), computes exact dot products only
    for the few tokens whose bound reaches the best exact score, and computes a
    row densely only when too many survive. It also computes the confidence
    head's Markov part in the same pass. How many drafts are verified is the
    callers' decision, from the confidences (``spec_decode/common/verify.py``,
    the budget), not the op's.

    CPU twin (``csrc/markov_draft_cpu.cpp``): OpenMP over requests, one streaming
    pass per row with the exact ||e|| of the row's previous token.
    CUDA (``csrc/markov_draft_kernels.cu``): ``cand_kernel`` reads every base
    logit once, grid-wide over all (request, position) rows, with a bound that
    does not depend on the previous token (``M = max||w2_j|| * max||w1_j||``,
    ``max_norms``), and keeps a small *certified* candidate set per row (every
    token outside provably loses); ``walk_kernel`` (a block per request) walks
    the positions with exact fp64 dots against the real embedding, from pair
    tables precomputed for small sets. Uncertified rows (overflow, or ||e|| above
    the bound) are computed densely and wide: every block of the walk grid
    serves markov_w2 tiles, one tile read for all jobs posted at that time.
    ``out_logits`` (and shapes the pruned path does not take: rank > 4096,
    block > 64) runs position by position, each markov_w2 tile read once for all
    requests. Two launches per call on the pruned path (four without
    ``max_norms``), graph-capturable, no host sync; scratch comes from the
    caching allocator in the glue (``markov_workspace_bytes``).

Numerical contract
    The semantics are ``markov_draft_reference`` in ``markov_reference.py``
    (bias accumulated in fp64 and rounded once to fp32, fp32 logits, ties to the
    lowest token id, counter-based Gumbel noise). Pruning never changes a token:
    bounds are inflated by 1e-5 relative, far above fp32 rounding, and are only
    ever compared against exactly computed scores; scores use single correctly
    rounded fp32 operations on every build (``add_rn``/``div_rn`` in
    ``markov_common.h``; the CUDA source refuses ``--use_fast_math``). Token ids
    equal the reference's (``torch.equal``) for greedy and seeded sampling,
    fp32/bf16/fp16; the only way to differ is an fp64 summation-order or libm
    difference that straddles an fp32 rounding boundary of the winning score AND
    flips a near-exact tie, which the tests have never produced. Confidences
    agree to 1e-6 (fp64 sigmoid, rounded to fp32).
    ``w2_row_norms`` must come from :func:`markov_row_norms` and ``max_norms``
    from :func:`markov_max_norms` of the same weights (a stale w2 norm breaks the
    bound; a w1 maximum below a real row's norm is detected and only costs a
    dense row).

NaN policy
    A NaN score ranks below every other score, ``-inf`` included: NaN is never
    proposed while its row holds anything else, and a row of only NaN proposes
    token 0 (the lowest id, as a row of only ``-inf`` does). This differs from
    ``torch.argmax``, which would return the first NaN. A NaN Markov bias (NaN
    weights) voids a row's certificate and that row is computed densely.

Anchor policy
    An anchor outside ``[0, len(markov_w1))`` (the vocabulary; the TARGET
    vocabulary with a draft vocabulary) has no Markov embedding: position 0 uses
    ``e = 0`` (no bias; the confidence's Markov part is 0), the rest of the block
    is drafted normally. Nothing is read out of bounds and nothing synchronises
    with the host, so padded or garbage rows are harmless (both twins and the
    reference agree).

Draft vocabularies (``d2t``, the op's last argument)
    A checkpoint may score a smaller draft vocabulary (speculators'
    ``draft_vocab_size`` Vd < V): ``lm_head`` and ``markov_w2`` have Vd rows,
    ``markov_w1`` keeps V rows indexed by target ids, and ``d2t`` int64 [Vd]
    holds OFFSETS (target id = draft id + d2t[draft id]). With ``d2t`` the op's
    base logits, ``markov_w2``, ``w2_row_norms``, output tokens, ``out_logits``
    and ``stats`` are all in DRAFT ids [0, Vd) (one space for tokens and logits,
    and the kernels change in one place); the anchor is a target id, valid in
    ``[0, len(markov_w1))``; and each drafted token reaches the next position's
    ``markov_w1`` row (and the CPU twin's exact ||e||, and the confidence's
    Markov part) as ``token + d2t[token]``. Callers map the tokens to target ids
    (``spec_decode/common/drafts.py``: ``DraftVocab.to_target``, and q to the
    target vocabulary with ``q_to_target``). ``max_norms`` over all of
    ``markov_w1``'s rows stays a valid bound. The op checks d2t's shape, dtype
    and device; :func:`markov_draft` and the loaders also check its values
    (``check_d2t``: every mapped id inside ``markov_w1``; once per tensor, since
    on a GPU that is a host sync). A mapped id outside ``markov_w1`` gets no
    Markov embedding, like a bad anchor, so even a bad map reads nothing out of
    bounds.

Head variants (``head_type``, ``head_hidden``, ``head_w``: the op's last arguments)
    Gated (1) and rnn (2) Markov heads (``spec_decode/common/heads.py``) replace ``e`` in
    the bias by ``v``: gated ``v = sigmoid(Wg [h ; e] + bg) * e``, rnn ``v = tanh(o)``
    with ``[a ; c ; o] = Wj [s ; e ; h] + bj`` and a state ``s`` carried along the block
    (zero at its start). The parts that read the hidden rows ``h`` do not depend on the
    drafted tokens: the caller computes them for every position at once, bias included,
    as ``head_hidden`` [R, B, m] fp32 (gated m = rank, rnn m = 3 rank), and passes the
    token-side weights ``head_w`` fp32 (gated ``Wg[:, H:]`` [rank, rank], rnn
    ``Wj[:, :2 rank]`` [3 rank, 2 rank]). Per position the op computes ``v`` with small
    fp64 matvecs (the gate and the state in fp64, ``v`` rounded once to fp32; the exact
    order is ``markov_reference.head_stepper``) and runs the vanilla path on it: the
    bias is ``markov_w2 @ v`` under the same contract, the pruning bound uses the
    actual ``||v||`` of the row (CPU twin; the CUDA walk) and, in the CUDA candidate
    pass, a bound that holds for every previous token (gated ``||v|| <= ||e|| <=
    max||w1||``; rnn ``||v|| <= sqrt(rank)``, a loose bound: an rnn row with a strong
    ``markov_w2`` more often goes dense). The confidence's Markov input stays ``e``.
    Greedy and sampled rows, ``d2t``, ``out_logits`` and ``stats`` all work as for the
    vanilla head. CUDA: the walker computes ``v`` per position in its block (the rnn
    state in the workspace, fp64; the pair tables are off for these heads), and the
    dense path launches ``head_kernel`` before each position. The wrapper refuses
    wrong head arguments by name (``check_head``); the op checks them too.

Build and use
    ``pip install --no-build-isolation -e .`` builds ``vllm_dspark._C`` (the op's
    schema in ``csrc/torch_bindings.cpp`` and the CPU twin, always; the CUDA
    implementation too when torch is a CUDA build, unless
    ``VLLM_DSPARK_NO_CUDA=1``). :func:`markov_draft` allocates the outputs and
    falls back to the reference (logged once, with the reason from
    ``_why_not``) when the compiled op cannot take the call. Callers that
    capture CUDA graphs call ``torch.ops.vllm_dspark.markov_draft`` directly
    with preallocated outputs (it returns nothing; on CUDA its only allocation
    is its scratch, from the caching allocator) and should pass ``max_norms``
    (14th argument, optional) computed once per model, and ``d2t`` (15th,
    optional) for a draft vocabulary. ``stats`` (optional
    output) counts the exact scores computed per row; ``V`` means the row was
    computed densely. Every tensor, optional ones included, must be on
    ``base_logits``' device (checked, with the tensor's name).

Performance (``benchmarks/bench_markov_op.py``)
    CPU: one streaming pass over the row's base logits (plus, when sampling,
    a hash and table look-up per token) replaces the rank-256 matvec; >= 20x
    over the dense loop at batch 1 and 64 on the benchmark's regimes. The bound
    is Cauchy-Schwarz, so it only separates tokens when ||w2_j||*||e|| is small
    against the spread of the top base logits; with large isotropic Markov
    weights over flat logits most rows go dense (``--regimes flat-strong``).
    With ``out_logits`` every row is dense, position by position with each
    ``markov_w2`` tile shared by all requests (about the loop's cost).
    CUDA: not yet measured on a GPU. ``--model h200`` prints a MODEL of the H200
    time from the SIMT harness's counters against a model of upstream's loop
    (assumptions printed with it); ``--device cuda`` measures on a GPU.

Checked by
    ``tests/ops/test_markov_op.py``: the compiled CPU op is loaded (no silent
    fallback), ``torch.library.opcheck``, op vs reference over batch 1 and > 1,
    vocab 111 and 163840, rank 1 and 256, block 1 and 7, bf16/fp32/fp16,
    greedy/sampled/mixed, adversarial pruning cases (bias outweighing the base,
    bias at the bound, ties, all-equal base -> dense fallback seen in
    ``stats``, -inf entries), the NaN policy (both paths) and out-of-range
    anchors. ``tests/ops/test_markov_draft_vocab.py``: draft vocabularies
    (sorted and shuffled maps, anchors off the draft subset or outside
    ``markov_w1``, ``out_logits``, ``stats``, a K3-sized 32000-of-163840 case,
    bad maps refused by name). ``tests/ops/test_markov_heads_op.py``: gated and
    rnn heads (both x greedy/sampled/mixed x full vocabulary/d2t x fp32/bf16,
    the dense path, K3 vocabulary, strong bias, bad anchors, NaN policy, one
    block per request, the older schema forms, bad head arguments refused by
    name). ``tests/ops/test_simt_emulation.py`` runs the
    REAL CUDA source on the CPU (``scripts/emulate_cuda.py``; ``--check`` runs
    the full grid, K3 sizes, fp16 and draft vocabularies included) against the
    reference, with race, divergence and bounds checks, and shows that an
    injected race, a wrong index, a divergent barrier, a drafted token fed to
    ``markov_w1`` unmapped, a head drafted with e for v and a frozen rnn state
    are caught (gated/rnn heads are in its grid and in ``CUDA_CHECKS``). ``tests/ops/test_markov_cuda_compile.py``
    compiles the CUDA sources for sm_80/90/100/120 without spills and checks that
    a fast-math build stops. ``tests/ops/test_markov_cuda.py`` (GPU only) checks
    the CUDA op against the reference and an upstream-style dense loop; its
    checks live in ``tests/ops/markov_cases.py``, which ``scripts/gpu_check.py``
    runs without pytest or vLLM on a GPU machine (build, checks, K3 timings).
"""

from __future__ import annotations

import logging
import weakref
from typing import NamedTuple

import torch

from vllm_dspark.ops.markov_reference import (
    HEAD_TYPES,
    check_d2t,
    check_head,
    gumbel_noise,
    markov_draft_reference,
    markov_max_norms,
    markov_row_norms,
)

__all__ = [
    "MarkovDraftOutput",
    "markov_draft",
    "markov_draft_reference",
    "markov_row_norms",
    "markov_max_norms",
    "gumbel_noise",
    "check_d2t",
    "check_head",
    "HEAD_TYPES",
    "is_compiled_available",
]

logger = logging.getLogger(__name__)

_OP_NAME = "vllm_dspark::markov_draft"
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_load_error: str | None = None
_loaded: bool | None = None
_logged_reasons: set[str] = set()
# d2t tensors whose values were range-checked: id -> (weak ref, version, data_ptr, w1 rows). The
# weak ref is what makes the entry sound: a freed tensor's id and address are reused by new
# tensors (version 0 again), which a key of (address, version) would wrongly take as checked.
_checked_d2t: dict[int, tuple[weakref.ref, int, int, int]] = {}


class MarkovDraftOutput(NamedTuple):
    tokens: torch.Tensor                # [R, B] int64 (draft ids when d2t was given)
    conf: torch.Tensor                  # [R, B] fp32
    logits: torch.Tensor | None = None  # [R, B, V] fp32, when requested (draft ids with d2t)
    stats: torch.Tensor | None = None   # [R, B] int32 exact scores per row (compiled only)
    path: str = "compiled"              # which implementation ran: "compiled" or "reference"


def _load() -> bool:
    """Import ``vllm_dspark._C`` once (registers the op) and the fake impl."""
    global _loaded, _load_error
    if _loaded is not None:
        return _loaded
    try:
        import vllm_dspark._C  # noqa: F401  (static registration of the op)
    except ImportError as exc:
        _loaded, _load_error = False, f"vllm_dspark._C is not importable ({exc})"
        return False
    _loaded = True
    _register_fake()
    return True


def _register_fake() -> None:
    @torch.library.register_fake(_OP_NAME)
    def _markov_draft_fake(base_logits, anchor_ids, markov_w1, markov_w2, w2_row_norms,
                           conf_base, conf_w_markov, temperature, seeds,
                           out_tokens, out_conf, out_logits, out_stats,
                           max_norms=None, d2t=None, head_hidden=None, head_w=None, head_type=0):
        # Mutates its outputs in place; nothing to allocate or return.
        return None


def _has_kernel(device_type: str, op: str = _OP_NAME) -> bool:
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(op, key)


def is_compiled_available(device_type: str = "cpu") -> bool:
    """Whether the compiled op is loaded with a kernel for ``device_type``."""
    return _load() and _has_kernel(device_type)


def _why_not(base_logits: torch.Tensor, markov_w1: torch.Tensor, markov_w2: torch.Tensor,
             w2_row_norms: torch.Tensor) -> str | None:
    """The reason the compiled op cannot take this call, or None when it can."""
    if not _load():
        return _load_error
    dev = base_logits.device
    if not _has_kernel(dev.type):
        return f"no compiled markov_draft kernel for device {dev.type!r} (built without it)"
    if base_logits.dtype not in _FLOAT_DTYPES:
        return f"base_logits dtype {base_logits.dtype} is not fp32/bf16/fp16"
    if markov_w2.dtype not in _FLOAT_DTYPES or markov_w1.dtype != markov_w2.dtype:
        return (f"Markov weights must share one of fp32/bf16/fp16, got "
                f"{markov_w1.dtype} and {markov_w2.dtype}")
    if markov_w1.device != dev or markov_w2.device != dev or w2_row_norms.device != dev:
        return "base_logits, Markov weights and row norms are on different devices"
    if base_logits.shape[-1] >= 2 ** 31:
        return "vocab >= 2^31"
    return None


def _check_d2t_once(d2t: torch.Tensor, draft_vocab: int, w1_rows: int, device: torch.device) -> None:
    """``check_d2t`` with the value check once per tensor version (on a GPU it syncs). Inference
    tensors (vLLM loads under ``torch.inference_mode``) have no version counter: once per tensor."""
    check_d2t(d2t, draft_vocab, device=device)
    version = -1 if d2t.is_inference() else d2t._version
    entry = _checked_d2t.get(id(d2t))
    if entry is not None and entry[0]() is d2t and entry[1:] == (version, d2t.data_ptr(), w1_rows):
        return
    check_d2t(d2t, draft_vocab, w1_rows)
    if len(_checked_d2t) >= 16:
        _checked_d2t.clear()
    _checked_d2t[id(d2t)] = (weakref.ref(d2t), version, d2t.data_ptr(), w1_rows)


def _log_once(reason: str) -> None:
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.warning("markov_draft falls back to the PyTorch reference loop: %s", reason)


def markov_draft(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    w2_row_norms: torch.Tensor | None = None,
    conf_base: torch.Tensor | None = None,
    conf_w_markov: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    *,
    max_norms: torch.Tensor | None = None,
    d2t: torch.Tensor | None = None,
    head_hidden: torch.Tensor | None = None,
    head_w: torch.Tensor | None = None,
    head_type: int | str = 0,
    return_logits: bool = False,
    return_stats: bool = False,
    allow_fallback: bool = True,
) -> MarkovDraftOutput:
    """Draft one block per request with the Markov head; the confidence of every position.

    Parameters
    ----------
    base_logits : [R, B, V] fp32/bf16/fp16
        LM-head logits of the draft hidden states, one row per position (V: the
        draft vocabulary when ``d2t`` is given).
    anchor_ids : [R] int64
        Last accepted token per request (``prev`` of position 0), a target id.
    markov_w1, markov_w2 : [V, rank], same dtype
        Markov head: ``bias_j = markov_w2[j] . markov_w1[prev]``. With ``d2t``
        ``markov_w1`` is [V_target, rank], indexed by target ids.
    w2_row_norms : [V] fp32, optional
        ``markov_row_norms(markov_w2)``; compute once per model and pass it
        (computed here when omitted, which costs a full pass over ``markov_w2``).
    conf_base : [R, B] fp32, optional
        Confidence pre-activation from the hidden part (``proj_h . h_i + b``).
        None: no confidence head, every confidence is 1.
    conf_w_markov : [rank] fp32, optional
        Markov-embedding part of the confidence projection weight.
    temperature : [R] fp32, optional
        Per-request temperature; ``<= 0`` (or None) is greedy.
    seeds : [R] int64, optional
        Per-request seed of the Gumbel noise (mix the decoding step into it).
    max_norms : [2] fp32, optional
        ``markov_max_norms(markov_w1, w2_row_norms)``, once per model. Only the
        CUDA kernel uses it (recomputed per call when omitted: a pass over
        ``markov_w1``).
    d2t : [V] int64, optional
        Draft-vocabulary offsets (target id = draft id + d2t[draft id]); see the
        module docstring. Refused (``ValueError``) unless int64 [V] on the base
        logits' device with every mapped id inside ``markov_w1``.
    head_type : 0 / "vanilla" (default), 1 / "gated" or 2 / "rnn"
        The Markov head variant (see "Head variants" in the module docstring).
    head_hidden : [R, B, m] fp32, optional
        The head's part that reads the backbone's hidden rows, every position, bias
        included: gated ``Wg[:, :H] h + bg`` (m = rank), rnn ``Wj[:, 2 rank:] h + bj``
        (m = 3 rank). Only with a gated or rnn ``head_type``.
    head_w : fp32, optional
        The head's token-side weights: gated ``Wg[:, H:]`` [rank, rank], rnn
        ``Wj[:, :2 rank]`` [3 rank, 2 rank]. Refused (``ValueError``, naming the
        argument) on a wrong shape, dtype or device, as ``d2t`` is.
    return_logits : bool
        Also return the corrected fp32 logits [R, B, V] (dense path).
    return_stats : bool
        Also return [R, B] int32 exact scores evaluated per row (V = dense);
        only the compiled op reports it.
    allow_fallback : bool
        False raises instead of running the reference when the op can't run.

    Returns
    -------
    MarkovDraftOutput(tokens [R, B] int64, conf [R, B] fp32,
    logits [R, B, V] fp32 | None, stats [R, B] int32 | None, path "compiled" | "reference");
    tokens, logits and stats in draft ids when ``d2t`` is given.
    """
    R, B, V = base_logits.shape
    dev = base_logits.device
    if d2t is not None:
        _check_d2t_once(d2t, V, int(markov_w1.shape[0]), dev)
    head = check_head(head_type, head_hidden, head_w, R, B, int(markov_w2.shape[-1]), device=dev)
    if temperature is None:
        temperature = torch.zeros(R, dtype=torch.float32, device=dev)
    if seeds is None:
        seeds = torch.zeros(R, dtype=torch.int64, device=dev)
    if w2_row_norms is None:
        w2_row_norms = markov_row_norms(markov_w2)

    reason = _why_not(base_logits, markov_w1, markov_w2, w2_row_norms)
    if reason is None:
        tokens = torch.empty(R, B, dtype=torch.int64, device=dev)
        conf = torch.empty(R, B, dtype=torch.float32, device=dev)
        logits = (torch.empty(R, B, V, dtype=torch.float32, device=dev)
                  if return_logits else None)
        stats = torch.empty(R, B, dtype=torch.int32, device=dev) if return_stats else None
        torch.ops.vllm_dspark.markov_draft(
            base_logits, anchor_ids.to(torch.int64), markov_w1, markov_w2,
            w2_row_norms.to(torch.float32),
            None if conf_base is None else conf_base.to(torch.float32),
            None if conf_w_markov is None else conf_w_markov.to(torch.float32),
            temperature.to(torch.float32), seeds.to(torch.int64),
            tokens, conf, logits, stats,
            None if max_norms is None else max_norms.to(torch.float32), d2t,
            *((head_hidden, head_w, head) if head else ()))
        return MarkovDraftOutput(tokens, conf, logits, stats, "compiled")

    if not allow_fallback:
        raise RuntimeError(f"markov_draft: compiled op unavailable: {reason}")
    _log_once(reason)
    out = markov_draft_reference(
        base_logits, anchor_ids, markov_w1, markov_w2, conf_base, conf_w_markov,
        temperature, seeds, return_logits=return_logits, d2t=d2t, head_hidden=head_hidden, head_w=head_w,
        head_type=head)
    return MarkovDraftOutput(out[0], out[1], out[2] if return_logits else None, None, "reference")
