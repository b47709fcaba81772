"""The Markov draft stage as the obvious PyTorch loop: the golden semantics.

This module defines what ``vllm_dspark.ops.markov_draft`` computes. The compiled
op (``csrc/``) must propose exactly the tokens this loop proposes; the reference
drafter imports it so that the model code and the kernel share one definition.

Semantics (per request ``r``, left to right over the block's positions)::

    prev = anchor_ids[r]                                    # a row of markov_w1
    for i in range(block):
        e      = fp32(markov_w1[prev]) if 0 <= prev < len(markov_w1) else 0  # [rank]
        bias   = fp32(fp64(e) @ fp64(markov_w2).T)                      # [vocab]
        logits = fp32(base_logits[r, i]) + bias                         # fp32 add
        if temperature[r] <= 0:  token = argmax(logits)                 # greedy
        else:                    token = argmax(logits / T + g(seed, i)) # fp32 ops
                                 # (argmax: ties -> lowest id, NaN ranks below -inf)
        z      = fp64(conf_base[r, i]) + fp64(e) . fp64(conf_w_markov)
        conf   = fp32(sigmoid(z))                                       # fp64 sigmoid
        prev   = token if d2t is None else token + d2t[token]          # target id

* ``argmax`` breaks ties towards the LOWEST token id (as ``torch.argmax``).
* NaN policy: a NaN score ranks below every other score, ``-inf`` included,
  so NaN is never proposed while the row holds anything else; a row of only
  NaN proposes token 0 (``torch.argmax`` would instead return the first NaN).
* The Markov bias is accumulated in fp64 and rounded once to fp32. That makes it
  independent of the summation order of whatever BLAS or kernel computes it, so
  the compiled op can reproduce it token for token.
* ``g(seed, i)`` is Gumbel noise from a counter-based hash, see
  :func:`gumbel_noise`; it is identical on every device and in the kernels.
* The confidence of position ``i`` uses the embedding of the PREVIOUS token
  (the anchor for ``i == 0``). Without a confidence head every confidence is 1.
* How many drafts are verified is not this stage's: the callers decide it
  from the confidences (``spec_decode/common/verify.py``, the budget; the
  reference drafter applies DSpark's threshold rule itself).
* ``-inf`` base logits are allowed (a row of only ``-inf`` proposes token 0).
* Anchor policy: an anchor outside ``[0, len(markov_w1))`` has no Markov
  embedding: position 0 uses ``e = 0`` (no bias, and the confidence's Markov
  part is 0); later positions are drafted normally. Nothing reads out of bounds
  and no device-to-host check is needed, so padded or garbage rows are harmless.
* Head variants (``head_type``: 0 vanilla, 1 gated, 2 rnn; ``spec_decode/common/heads.py``):
  the bias is ``markov_w2 @ v`` with ``v`` computed from ``e`` (and, rnn, a state ``s``
  carried along the block, zero at its start). The parts that read the backbone's
  hidden rows do not depend on the drafted tokens, so the caller precomputes them for
  every position: ``head_hidden`` [R, B, m] fp32 and the token-side weights ``head_w``::

      gated (m = r, head_w [r, r]):
          g = sigmoid(fp64(head_hidden[r, i]) + fp64(head_w) @ fp64(e))       # fp64
          v = fp32(g * fp64(e))
      rnn (m = 3r, head_w [3r, 2r]; s = 0 before position 0):
          [a ; c ; o] = fp64(head_hidden[r, i]) + fp64(head_w) @ [s ; fp64(e)] # fp64
          s = sigmoid(a) * s + (1 - sigmoid(a)) * tanh(c)                      # fp64 state
          v = fp32(tanh(o))
      bias = fp32(fp64(v) @ fp64(markov_w2).T)     # as the vanilla bias, with v for e

  ``v`` is rounded once to fp32 (an embedding like ``e``) and the state stays fp64, so
  the twins reproduce the reference up to fp64 summation order and libm, which reach a
  token only through an fp32 rounding of ``v`` or of the bias. ``|g| <= 1`` gives
  ``||v|| <= ||e||`` and ``|tanh| <= 1`` gives ``||v|| <= sqrt(r)``: the bounds the
  compiled op prunes with (it uses the actual ``||v||`` per row). The confidence's Markov
  input stays ``e`` for every head. ``head_bias`` (a callable) is the older, Python-only
  way to hand in a head's bias (the reference drafter's modules).
* Draft vocabulary (``d2t`` given, int64 [Vd] offsets): base logits, ``markov_w2``,
  tokens and logits are in draft ids ``[0, Vd)``; ``markov_w1`` [V, rank] is
  indexed by TARGET ids, so the anchor is a target id and each drafted token
  reaches the next position's ``markov_w1`` as ``token + d2t[token]``. A mapped
  id outside ``markov_w1`` is treated like a bad anchor (``check_d2t`` refuses
  such maps at load time). ``d2t=None`` is the identity (Vd == V).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "MASK32",
    "mix32",
    "gumbel_hash",
    "gumbel_noise",
    "markov_row_norms",
    "markov_max_norms",
    "markov_draft_reference",
    "markov_recurrence",
    "embed_prev",
    "check_d2t",
    "d2t_target_ids",
    "d2t_of_target_ids",
    "HEAD_TYPES",
    "head_type_code",
    "check_head",
    "head_stepper",
]

MASK32 = 0xFFFFFFFF
# Constants of the counter-based hash (shared with csrc/markov_common.h).
_GOLDEN = 0x9E3779B9
_MIX_C1 = 0x7FEB352D
_MIX_C2 = 0x846CA68B
_J_STEP = 0x9E3779B1
_TWO_M32 = 2.0 ** -32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 ``x`` in [0, 2^32) without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """32-bit integer finaliser on int64 tensors holding values in [0, 2^32).

    ``x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16``
    (all mod 2^32), bit-identical to ``dspark_mix32`` in ``csrc/markov_common.h``.
    """
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_C2)
    x = x ^ (x >> 16)
    return x


def _row_key(seeds: torch.Tensor, position: int) -> torch.Tensor:
    """Per (request, position) 32-bit key. ``seeds``: int64 [R] -> int64 [R]."""
    s = seeds.to(torch.int64)
    lo = s & MASK32
    hi = (s >> 32) & MASK32
    k = mix32(lo ^ _GOLDEN)
    k = mix32(k ^ hi)
    return mix32(k ^ (int(position) & MASK32))


def gumbel_hash(seeds: torch.Tensor, position: int, vocab: int) -> torch.Tensor:
    """32-bit hash ``h[r, j]`` of (seed[r], position, token j) as int64 [R, vocab].

    ``key = mix32(mix32(mix32(lo32(seed) ^ 0x9e3779b9) ^ hi32(seed)) ^ position)``
    and ``h[j] = mix32(key ^ (j * 0x9e3779b1 mod 2^32))``.
    """
    key = _row_key(seeds, position)  # [R]
    j = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    jj = (j * _J_STEP) & MASK32  # j < 2^31 keeps the product inside int64
    return mix32(key[:, None] ^ jj[None, :])


def gumbel_noise(seeds: torch.Tensor, position: int, vocab: int) -> torch.Tensor:
    """Gumbel noise for block position ``position``: fp32 [R, vocab].

    ``u = (h + 0.5) * 2^-32`` (exact in fp64), ``g = fp32(-log(-log(u)))``
    evaluated in fp64 and rounded once to fp32.
    """
    h = gumbel_hash(seeds, position, vocab)
    u = (h.to(torch.float64) + 0.5) * _TWO_M32
    return (-torch.log(-torch.log(u))).to(torch.float32)


def _argmax_nan_last(scores: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax with ties to the lowest id and NaN ranked below -inf."""
    nan = torch.isnan(scores)
    if not bool(nan.any()):
        return torch.argmax(scores, dim=-1)
    s = scores.masked_fill(nan, float("-inf"))
    tok = torch.argmax(s, dim=-1)
    # Rows whose best is -inf: the first non-NaN entry (index 0 if all are NaN).
    first_valid = (~nan).to(torch.uint8).argmax(dim=-1)
    only_ninf = s.gather(1, tok[:, None])[:, 0] == float("-inf")
    return torch.where(only_ninf, first_valid, tok)


