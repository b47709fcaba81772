"""The weights DSpark's sequential stage reads, in the form the Markov draft op takes.

The reference drafter, vLLM 0.32's V1 draft model and vLLM 0.33's V2 draft
model all build this one object after their weights are loaded:

* ``markov_w1`` / ``markov_w2`` [V, rank], trimmed to the real vocabulary
  (vLLM pads LM-head-like weights to a multiple of 64);
* ``w2_row_norms`` [V] fp32: the op's pruning bound (``markov_row_norms``);
* the confidence projection ``[h ; markov_w1[prev]] -> 1`` split into its
  parallel part (``conf_w_hidden``, ``conf_bias``: one GEMV over all rows) and
  its Markov part (``conf_w_markov``: applied per drafted token inside the op).

A drafter without a Markov head (the DFlash-style ablation) gets rank-1 zero
weights, so the op adds no bias and every row is its own argmax.

A gated or rnn head (``markov_head_type``) adds its projection, as the
checkpoint holds it: ``gate_weight`` [r, H + r] / ``gate_bias`` [r]
(``markov_head.gate_proj``) or ``joint_weight`` [3r, 2r + H] / ``joint_bias``
[3r] (``markov_head.joint_proj``). The heads (``spec_decode/common/heads.py``)
split them into the compiled op's ``head_hidden`` / ``head_w`` arguments.

A draft vocabulary (speculators' ``draft_vocab_size`` Vd < V) adds ``d2t``
int64 [Vd] offsets (target id = draft id + d2t[draft id]): ``markov_w2`` and
the norms then have Vd rows (the scored vocabulary, ``vocab``), ``markov_w1``
keeps the target's V rows (``target_vocab``), since its index is the previous
token as a target id.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vllm_dspark.ops.markov_reference import check_d2t, markov_max_norms, markov_row_norms


@dataclass(frozen=True)
class MarkovWeights:
    """What the op reads. Shapes: w1, w2 [V, rank]; norms [V] fp32; conf parts fp32.

    With a draft vocabulary: w2, norms [Vd], w1 [V, rank], ``d2t`` int64 [Vd] offsets."""

    markov_w1: torch.Tensor
    markov_w2: torch.Tensor
    w2_row_norms: torch.Tensor
    conf_w_hidden: torch.Tensor | None = None  # [H]
    conf_bias: float = 0.0
    conf_w_markov: torch.Tensor | None = None  # [rank]
    has_markov_head: bool = True
    max_norms: torch.Tensor | None = None  # [2] fp32: max ||w1_j||, max ||w2_j|| (the CUDA kernel's bound)
    d2t: torch.Tensor | None = None  # [Vd] int64 draft-to-target offsets, or None (draft ids are target ids)
    head_type: str = "vanilla"  # markov_head_type: "vanilla", "gated" or "rnn"
    gate_weight: torch.Tensor | None = None  # [r, H + r] gated: g = sigmoid(Wg [h ; e] + bg)
    gate_bias: torch.Tensor | None = None  # [r]
    joint_weight: torch.Tensor | None = None  # [3r, 2r + H] rnn: [a ; c ; o] = Wj [s ; e ; h] + bj
    joint_bias: torch.Tensor | None = None  # [3r]

    @classmethod
    def build(cls, *, vocab: int, markov_w1: torch.Tensor | None, markov_w2: torch.Tensor | None,
              conf_weight: torch.Tensor | None = None, conf_bias: torch.Tensor | float | None = None,
              hidden_size: int | None = None, conf_with_markov: bool = False,
              device: torch.device | str | None = None, d2t: torch.Tensor | None = None,
              markov_head_type: str | None = None, gate_weight: torch.Tensor | None = None,
              gate_bias: torch.Tensor | None = None, joint_weight: torch.Tensor | None = None,
              joint_bias: torch.Tensor | None = None) -> MarkovWeights:
        """From raw tensors as checkpoints and vLLM modules hold them.

        ``conf_weight`` is the projection's weight, [1, H (+ rank)] or [H (+ rank)];
        ``conf_with_markov`` says whether its tail reads the Markov embedding.
        ``d2t``: a draft vocabulary's offsets [Vd] (``vocab`` is then the TARGET vocabulary:
        ``markov_w1`` keeps ``vocab`` rows, ``markov_w2`` Vd); refused unless every mapped id
        lies in ``[0, vocab)``.
        ``markov_head_type``: "vanilla", "gated" (needs ``gate_weight`` [r, H + r], ``gate_bias``
        [r]) or "rnn" (needs ``joint_weight`` [3r, 2r + H], ``joint_bias`` [3r]); None infers it
        from which projection is given. A wrong shape is refused naming the checkpoint tensor.
        """
        has_markov = markov_w1 is not None and markov_w2 is not None
        draft_vocab = vocab if d2t is None else int(d2t.numel())
        if has_markov:
            assert markov_w1 is not None and markov_w2 is not None
            if markov_w1.shape[0] < vocab or markov_w2.shape[0] < draft_vocab:
                raise ValueError(f"Markov weights have {markov_w1.shape[0]}/{markov_w2.shape[0]} rows, fewer "
                                 f"than the vocabulary ({vocab}/{draft_vocab})")
            w1 = markov_w1[:vocab].contiguous()
            w2 = markov_w2[:draft_vocab].contiguous()
        else:
            dev = device if device is not None else (conf_weight.device if conf_weight is not None else "cpu")
            w1 = torch.zeros(vocab, 1, device=dev)
            w2 = torch.zeros(draft_vocab, 1, device=dev)
        if d2t is not None:
            check_d2t(d2t, draft_vocab, vocab)
            d2t = d2t.to(w2.device).contiguous()
        cw_h = cw_m = None
        bias = 0.0
        if conf_weight is not None:
            w = conf_weight.detach().float().reshape(-1)
            h = hidden_size if hidden_size is not None else w.numel() - (w1.shape[1] if conf_with_markov else 0)
            cw_h = w[:h].contiguous()
            cw_m = w[h:].contiguous() if conf_with_markov else None
            if cw_m is not None and cw_m.numel() != w1.shape[1]:
                raise ValueError(f"confidence projection has {cw_m.numel()} Markov inputs, the Markov head "
                                 f"rank is {w1.shape[1]}")
            if conf_bias is not None:
                bias = float(conf_bias.detach().float().reshape(-1)[0]) if torch.is_tensor(conf_bias) \
                    else float(conf_bias)
        head_type, extra = _head_projection(
            markov_head_type, has_markov, int(w1.shape[1]), hidden_size if hidden_size is not None else
            (cw_h.numel() if cw_h is not None else None), gate_weight, gate_bias, joint_weight, joint_bias)
        norms = markov_row_norms(w2)
        return cls(w1, w2, norms, cw_h, bias, cw_m, has_markov, markov_max_norms(w1, norms), d2t, head_type, **extra)

    @property
    def vocab(self) -> int:
        """The vocabulary the head scores (base logits, ``markov_w2``, the op's tokens): Vd with ``d2t``."""
        return int(self.markov_w2.shape[0])

    @property
    def target_vocab(self) -> int:
        """``markov_w1``'s rows: the ids a previous token (or an anchor) can have an embedding for."""
        return int(self.markov_w1.shape[0])

    @property
    def rank(self) -> int:
        return int(self.markov_w2.shape[1])

    @property
    def has_confidence_head(self) -> bool:
        return self.conf_w_hidden is not None

    def confidence_base(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Parallel part of the confidence pre-activation: [..., H] -> [...] fp32 (None without a head)."""
        if self.conf_w_hidden is None:
            return None
        w = self.conf_w_hidden if self.conf_w_hidden.device == hidden.device else self.conf_w_hidden.to(hidden.device)
        return hidden.float() @ w + self.conf_bias

    def without_bias(self) -> MarkovWeights:
        """The ablation: no Markov bias; the confidence head keeps its real Markov input."""
        w2 = torch.zeros_like(self.markov_w2)
        norms = torch.zeros_like(self.w2_row_norms)
        return replace(self, markov_w2=w2, w2_row_norms=norms, max_norms=markov_max_norms(self.markov_w1, norms))

    def to(self, device: torch.device | str) -> MarkovWeights:
        def mv(t):
            return None if t is None else t.to(device)
        return replace(self, markov_w1=self.markov_w1.to(device), markov_w2=self.markov_w2.to(device),
                       w2_row_norms=self.w2_row_norms.to(device), conf_w_hidden=mv(self.conf_w_hidden),
                       conf_w_markov=mv(self.conf_w_markov), max_norms=mv(self.max_norms), d2t=mv(self.d2t),
                       gate_weight=mv(self.gate_weight), gate_bias=mv(self.gate_bias),
                       joint_weight=mv(self.joint_weight), joint_bias=mv(self.joint_bias))


# head -> (checkpoint name, rows / r, columns besides H / r, the shape as written)
_PROJ = {"gated": ("markov_head.gate_proj", 1, 1, "[r, H + r]"),
         "rnn": ("markov_head.joint_proj", 3, 2, "[3r, 2r + H]")}


def _head_projection(head_type: str | None, has_markov: bool, rank: int, hidden: int | None,
                     gate_w: torch.Tensor | None, gate_b: torch.Tensor | None, joint_w: torch.Tensor | None,
                     joint_b: torch.Tensor | None) -> tuple[str, dict[str, torch.Tensor]]:
    """The head type and its projection's fields, every shape checked against the rank (and H when known)."""
    given = {"gated": (gate_w, gate_b), "rnn": (joint_w, joint_b)}
    present = [k for k, (w, b) in given.items() if w is not None or b is not None]
    if head_type is None:
        if len(present) > 1:
            raise ValueError("both markov_head.gate_proj and markov_head.joint_proj were given; a Markov head is "
                             "gated or rnn, not both: pass markov_head_type")
        head_type = present[0] if present else "vanilla"
    if head_type not in ("vanilla", "gated", "rnn"):
        raise ValueError(f"markov_head_type: got {head_type!r}, expected 'vanilla', 'gated' or 'rnn'")
    stray = [k for k in present if k != head_type]
    if stray:
        raise ValueError(f"{_PROJ[stray[0]][0]} was given but markov_head_type is {head_type!r}; that tensor "
                         f"belongs to a {stray[0]!r} head: check markov_head_type against how the drafter was trained")
    if head_type == "vanilla":
        return head_type, {}
    if not has_markov:
        raise ValueError(f"markov_head_type {head_type!r} needs markov_w1 / markov_w2 (a Markov head to "
                         f"{'gate' if head_type == 'gated' else 'drive'}), but none were given")
    name, rows, extra, form = _PROJ[head_type]
    w, b = given[head_type]
    if w is None or b is None:
        which = "weight" if w is None else "bias"
        raise ValueError(f"{name}.{which}: missing; markov_head_type is {head_type!r}, whose head needs it")
    h = int(w.shape[1]) - extra * rank if w.dim() == 2 else -1
    if w.dim() != 2 or w.shape[0] != rows * rank or h <= 0 or (hidden is not None and h != hidden):
        cols = f"{hidden + extra * rank}" if hidden is not None else f"H + {extra * rank}"
        raise ValueError(f"{name}.weight: got {list(w.shape)}, expected {form} = [{rows * rank}, {cols}] "
                         f"(markov_rank r = {rank}, hidden size H = {hidden if hidden is not None else '?'}); "
                         "check markov_rank, hidden_size and markov_head_type against the checkpoint")
    if tuple(b.shape) != (rows * rank,):
        raise ValueError(f"{name}.bias: got {list(b.shape)}, expected [{rows * rank}] ({form.split(',')[0][1:]} "
                         f"with markov_rank r = {rank})")
    w, b = w.detach().contiguous(), b.detach().contiguous()
    return head_type, ({"gate_weight": w, "gate_bias": b} if head_type == "gated" else
                       {"joint_weight": w, "joint_bias": b})
