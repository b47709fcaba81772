"""Offline estimate of served acceptance: greedy speculative decoding simulated in plain torch.

For each prompt the target's greedy continuation is computed once; one
teacher-forced target pass over prompt + continuation then gives the aux
features every decoding step would have seen. Decoding is replayed step by
step exactly as a greedy speculative engine runs it: with ``p`` tokens
committed before the anchor, the anchor is the token at position ``p`` (the
target's bonus token), the drafter (the reference model's ``draft``, i.e. the
sequential Markov stage) proposes ``block_size`` tokens from the features of
tokens ``0 .. p-1``, the target accepts the longest matching prefix ``a``, and
the next anchor sits at ``p + a + 1``. Acceptance length per step is ``a + 1``
(the engine's ``1 + accepted / drafts``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from training.pipeline.capture import greedy_generate, target_embed_and_head, target_pass


@dataclass
class AcceptanceResult:
    mean_acceptance_length: float
    per_position: list[float]  # P(draft i accepted), over all steps
    steps: int
    mean_drafted: float  # draft tokens verified per step (< block_size with early stop)
    per_prompt: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"mean_acceptance_length": self.mean_acceptance_length,
                "per_position": self.per_position, "steps": self.steps,
                "mean_drafted": self.mean_drafted}


@torch.no_grad()
def greedy_chains(target, prompt_ids: list[list[int]], new_tokens: int) -> list[torch.Tensor]:
    """Each prompt's greedy continuation (prompt + new_tokens ids, 1-D)."""
    return [greedy_generate(target, torch.tensor([p]), new_tokens)[0] for p in prompt_ids]


@torch.no_grad()
def simulate_acceptance(target, drafter, chains: list[torch.Tensor], prompt_lens: list[int], *,
                        use_markov: bool = True, threshold: float = 0.0) -> AcceptanceResult:
    """Replay greedy speculative decoding over precomputed greedy ``chains``."""
    cfg = drafter.config
    b = cfg.num_draft_tokens
    embed, lm_head = target_embed_and_head(target)
    embed, lm_head = embed.float(), lm_head.float()
    n = len(chains)
    length = max(len(c) for c in chains)
    ids = torch.zeros(n, length, dtype=torch.long)
    for i, c in enumerate(chains):
        ids[i, :len(c)] = c
    aux = torch.cat([target_pass(target, c[None], cfg.target_layer_ids).aux for c in chains_padded(chains, length)])
    aux = aux.float()
    pos = torch.tensor(prompt_lens, dtype=torch.long)  # anchor positions
    ends = torch.tensor([len(c) for c in chains], dtype=torch.long)
    acc_len: list[list[int]] = [[] for _ in range(n)]
    pos_hits = torch.zeros(b)
    drafted_total = 0
    steps = 0
    while True:
        live = (pos + b < ends).nonzero().flatten()
        if len(live) == 0:
            break
        out = drafter.draft(aux[live], pos[live], ids[live, pos[live]], embed, lm_head,
                            temperature=0.0, threshold=threshold, use_markov=use_markov)
        truth = torch.stack([ids[r, pos[r] + 1:pos[r] + 1 + b] for r in live.tolist()])
        match = (out.tokens == truth).long().cumprod(1)  # [live, b]
        kept = torch.arange(b)[None, :] < out.lengths[:, None].long()
        match = match * kept
        a = match.sum(1)
        pos_hits += match.sum(0).float()
        drafted_total += int(out.lengths.sum())
        steps += len(live)
        for j, r in enumerate(live.tolist()):
            acc_len[r].append(int(a[j]) + 1)
        pos[live] += a + 1
    flat = [x for row in acc_len for x in row]
    return AcceptanceResult(
        mean_acceptance_length=sum(flat) / max(1, len(flat)),
        per_position=(pos_hits / max(1, steps)).tolist(),
        steps=steps,
        mean_drafted=drafted_total / max(1, steps),
        per_prompt=[sum(r) / max(1, len(r)) for r in acc_len],
    )


def chains_padded(chains: list[torch.Tensor], length: int) -> list[torch.Tensor]:
    """Chains right-padded (with their last token) to one length; padding is never read."""
    out = []
    for c in chains:
        if len(c) < length:
            c = torch.cat([c, c[-1:].expand(length - len(c))])
        out.append(c)
    return out