def markov_max_norms(markov_w1: torch.Tensor, w2_row_norms: torch.Tensor) -> torch.Tensor:
    """``[max_j ||markov_w1[j]||, max_j w2_row_norms[j]]`` as fp32 [2] (same device).

    The CUDA kernel bounds every Markov bias by the product of the two without
    knowing the previous token, which lets it look at all block positions at
    once. Compute once per loaded model (like ``w2_row_norms``) and pass it as
    ``max_norms``; without it the CUDA op recomputes it each call (a pass over
    ``markov_w1``). The w1 maximum is rounded UP by 1e-6 relative so that the
    fp64 norm of any row stays below it.
    """
    w1n = markov_row_norms(markov_w1).to(torch.float64).max() * (1.0 + 1e-6)
    w2n = w2_row_norms.to(torch.float64).max()
    return torch.stack([w1n, w2n]).to(torch.float32)


def markov_row_norms(markov_w2: torch.Tensor) -> torch.Tensor:
    """``||markov_w2[j]||_2`` for every token, fp32 [vocab] (fp64 accumulation).

    Compute once per loaded model and pass to ``markov_draft``; the pruning
    bound relies on these being accurate to ~1e-6 relative.
    """
    out = torch.empty(markov_w2.shape[0], dtype=torch.float32, device=markov_w2.device)
    chunk = 16384  # bounds the fp64 temporary
    for s in range(0, markov_w2.shape[0], chunk):
        w = markov_w2[s:s + chunk].to(torch.float64)
        out[s:s + chunk] = torch.linalg.vector_norm(w, dim=1).to(torch.float32)
    return out


