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

    @classmethod
    def build(cls, *, vocab: int, markov_w1: torch.Tensor | None, markov_w2: torch.Tensor | None,
              conf_weight: torch.Tensor | None = None, conf_bias: torch.Tensor | float | None = None,
              hidden_size: int | None = None, conf_with_markov: bool = False,
              device: torch.device | str | None = None, d2t: torch.Tensor | None = None) -> MarkovWeights:
        """From raw tensors as checkpoints and vLLM modules hold them.

        ``conf_weight`` is the projection's weight, [1, H (+ rank)] or [H (+ rank)];
        ``conf_with_markov`` says whether its tail reads the Markov embedding.
        ``d2t``: a draft vocabulary's offsets [Vd] (``vocab`` is then the TARGET vocabulary:
        ``markov_w1`` keeps ``vocab`` rows, ``markov_w2`` Vd); refused unless every mapped id
        lies in ``[0, vocab)``.
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
        norms = markov_row_norms(w2)
        return cls(w1, w2, norms, cw_h, bias, cw_m, has_markov, markov_max_norms(w1, norms), d2t)

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
                       conf_w_markov=mv(self.conf_w_markov), max_norms=mv(self.max_norms), d2t=mv(self.d2t))
