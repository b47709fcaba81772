"""One draft path: what a draft source returns, and the Markov stage every runner shares.

A step's drafts come from **sources** (:class:`DraftSource`). Each returns a
:class:`Drafts` record: tokens in target-vocabulary ids, a per-position
confidence the budget calibrates into survival, the exact draft distribution q
for sampled requests, and which source and implementation made it. The budget
(``budget.py``) ranks the slots of every source's drafts against one verify
cost; the runners (V1's proposer, V2's ``sample_sequential`` hook) and the
start-up profile never reach a drafting kernel except through a source.

:class:`MarkovStage` is DSpark's own source, from the backbone's hidden rows to
drafts: the base logits (the LM head), the confidence head's parallel part,
then the sequential stage, greedy rows through the Markov draft op and sampled
rows through the shared Python recurrence (``ops.markov_reference.
markov_recurrence``, whose ``pick`` draws from the exact q). What varies between
checkpoints sits behind two small objects the stage owns:

* the **head** (``heads.py``: :class:`VanillaHead`, :class:`GatedHead`, :class:`RnnHead`): its
  embedding of the previous token, its per-block bias, the bound the op prunes with, and (gated,
  rnn) the op's head arguments from the block's hidden rows (``op_args``). Greedy rows of every
  head run on the op (``Drafts.path`` ``"compiled"``; ``"reference-gated"`` / ``"reference-rnn"``
  when the op falls back to the reference for a head that reads hidden rows);
* the **vocabulary map** (:class:`IdentityVocab`, or :class:`DraftVocab` for a
  checkpoint with a draft vocabulary, ``MarkovWeights.d2t``): draft ids to
  target ids, and q from draft to target vocabulary. The op and the recurrence
  draft in draft ids (they take ``d2t`` for the next position's ``markov_w1``
  row); the stage hands target ids and target-vocabulary q to everyone else.

A new head variant or vocabulary map changes this module, ``heads.py`` and the op; the
runners only ever call :meth:`MarkovStage.draft` or :meth:`MarkovStage.draft_into`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from vllm_dspark.model.markov_weights import MarkovWeights
from vllm_dspark.ops.markov_reference import check_d2t, d2t_target_ids
from vllm_dspark.spec_decode.common.heads import GatedHead, RnnHead, VanillaHead, make_head  # noqa: F401 (re-exported)
from vllm_dspark.spec_decode.common.sources import MODEL_SOURCE  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class Drafts:
    """One source's drafts for the requests it was asked about (``R`` rows, ``N`` positions)."""

    tokens: torch.Tensor  # [R, N] int64, target-vocabulary ids
    confidence: torch.Tensor  # [R, N] fp32, per-position conditional acceptance estimate (1: no head)
    probs: torch.Tensor | None  # [R, N, V] fp32 exact q of sampled rows (zero rows elsewhere), or None
    source: str = MODEL_SOURCE
    path: str | None = None  # what drafted the greedy rows ("compiled", "reference"; "reference-gated"/"-rnn")


@dataclass(frozen=True)
class DraftBatch:
    """What a source drafts for: some requests of the step's batch, and how each samples.

    ``rows`` are batch indices; every per-request tensor below is indexed by
    batch row (the step's full batch), so a source drafting a subset reads its
    own rows. ``hidden`` is the backbone's output for the requested rows
    ([len(rows) * num_tokens, H], row-major by request), for sources that read it.
    """

    rows: Sequence[int]
    anchors: torch.Tensor  # [batch] int64, last accepted token of each request
    num_tokens: int
    sampled: np.ndarray  # [batch] bool: drafted by sampling (temperature > 0)
    hidden: torch.Tensor | None = None
    temperature: torch.Tensor | None = None  # [batch] fp32
    top_k: torch.Tensor | None = None  # [batch] int
    top_p: torch.Tensor | None = None  # [batch] fp32
    seeds: Callable[[list[int]], torch.Tensor] | None = None  # batch rows -> [len] int64 Gumbel seeds
    # Batch row -> (req id, head, tail[, prompt length]): each request's accepted text, for sources that
    # draft from it (the copy source). ``head`` is the runner's token array (read without a copy), ``tail``
    # what this step added.
    texts: Mapping[int, tuple] | None = None
    # Every request in the step's batch, by row (not only ``rows``): what a source that keeps state per
    # request (the copy source's indexes) retains.
    req_ids: Sequence[str] | None = None


