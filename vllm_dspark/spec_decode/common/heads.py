"""DSpark's Markov head variants: what the sequential stage adds to each position's base logits.

With ``e_k = markov_w1[x_{k-1}]`` (``x_{-1}`` the anchor; target ids) and ``h_k`` the
backbone's final-normed hidden row of draft position ``k``, the bias over the
(draft) vocabulary is ``markov_w2 @ v_k`` where ``v_k`` is

* vanilla: ``e_k``;
* gated: ``sigmoid(Wg [h_k ; e_k] + bg) * e_k`` (``markov_head.gate_proj``, Wg [r, H + r]);
* rnn: ``tanh(o_k)`` with ``[a ; c ; o] = Wj [s_{k-1} ; e_k ; h_k] + bj`` (``markov_head.joint_proj``,
  Wj [3r, 2r + H], split in that order), ``s_k = sigmoid(a) * s_{k-1} + (1 - sigmoid(a)) * tanh(c)``,
  ``s_{-1} = 0``: the state runs along one block and starts at zero in every block.

Every head exposes ``embed(prev)`` (``e``, which is also the confidence head's Markov
input, for every head, as DeepSpec's ``predict_confidence_step`` reads it) and
``start(hidden)``: the bias of one block per row as a stepper ``(k, e_k) -> [R, V]``
that ``ops.markov_reference.markov_recurrence`` calls left to right. A stepper holds
the block's hidden rows and, for rnn, the state: a new ``start`` is a new block.

Numerics: the gate and the recurrence are evaluated in fp64 and the bias is rounded
once to fp32, like the vanilla bias (the op's contract), so a future kernel can
match it token for token. **The compiled op (``markov_draft``) takes vanilla heads
only**; :class:`~vllm_dspark.spec_decode.common.drafts.MarkovStage` drafts gated
and rnn heads through the Python recurrence (its ``path`` says ``"reference-gated"``
or ``"reference-rnn"``), and V2's one-op path refuses them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_dspark.model.markov_weights import MarkovWeights
from vllm_dspark.ops.markov_reference import embed_prev

BiasStep = Callable[[int, torch.Tensor], torch.Tensor]  # (position k, e_k [R, r] fp32) -> bias [R, V] fp32


class VanillaHead:
    """``b = markov_w2 @ markov_w1[prev]``: DSpark's vanilla Markov head.

    ``embed`` and ``start`` are what the shared recurrence calls; ``row_norms``
    and ``max_norms`` are the bound the op prunes with (Cauchy-Schwarz on
    ``markov_w2[j] . e``), which a head the op takes must restate for its own bias.
    """

    kind = "vanilla"
    needs_hidden = False  # the bias does not read the backbone's hidden rows

    def __init__(self, weights: MarkovWeights):
        self.weights = weights

    def embed(self, prev: torch.Tensor) -> torch.Tensor:  # [R] target ids -> [R, rank] fp32
        return embed_prev(self.weights.markov_w1, prev)

    def bias_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """[R, rank] -> [R, V] fp32 bias, accumulated in fp64 (the op's contract). ``markov_w2`` is
        widened once per call of the stage, not kept: at K3's size the fp64 copy is 335 MB."""
        w2 = self.weights.markov_w2.to(torch.float64)
        return lambda v: (v.double() @ w2.T).float()

    def start(self, hidden: torch.Tensor | None = None) -> BiasStep:
        """One block per row; the vanilla bias reads neither the position nor ``hidden``."""
        bias = self.bias_fn()
        return lambda k, e: bias(e)

    @property
    def row_norms(self) -> torch.Tensor:
        return self.weights.w2_row_norms

    @property
    def max_norms(self) -> torch.Tensor | None:
        return self.weights.max_norms


class _HiddenHead(VanillaHead):
    """A head whose bias reads the hidden row of each position (the op does not take these yet)."""

    needs_hidden = True

    def _hidden64(self, hidden: torch.Tensor | None, width: int) -> torch.Tensor:
        if hidden is None:
            raise ValueError(f"the {self.kind} Markov head reads the backbone's hidden row of every draft position; "
                             "pass hidden [R, N, H]")
        if hidden.dim() != 3 or hidden.shape[-1] != width:
            raise ValueError(f"the {self.kind} Markov head takes hidden rows [R, N, {width}], got {list(hidden.shape)}")
        return hidden.to(torch.float64)

    @property
    def row_norms(self) -> torch.Tensor:
        raise NotImplementedError(f"the Markov draft op does not take {self.kind} heads (no pruning bound)")

    @property
    def max_norms(self) -> torch.Tensor | None:
        raise NotImplementedError(f"the Markov draft op does not take {self.kind} heads (no pruning bound)")


class GatedHead(_HiddenHead):
    """``b_k = markov_w2 @ (g_k * e_k)``, ``g_k = sigmoid(Wg [h_k ; e_k] + bg)``."""

    kind = "gated"

    def __init__(self, weights: MarkovWeights):
        super().__init__(weights)
        assert weights.gate_weight is not None and weights.gate_bias is not None, "a gated head needs gate_proj"
        self.hidden_size = int(weights.gate_weight.shape[1]) - weights.rank

    def start(self, hidden: torch.Tensor | None = None) -> BiasStep:
        w = self.weights
        assert w.gate_weight is not None and w.gate_bias is not None
        h = self.hidden_size
        wg = w.gate_weight.to(device=w.markov_w2.device, dtype=torch.float64)  # [r, H + r]
        # The hidden part of every position at once: [R, N, r].
        gh = self._hidden64(hidden, h).to(wg.device) @ wg[:, :h].T + w.gate_bias.to(wg)
        wg_e = wg[:, h:]  # [r, r]
        w2 = w.markov_w2.to(torch.float64)

        def step(k: int, e: torch.Tensor) -> torch.Tensor:
            e64 = e.double()
            g = torch.sigmoid(gh[:, k] + e64 @ wg_e.T)  # [R, r]
            return ((g * e64) @ w2.T).float()
        return step


class RnnHead(_HiddenHead):
    """``b_k = markov_w2 @ tanh(o_k)`` from a gated state carried along the block (zero at its start)."""

    kind = "rnn"

    def __init__(self, weights: MarkovWeights):
        super().__init__(weights)
        assert weights.joint_weight is not None and weights.joint_bias is not None, "an rnn head needs joint_proj"
        self.hidden_size = int(weights.joint_weight.shape[1]) - 2 * weights.rank

    def start(self, hidden: torch.Tensor | None = None) -> BiasStep:
        w = self.weights
        assert w.joint_weight is not None and w.joint_bias is not None
        r = w.rank
        wj = w.joint_weight.to(device=w.markov_w2.device, dtype=torch.float64)  # [3r, 2r + H]
        jh = self._hidden64(hidden, self.hidden_size).to(wj.device) @ wj[:, 2 * r:].T + w.joint_bias.to(wj)  # [R,N,3r]
        w_s, w_e = wj[:, :r], wj[:, r:2 * r]  # [3r, r] each
        w2 = w.markov_w2.to(torch.float64)
        state = [torch.zeros(jh.shape[0], r, dtype=torch.float64, device=wj.device)]  # s_{-1} = 0, [R, r]
        last = [-1]

        def step(k: int, e: torch.Tensor) -> torch.Tensor:
            if k != last[0] + 1:
                raise RuntimeError(f"the rnn head's state runs left to right: position {k} after {last[0]}")
            last[0] = k
            s = state[0]
            a, c, o = (jh[:, k] + s @ w_s.T + e.double() @ w_e.T).split(r, dim=-1)
            gate = torch.sigmoid(a)
            state[0] = gate * s + (1.0 - gate) * torch.tanh(c)
            return (torch.tanh(o) @ w2.T).float()
        return step


HEADS = {"vanilla": VanillaHead, "gated": GatedHead, "rnn": RnnHead}


def make_head(weights: MarkovWeights) -> VanillaHead:
    """The head variant ``weights`` were built for (``MarkovWeights.head_type``)."""
    return HEADS[weights.head_type](weights)
