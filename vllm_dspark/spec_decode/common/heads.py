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

A gated or rnn head also gives the compiled op its arguments (:meth:`GatedHead.op_args`):
the part that reads the hidden rows, for every position at once, ``head_hidden``
[R, N, m] = fp32(fp64(h) @ fp64(W_h).T + fp64(b)) (gated ``W_h = Wg[:, :H]``, m = r;
rnn ``W_h = Wj[:, 2r:]``, m = 3r), and the token-side weights ``head_w`` (gated
``Wg[:, H:]``, rnn ``Wj[:, :2r]``) in fp32. ``start`` runs the same arguments through
``ops.markov_reference.head_stepper``, the op's definition: the gate and the
recurrence in fp64, ``v`` rounded once to fp32, the bias ``fp32(fp64(v) @ fp64(W2).T)``.
So the Python recurrence (sampled rows, the fallback) and the op (greedy rows:
:class:`~vllm_dspark.spec_decode.common.drafts.MarkovStage` drafts them with
``markov_draft``, path ``"compiled"``) compute one thing. V2's one-op path
(``MarkovStage.draft_into``) takes them too, greedy and sampled rows alike, from the
block's hidden rows its caller hands in (vLLM 0.33's ``sample_sequential`` hook gathers
them from the backbone's output).

Upstream vLLM's DSpark head has no ``gate_proj`` / ``joint_proj``: a loader takes them
off the checkpoint's tensors itself and passes them to ``MarkovWeights.build``
(:func:`projection_args`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_dspark.model.markov_weights import MarkovWeights
from vllm_dspark.ops.markov_reference import embed_prev, head_stepper

BiasStep = Callable[[int, torch.Tensor], torch.Tensor]  # (position k, e_k [R, r] fp32) -> bias [R, V] fp32


class VanillaHead:
    """``b = markov_w2 @ markov_w1[prev]``: DSpark's vanilla Markov head.

    ``embed`` and ``start`` are what the shared recurrence calls; ``row_norms``
    and ``max_norms`` are the bound the op prunes with (Cauchy-Schwarz on
    ``markov_w2[j] . v``; the gated and rnn heads pass the same tensors, the op
    takes each row's own ``||v||`` and, for rnn, ``sqrt(rank)`` as the maximum).
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
    """A head whose bias reads the hidden row of each position: the op takes it as
    ``(head_hidden, head_w, head_type)`` (:meth:`op_args`)."""

    needs_hidden = True
    code = 0  # the op's head_type
    _head_w: torch.Tensor | None = None

    def op_args(self, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The compiled op's head arguments for one block per row: ``head_hidden`` [R, N, m] fp32
        (fp64 product with the hidden rows, bias included, rounded once), ``head_w`` fp32 (cached
        per device) and ``head_type``, from ``hidden`` [R, N, H]."""
        raise NotImplementedError

    def start(self, hidden: torch.Tensor | None = None) -> BiasStep:
        """One block per row: the op's own definition (``head_stepper``) on :meth:`op_args`."""
        head_hidden, head_w, code = self.op_args(hidden)
        return head_stepper(code, head_hidden, head_w, self.weights.markov_w2)

    def _hidden64(self, hidden: torch.Tensor | None, width: int) -> torch.Tensor:
        if hidden is None:
            raise ValueError(f"the {self.kind} Markov head reads the backbone's hidden row of every draft position; "
                             "pass hidden [R, N, H]")
        if hidden.dim() != 3 or hidden.shape[-1] != width:
            raise ValueError(f"the {self.kind} Markov head takes hidden rows [R, N, {width}], got {list(hidden.shape)}")
        return hidden.to(torch.float64)


class GatedHead(_HiddenHead):
    """``b_k = markov_w2 @ (g_k * e_k)``, ``g_k = sigmoid(Wg [h_k ; e_k] + bg)``.

    The op's ``head_hidden`` is ``Wg[:, :H] h + bg`` [R, N, r], ``head_w`` ``Wg[:, H:]`` [r, r]."""

    kind = "gated"
    code = 1

    def __init__(self, weights: MarkovWeights):
        super().__init__(weights)
        assert weights.gate_weight is not None and weights.gate_bias is not None, "a gated head needs gate_proj"
        self.hidden_size = int(weights.gate_weight.shape[1]) - weights.rank

    def op_args(self, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
        w = self.weights
        assert w.gate_weight is not None and w.gate_bias is not None
        dev, h = w.markov_w2.device, self.hidden_size
        wg = w.gate_weight.to(dev)  # [r, H + r]: hidden columns first, then e's
        head_hidden = (self._hidden64(hidden, h).to(dev) @ wg[:, :h].to(torch.float64).T
                       + w.gate_bias.to(dev, torch.float64)).to(torch.float32)  # [R, N, r]
        if self._head_w is None or self._head_w.device != dev:
            self._head_w = wg[:, h:].to(torch.float32).contiguous()  # [r, r]
        return head_hidden, self._head_w, self.code


class RnnHead(_HiddenHead):
    """``b_k = markov_w2 @ tanh(o_k)`` from a gated state carried along the block (zero at its start).

    The op's ``head_hidden`` is ``Wj[:, 2r:] h + bj`` [R, N, 3r], ``head_w`` ``Wj[:, :2r]`` [3r, 2r]
    (the state's columns, then e's)."""

    kind = "rnn"
    code = 2

    def __init__(self, weights: MarkovWeights):
        super().__init__(weights)
        assert weights.joint_weight is not None and weights.joint_bias is not None, "an rnn head needs joint_proj"
        self.hidden_size = int(weights.joint_weight.shape[1]) - 2 * weights.rank

    def op_args(self, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
        w = self.weights
        assert w.joint_weight is not None and w.joint_bias is not None
        dev, r = w.markov_w2.device, w.rank
        wj = w.joint_weight.to(dev)  # [3r, 2r + H]: [s ; e ; h]
        head_hidden = (self._hidden64(hidden, self.hidden_size).to(dev) @ wj[:, 2 * r:].to(torch.float64).T
                       + w.joint_bias.to(dev, torch.float64)).to(torch.float32)  # [R, N, 3r]
        if self._head_w is None or self._head_w.device != dev:
            self._head_w = wj[:, :2 * r].to(torch.float32).contiguous()  # [3r, 2r]
        return head_hidden, self._head_w, self.code


HEADS = {"vanilla": VanillaHead, "gated": GatedHead, "rnn": RnnHead}

# A head projection's checkpoint tensor (canonical name) -> its MarkovWeights.build argument.
PROJECTION_TENSORS = {"markov_head.gate_proj.weight": "gate_weight", "markov_head.gate_proj.bias": "gate_bias",
                      "markov_head.joint_proj.weight": "joint_weight", "markov_head.joint_proj.bias": "joint_bias"}


def projection_args(head_type: str, tensors: dict[str, torch.Tensor],
                    device: torch.device | str | None = None) -> dict:
    """``MarkovWeights.build``'s head arguments from the checkpoint's projection tensors
    (``tensors``: canonical name -> tensor, the :data:`PROJECTION_TENSORS` names), moved to
    ``device``. All are passed whatever ``head_type`` says, so ``build`` refuses a missing, stray
    or misshapen one by name."""
    out: dict = {"markov_head_type": head_type}
    for name, t in tensors.items():
        out[PROJECTION_TENSORS[name]] = t if device is None else t.to(device=device)
    return out


def make_head(weights: MarkovWeights) -> VanillaHead:
    """The head variant ``weights`` were built for (``MarkovWeights.head_type``)."""
    return HEADS[weights.head_type](weights)
