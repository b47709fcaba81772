"""Recompute draft steps recorded in a proposer trace with the plain-PyTorch reference.

The trace (``VLLM_DSPARK_TRACE``) records, for each request of each draft
step, the anchor token and its position. Given the full token sequence, the
target's hidden states come from Hugging Face transformers and the drafter is
the reference ``DSparkDraftModel``: an implementation that shares no code with
the vLLM path except the Markov loop's semantics.
"""

from __future__ import annotations

import torch

from vllm_dspark.checkpoint.io import load_reference_model


class ReferenceDrafter:
    def __init__(self, target_dir: str, draft_dir: str):
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.draft = load_reference_model(draft_dir).eval()
        self.ids = self.draft.config.target_layer_ids
        self._cache: dict[tuple, torch.Tensor] = {}

    @torch.no_grad()
    def aux(self, seq: list[int]) -> torch.Tensor:
        key = tuple(seq)
        if key not in self._cache:
            # The output of decoder layer i (DSpark's convention), taken from the
            # layer itself: HF's hidden_states[-1] is after the final norm.
            captured: dict[int, torch.Tensor] = {}
            hooks = [self.target.model.layers[i].register_forward_hook(
                lambda mod, args, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out))
                for i in self.ids]
            try:
                self.target(torch.tensor([seq]))
            finally:
                for h in hooks:
                    h.remove()
            self._cache[key] = torch.cat([captured[i][0] for i in self.ids], dim=-1)
        return self._cache[key]

    @torch.no_grad()
    def step(self, seq: list[int], pos: int, threshold: float = 0.0):
        """Draft from anchor seq[pos] with context seq[:pos]."""
        aux = self.aux(seq)[:pos].unsqueeze(0)
        emb = self.target.get_input_embeddings().weight
        head = self.target.get_output_embeddings().weight
        return self.draft.draft(aux, torch.tensor([pos]), torch.tensor([seq[pos]]), emb, head,
                                threshold=threshold)


def match_sequence(record: dict, sequences: list[list[int]], first_request: int = 0) -> int | None:
    """Index of the record's request, or None when its anchor lies past the returned tokens.

    ``LLM.generate`` numbers requests from ``first_request`` in prompt order
    (request ids ``"<n>-<suffix>"``). A step can accept tokens beyond
    ``max_tokens``; the drafts made from them are not in the returned sequence.
    """
    idx = int(str(record["req_id"]).split("-")[0]) - first_request
    if not 0 <= idx < len(sequences):
        return None
    seq = sequences[idx]
    if record["pos"] >= len(seq):
        return None
    assert seq[record["pos"]] == record["anchor"], (record, idx)
    return idx


def check_trace_against_reference(trace: list[dict], sequences: list[list[int]], ref: ReferenceDrafter, *,
                                  samples: int, threshold: float = 0.0, cap: int | None = None,
                                  atol: float = 2e-3, verified_only: bool = False) -> int:
    """Recompute about ``samples`` recorded steps; tokens, confidences and kept lengths must match.

    fp32 engine against the fp32 reference: the confidences depend on every
    backbone weight, so they check the whole parallel pass. ``verified_only``: compare the first
    ``kept`` positions of records that sent drafts (a probe drafts only those). Returns how many
    steps were checked.
    """
    checked = 0
    for rec in trace[:: max(1, len(trace) // samples)]:
        idx = match_sequence(rec, sequences)
        if idx is None or (verified_only and rec["kept"] == 0):
            continue
        out = ref.step(sequences[idx], rec["pos"], threshold=threshold)
        n = rec["kept"] if verified_only else len(rec["draft"])
        assert rec["draft"][:n] == out.tokens[0, :n].tolist(), rec
        assert torch.allclose(torch.tensor(rec["confidence"][:n]), out.confidence[0, :n], atol=atol), \
            (rec, out.confidence[0].tolist())
        if cap is not None:
            assert min(cap, int(out.lengths[0])) == rec["kept"], rec
        checked += 1
    return checked