@runtime_checkable
class DraftSource(Protocol):
    """Anything that drafts: the Markov stage (``MarkovStage``) and the copy source (``CopySource``).

    ``reads_hidden``: it drafts from the block forward's hidden rows (``DraftBatch.hidden``), so it
    runs after the step's plan and only when the plan runs the drafter; otherwise it drafts from the
    requests' texts (``DraftBatch.texts``) before the plan, which weighs its drafts.
    """

    name: str
    reads_hidden: bool

    def draft(self, batch: DraftBatch) -> Drafts:
        ...


class IdentityVocab:
    """The drafter scores the target's own vocabulary: draft id == target id."""

    d2t: torch.Tensor | None = None

    def __init__(self, size: int):
        self.size = size
        self.draft_size = size

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def q_to_target(self, q: torch.Tensor) -> torch.Tensor:
        return q


class DraftVocab:
    """A draft vocabulary (speculators' ``draft_vocab_size``): the head scores ``draft_size`` tokens,
    draft id ``j`` is target id ``j + d2t[j]``.

    ``size`` is the target vocabulary (q's last dimension after :meth:`q_to_target`), ``d2t`` the
    int64 [draft_size] offsets the op takes. Construction checks the map's form only: V2 builds a
    stage per step, possibly under CUDA-graph capture, where reading the values would sync; they
    are checked once when the weights are loaded (``MarkovWeights.build``).
    """

    def __init__(self, d2t: torch.Tensor, size: int):
        check_d2t(d2t, int(d2t.numel()))
        self.d2t = d2t
        self.size = size
        self.draft_size = int(d2t.numel())
        self.target_ids = d2t_target_ids(d2t)  # [Vd]

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> target ids."""
        return self.target_ids[ids]

    def q_to_target(self, q: torch.Tensor) -> torch.Tensor:
        """[..., Vd] -> [..., V]: each draft token's mass at its target id, zero elsewhere (exact:
        a copy, or a sum where two draft ids share a target id)."""
        out = torch.zeros(*q.shape[:-1], self.size, dtype=q.dtype, device=q.device)
        return out.index_add_(-1, self.target_ids.to(q.device), q)


class MarkovStage:
    """DSpark's drafts from the backbone's hidden rows (a :class:`DraftSource`).

    Parameters
    ----------
    weights : the drafter's :class:`MarkovWeights` (what the op reads)
    compute_logits : [rows, H] -> [rows, V'] base logits (the LM head; V' >= V, vLLM pads)
    """

    name = MODEL_SOURCE
    reads_hidden = True

    def __init__(self, weights: MarkovWeights, compute_logits: Callable[[torch.Tensor], torch.Tensor]):
        self.weights = weights
        self.compute_logits = compute_logits
        # (part, since) -> now: the caller's clock for the parts of draft() (V1's timings); none by default.
        # Host time: on a GPU the parts would be launch times unless the clock synchronises.
        self.lap: Callable[[str, float], float] = _no_lap
        self.head: VanillaHead = make_head(weights)
        self.vocab: IdentityVocab | DraftVocab = (
            IdentityVocab(weights.vocab) if weights.d2t is None else DraftVocab(weights.d2t, weights.target_vocab))
        self.last_path: str | None = None

    # ------------------------------------------------------------------ inputs
    def inputs(self, hidden: torch.Tensor, num_rows: int, n: int, *,
               with_confidence: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """From the backbone's rows ``hidden`` [num_rows * n, H]: the base logits [num_rows, n, V]
        (trimmed to the head's vocabulary: vLLM may pad its LM head) and, when asked, the
        confidence head's hidden-state term [num_rows, n] fp32."""
        base = self.base_logits(hidden, num_rows, n)
        return base, (self.confidence_base(hidden, num_rows, n) if with_confidence else None)

    def base_logits(self, hidden: torch.Tensor, num_rows: int, n: int) -> torch.Tensor:
        """The LM head's logits [num_rows, n, V] (trimmed to the Markov head's vocabulary)."""
        base = self.compute_logits(hidden)  # [R * N, V']
        vocab = self.weights.vocab
        if base.shape[-1] < vocab:
            raise RuntimeError(f"vllm_dspark: draft logits have {base.shape[-1]} columns but the Markov head "
                               f"has {vocab} rows")
        return base[:, :vocab].reshape(num_rows, n, vocab)

    def confidence_base(self, hidden: torch.Tensor, num_rows: int, n: int) -> torch.Tensor:
        """The confidence head's hidden-state term [num_rows, n] fp32."""
        conf = self.weights.confidence_base(hidden)
        if conf is None:
            raise RuntimeError("vllm_dspark: confidences were asked for, but the draft has no confidence head")
        return conf.view(num_rows, n)

    # ------------------------------------------------------------------ drafting
    def greedy(self, base: torch.Tensor, anchors: torch.Tensor, conf_base: torch.Tensor | None, *,
               hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, str]:
        """Greedy rows: (tokens [R, N] target ids, conf [R, N], path).

        Every head drafts through the Markov draft op. A gated or rnn head reads ``hidden``
        [R, N, H]: its part of the head is computed here for every position (``op_args``) and the
        op runs the token-dependent part; the path is ``"compiled"``, or ``"reference-<head>"``
        when the op falls back to the reference (which computes the same thing)."""
        from vllm_dspark.ops import markov_draft

        w = self.weights
        head_kw: dict[str, Any] = {}
        if self.head.needs_hidden:
            head_hidden, head_w, code = self.head.op_args(hidden)  # type: ignore[attr-defined]
            head_kw = dict(head_hidden=head_hidden.to(base.device), head_w=head_w.to(base.device), head_type=code)
        out = markov_draft(base, anchors, w.markov_w1, w.markov_w2, self.head.row_norms, conf_base,
                           w.conf_w_markov, max_norms=self.head.max_norms, d2t=self.vocab.d2t, **head_kw)
        path = out.path if out.path == "compiled" or not head_kw else f"reference-{self.head.kind}"
        return self.vocab.to_target(out.tokens), out.conf, path

    def sampled(self, base: torch.Tensor, anchors: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                conf_base: torch.Tensor | None, *, top_k: torch.Tensor | None = None,
                top_p: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sampled rows (``draft_sampling``): tokens [R, N] target ids, conf [R, N], exact q [R, N, V] over
        the target vocabulary. ``hidden`` [R, N, H]: for a head that reads it."""
        from vllm_dspark.spec_decode.common.draft_sampling import sample_drafts

        tokens, conf, q = sample_drafts(base, anchors, self.weights, temperature, seeds, conf_base,
                                        top_k=top_k, top_p=top_p, head=self.head, hidden=hidden)
        return self.vocab.to_target(tokens), conf, self.vocab.q_to_target(q)

    def draft(self, batch: DraftBatch) -> Drafts:
        """Drafts for ``batch.rows`` from ``batch.hidden``: greedy rows on the op, sampled rows sampled."""
        rows = list(batch.rows)
        r, n = len(rows), batch.num_tokens
        assert batch.hidden is not None, "the Markov stage drafts from the backbone's hidden rows"
        w = self.weights
        t = time.perf_counter()
        base = self.base_logits(batch.hidden, r, n)
        t = self.lap("stage.lm_head", t)
        conf_base = self.confidence_base(batch.hidden, r, n) if w.conf_w_hidden is not None else None
        t = self.lap("stage.confidence", t)
        sel = torch.tensor(rows, dtype=torch.int64)
        anchors = batch.anchors[sel.to(batch.anchors.device)].to(torch.int64)
        is_sampled = torch.from_numpy(np.asarray(batch.sampled, dtype=bool)[rows].copy())
        tokens = torch.empty(r, n, dtype=torch.int64, device=base.device)
        conf = torch.ones(r, n, dtype=torch.float32, device=base.device)
        probs = None
        hidden = batch.hidden.reshape(r, n, -1) if self.head.needs_hidden else None  # [R, N, H]
        greedy = ~is_sampled
        if bool(greedy.any()):
            idx = greedy.nonzero().flatten()
            tokens[idx], conf[idx], self.last_path = self.greedy(
                base[idx], anchors[idx], None if conf_base is None else conf_base[idx],
                hidden=None if hidden is None else hidden[idx.to(hidden.device)])
            t = self.lap("stage.markov_op", t)
        if bool(is_sampled.any()):
            idx = is_sampled.nonzero().flatten()
            batch_idx = sel[idx]
            assert batch.temperature is not None and batch.seeds is not None
            t_s, c_s, q_s = self.sampled(
                base[idx], anchors[idx], batch.temperature[batch_idx].float(), batch.seeds(batch_idx.tolist()),
                None if conf_base is None else conf_base[idx],
                top_k=None if batch.top_k is None else batch.top_k[batch_idx],
                top_p=None if batch.top_p is None else batch.top_p[batch_idx],
                hidden=None if hidden is None else hidden[idx.to(hidden.device)])
            tokens[idx], conf[idx] = t_s, c_s
            probs = torch.zeros(r, n, self.vocab.size, dtype=torch.float32, device=base.device)
            probs[idx] = q_s
            self.lap("stage.sampled", t)
        return Drafts(tokens, conf, probs, self.name, self.last_path)

    def draft_into(self, base: torch.Tensor, anchors: torch.Tensor, conf_base: torch.Tensor | None,
                   temperature: torch.Tensor, seeds: torch.Tensor, out_tokens: torch.Tensor,
                   out_conf: torch.Tensor, out_logits: torch.Tensor | None, *,
                   hidden: torch.Tensor | None = None, op: Callable[..., Any] | None = None) -> None:
        """One op call writing into preallocated outputs (V2's CUDA-graph path: no host sync, no
        tensor-value-dependent branch). Greedy and sampled rows alike: the op draws sampled rows by
        Gumbel noise, and ``out_logits`` gets the corrected logits the rejection sampler's q is made from.

        With a draft vocabulary ``out_tokens`` ends in target ids (mapped after the op by a gather
        into a temporary from the caching allocator: still no sync) but ``out_logits`` is
        [R, N, Vd], in draft ids: the caller maps what it makes from them (``self.vocab.q_to_target``
        for a q, ``-inf`` outside the draft vocabulary for logits).

        A gated or rnn head reads ``hidden`` [R, N, H], the backbone's rows of each block's
        positions: its hidden part is computed here for every position at once (``head.op_args``)
        and the op runs the token-dependent part, as :meth:`greedy` does. Without ``hidden`` such a
        head is refused (``ValueError``) rather than drafted as vanilla."""
        if op is None:
            op = torch.ops.vllm_dspark.markov_draft
        w = self.weights
        conf_w_markov = w.conf_w_markov if conf_base is not None else None
        args = (base, anchors, w.markov_w1, w.markov_w2, self.head.row_norms, conf_base, conf_w_markov,
                temperature, seeds, out_tokens, out_conf, out_logits, None, self.head.max_norms)
        head_args: tuple = ()
        if self.head.needs_hidden:
            head_args = self.head.op_args(hidden)  # type: ignore[attr-defined]
        if self.vocab.d2t is None and not head_args:
            op(*args)  # the pre-d2t schema: stand-ins written for it keep working
            return
        op(*args, self.vocab.d2t, *head_args)
        if self.vocab.d2t is not None:
            out_tokens.copy_(self.vocab.to_target(out_tokens))


def _no_lap(part: str, since: float) -> float:
    return time.perf_counter()