class _Bias:
    """fp32(fp64(e) @ fp64(markov_w2).T): the Markov bias, summation-order free.

    ``markov_w2`` is widened to fp64 once per call (in chunks when large).
    """

    _WHOLE_LIMIT = 1 << 30  # bytes of fp64 copy kept whole

    def __init__(self, markov_w2: torch.Tensor):
        self.w2 = markov_w2
        self.w64 = (markov_w2.to(torch.float64)
                    if markov_w2.numel() * 8 <= self._WHOLE_LIMIT else None)

    def __call__(self, e: torch.Tensor) -> torch.Tensor:  # [R, rank] -> [R, V]
        e64 = e.to(torch.float64)
        if self.w64 is not None:
            return (e64 @ self.w64.T).to(torch.float32)
        out = torch.empty(e.shape[0], self.w2.shape[0], dtype=torch.float32, device=e.device)
        chunk = 16384
        for s in range(0, self.w2.shape[0], chunk):
            w = self.w2[s:s + chunk].to(torch.float64)
            out[:, s:s + chunk] = (e64 @ w.T).to(torch.float32)
        return out


def embed_prev(markov_w1: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """The vanilla head's embedding of the previous token: fp32 ``markov_w1[prev]`` [R, rank], zero for
    ids outside ``[0, len(markov_w1))`` (the anchor policy: no bias, no Markov part of the confidence).
    ``prev`` are target ids (``markov_w1``'s rows), also with a draft vocabulary."""
    v = markov_w1.shape[0]
    valid = (prev >= 0) & (prev < v)
    e = markov_w1[prev.clamp(0, v - 1)].to(torch.float32)
    return torch.where(valid[:, None], e, torch.zeros_like(e))


def d2t_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of every draft id, ``arange(Vd) + d2t`` (int64 [Vd])."""
    return torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t


def d2t_of_target_ids(target_ids: torch.Tensor) -> torch.Tensor:
    """The ``d2t`` offsets that map draft id j to ``target_ids[j]`` (the inverse of :func:`d2t_target_ids`)."""
    return target_ids - torch.arange(target_ids.numel(), dtype=target_ids.dtype, device=target_ids.device)


def check_d2t(d2t: object, draft_vocab: int, target_vocab: int | None = None, *,
              device: torch.device | None = None) -> None:
    """Refuse a draft-vocabulary map the op cannot take, naming what is wrong (``ValueError``).

    ``d2t`` must be an int64 [draft_vocab] tensor of OFFSETS (target id = draft id + d2t[draft id]),
    on ``device`` when given. With ``target_vocab`` (the rows of ``markov_w1``) every mapped id must
    also lie in ``[0, target_vocab)``: that reads the values, a host sync on a GPU, so loaders check
    it once; the op itself never reads out of bounds (a mapped id outside gets no embedding).
    """
    if not isinstance(d2t, torch.Tensor):
        raise ValueError(f"d2t must be a tensor of int64 offsets, got {type(d2t).__name__}")
    if d2t.dtype != torch.int64:
        raise ValueError(f"d2t must be int64 (offsets: target id = draft id + d2t[draft id]), got {d2t.dtype}")
    if d2t.dim() != 1 or d2t.numel() != draft_vocab:
        raise ValueError(f"d2t must be 1-D with one offset per draft token, [{draft_vocab}] (the draft "
                         f"vocabulary: base logits' last dim, markov_w2's rows), got {list(d2t.shape)}")
    if device is not None and d2t.device != torch.device(device):
        raise ValueError(f"d2t is on {d2t.device} but the base logits are on {device}")
    if target_vocab is None or draft_vocab == 0:
        return
    tgt = d2t_target_ids(d2t)
    bad = (tgt < 0) | (tgt >= target_vocab)
    if bool(bad.any()):
        idx = bad.nonzero().flatten()[:3].tolist()
        pairs = ", ".join(f"{j} -> {int(tgt[j])}" for j in idx)
        raise ValueError(f"d2t maps {int(bad.sum())} draft ids outside the target vocabulary [0, {target_vocab}) "
                         f"(markov_w1's rows), e.g. {pairs}; d2t holds offsets, not target ids")


HEAD_TYPES = ("vanilla", "gated", "rnn")  # the op's head_type codes 0, 1, 2


def head_type_code(head_type: int | str) -> int:
    """``head_type`` as the op's int code (0 vanilla, 1 gated, 2 rnn); accepts the names too."""
    if isinstance(head_type, str):
        if head_type not in HEAD_TYPES:
            raise ValueError(f"head_type must be one of {HEAD_TYPES} (or 0, 1, 2), got {head_type!r}")
        return HEAD_TYPES.index(head_type)
    if isinstance(head_type, bool) or not isinstance(head_type, int) or not 0 <= head_type < len(HEAD_TYPES):
        raise ValueError(f"head_type must be 0 (vanilla), 1 (gated) or 2 (rnn), got {head_type!r}")
    return int(head_type)


def head_shapes(code: int, num_reqs: int, block: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(head_hidden's shape, head_w's shape) of head ``code`` (1 gated, 2 rnn)."""
    if code == 1:
        return (num_reqs, block, rank), (rank, rank)
    return (num_reqs, block, 3 * rank), (3 * rank, 2 * rank)


def check_head(head_type: int | str, head_hidden: object, head_w: object, num_reqs: int, block: int, rank: int,
               *, device: torch.device | None = None) -> int:
    """Refuse head arguments the op cannot take, naming the argument (``ValueError``); returns the code.

    Vanilla (0) takes neither tensor. Gated (1): ``head_hidden`` [R, B, r], ``head_w`` [r, r]; rnn (2):
    ``head_hidden`` [R, B, 3r], ``head_w`` [3r, 2r]; both fp32, on ``device`` when given.
    """
    code = head_type_code(head_type)
    if code == 0:
        given = [n for n, t in (("head_hidden", head_hidden), ("head_w", head_w)) if t is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} given but head_type is 0 (vanilla), which reads neither; "
                             "pass head_type=1 (gated) or 2 (rnn)")
        return 0
    name = HEAD_TYPES[code]
    hh_shape, w_shape = head_shapes(code, num_reqs, block, rank)
    for arg, t, shape, what in (("head_hidden", head_hidden, hh_shape, "the hidden part of every position"),
                                ("head_w", head_w, w_shape, "the token-side weights")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"head_type {code} ({name}) needs {arg} ({what}, fp32 {list(shape)}), got "
                             f"{type(t).__name__}")
        if t.dtype != torch.float32:
            raise ValueError(f"{arg} must be fp32 for the {name} head, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{arg} must be {list(shape)} for the {name} head (R={num_reqs}, B={block}, "
                             f"rank={rank}), got {list(t.shape)}")
        if device is not None and t.device != torch.device(device):
            raise ValueError(f"{arg} is on {t.device} but the base logits are on {device}")
    return code


def head_stepper(head_type: int | str, head_hidden: torch.Tensor | None, head_w: torch.Tensor | None,
                 markov_w2: torch.Tensor) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """The bias of one block per row as ``(position i, e [R, r] fp32) -> [R, V] fp32``, called for
    i = 0, 1, ... in order (the module docstring's head formulas; a new stepper is a new block)."""
    code = head_type_code(head_type)
    bias_of = _Bias(markov_w2)
    if code == 0:
        return lambda i, e: bias_of(e)
    assert head_hidden is not None and head_w is not None
    hh = head_hidden.to(torch.float64)  # [R, B, m]
    w = head_w.to(device=hh.device, dtype=torch.float64)
    if code == 1:
        def gated(i: int, e: torch.Tensor) -> torch.Tensor:
            e64 = e.to(torch.float64)
            g = torch.sigmoid(hh[:, i] + e64 @ w.T)  # [R, r]
            return bias_of((g * e64).to(torch.float32))
        return gated
    rank = int(w.shape[1]) // 2
    state = [torch.zeros(hh.shape[0], rank, dtype=torch.float64, device=hh.device)]  # s_{-1} = 0
    last = [-1]

    def rnn(i: int, e: torch.Tensor) -> torch.Tensor:
        if i != last[0] + 1:
            raise RuntimeError(f"the rnn head's state runs left to right: position {i} after {last[0]}")
        last[0] = i
        s = state[0]
        a, c, o = (hh[:, i] + torch.cat([s, e.to(torch.float64)], dim=-1) @ w.T).split(rank, dim=-1)
        g = torch.sigmoid(a)
        state[0] = g * s + (1.0 - g) * torch.tanh(c)
        return bias_of(torch.tanh(o).to(torch.float32))
    return rnn


def markov_recurrence(base_logits: torch.Tensor, anchor_ids: torch.Tensor,
                      embed: Callable[[torch.Tensor], torch.Tensor],
                      bias: Callable[[int, torch.Tensor], torch.Tensor],
                      pick: Callable[[int, torch.Tensor], torch.Tensor], out_tokens: torch.Tensor,
                      out_conf: torch.Tensor, conf_base: torch.Tensor | None = None,
                      conf_w_markov: torch.Tensor | None = None, d2t: torch.Tensor | None = None) -> None:
    """DSpark's sequential stage, left to right: the one place its recurrence is written in Python.

    For each position ``i``: ``e = embed(prev)``, ``logits = fp32(base[:, i]) + bias(i, e)``,
    ``token = pick(i, logits)``, the confidence from ``conf_base[:, i]`` and ``e``, then
    ``prev = token`` (``token + d2t[token]`` with a draft vocabulary: ``embed`` takes target
    ids). The reference (greedy argmax or a Gumbel draw) and the sampled path
    (``spec_decode/common/draft_sampling.py``: top-k/top-p, the exact q) differ only in
    ``pick``; a head variant differs only in ``embed`` and ``bias``.

    ``bias`` is called once per position, in order, with the position: a head whose bias reads
    the position's hidden row (gated) or a state carried along the block (rnn) keeps both in
    the closure it hands in, so one call of this function is one block per row and a fresh
    closure starts every row's state afresh. The confidence's Markov input is ``e`` (the
    previous token's ``markov_w1`` row) for every head.

    Parameters
    ----------
    base_logits : [R, B, V] base logits per position (V: the draft vocabulary when ``d2t`` is given)
    anchor_ids : [R] int64, ``prev`` of position 0 (a target id)
    embed : [R] int64 previous tokens (target ids) -> [R, rank] fp32
    bias : (position, [R, rank] e) -> [R, V] fp32 Markov bias
    pick : (position, [R, V] fp32 corrected logits) -> [R] int64 tokens
    out_tokens : [R, B] int64, written; out_conf : [R, B] fp32, written where ``conf_base`` is given
    conf_base : [R, B] fp32 or None; conf_w_markov : [rank] fp32 or None
    d2t : [V] int64 draft-to-target offsets, or None (identity); ``out_tokens`` stays in draft ids
    """
    prev = anchor_ids.to(torch.int64)
    for i in range(base_logits.shape[1]):
        e = embed(prev)  # [R, rank] fp32
        logits = base_logits[:, i].to(torch.float32) + bias(i, e)  # [R, V]
        tok = pick(i, logits)
        out_tokens[:, i] = tok
        if conf_base is not None:
            z = conf_base[:, i].to(torch.float64)
            if conf_w_markov is not None:
                z = z + e.to(torch.float64) @ conf_w_markov.to(torch.float64)
            out_conf[:, i] = torch.sigmoid(z).to(torch.float32)
        prev = tok if d2t is None else tok + d2t[tok]


def markov_draft_reference(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    conf_base: torch.Tensor | None = None,
    conf_w_markov: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    return_logits: bool = False,
    d2t: torch.Tensor | None = None,
    head_bias: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    head_hidden: torch.Tensor | None = None,
    head_w: torch.Tensor | None = None,
    head_type: int | str = 0,
):
    """The obvious sequential loop (see the module docstring for the semantics).

    Parameters
    ----------
    base_logits : [R, B, V] bf16/fp16/fp32, target-LM-head logits per position.
    anchor_ids : [R] int64, last accepted token of each request (a target id).
    markov_w1, markov_w2 : [V, rank], Markov head weights (with ``d2t``: markov_w1 [V_target, rank]).
    conf_base : [R, B] fp32 or None, confidence pre-activation of the hidden part
        (``proj_h . h_i + bias``). None: no confidence head (confidences are 1).
    conf_w_markov : [rank] fp32 or None, Markov part of the confidence weight.
    temperature : [R] fp32 or None (greedy); ``<= 0`` means greedy for that request.
    seeds : [R] int64 or None (zeros).
    return_logits : also return the corrected fp32 logits [R, B, V]
        (base + bias, before temperature and noise).
    d2t : [V] int64 draft-vocabulary offsets or None (see the module docstring);
        tokens and logits stay in draft ids.
    head_hidden, head_w, head_type : the head variant, as the compiled op takes it (0 vanilla,
        1 gated, 2 rnn; see the module docstring; ``check_head`` for the shapes).
    head_bias : a head's per-block bias, ``(position, e [R, rank]) -> [R, V]`` fp32, in place of
        the one ``head_type`` defines (Python only: the reference drafter's modules).

    Returns
    -------
    tokens : [R, B] int64, conf : [R, B] fp32
    (and logits : [R, B, V] fp32 when ``return_logits``).
    """
    R, B, V = base_logits.shape
    dev = base_logits.device
    if temperature is None:
        temperature = torch.zeros(R, dtype=torch.float32, device=dev)
    if seeds is None:
        seeds = torch.zeros(R, dtype=torch.int64, device=dev)
    temperature = temperature.to(torch.float32)
    sampled = temperature > 0  # [R]
    safe_t = torch.where(sampled, temperature, torch.ones_like(temperature))

    tokens = torch.empty(R, B, dtype=torch.int64, device=dev)
    conf = torch.ones(R, B, dtype=torch.float32, device=dev)
    all_logits = (torch.empty(R, B, V, dtype=torch.float32, device=dev)
                  if return_logits else None)

    code = check_head(head_type, head_hidden, head_w, R, B, int(markov_w2.shape[1]))
    bias = head_bias if head_bias is not None else head_stepper(code, head_hidden, head_w, markov_w2)

    def pick(i: int, logits: torch.Tensor) -> torch.Tensor:
        if all_logits is not None:
            all_logits[:, i] = logits
        scores = logits
        if bool(sampled.any()):
            noisy = logits / safe_t[:, None] + gumbel_noise(seeds, i, V)
            scores = torch.where(sampled[:, None], noisy, logits)
        return _argmax_nan_last(scores)  # first maximal index on ties

    markov_recurrence(base_logits, anchor_ids, lambda prev: embed_prev(markov_w1, prev), bias, pick,
                      tokens, conf, conf_base, conf_w_markov, d2t)

    if return_logits:
        return tokens, conf, all_logits
    return tokens, conf
