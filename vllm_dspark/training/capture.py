"""What the drafter learns from: the target's aux hidden states, probabilities and
greedy continuations.

Aux-layer convention (DSpark / SpecForge): ``target_layer_ids`` entry ``i`` is
the OUTPUT of decoder layer ``i`` (0-based), which is Hugging Face's
``output_hidden_states[i + 1]`` (entry 0 is the embedding output). The last
decoder layer is never used: HF's last entry is taken after the final norm.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


def load_target(path, dtype: torch.dtype = torch.bfloat16):
    """The trained target (eval mode, frozen) from its HF directory."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def target_embed_and_head(target) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and LM head [V, H] (tied here, but not assumed)."""
    return target.get_input_embeddings().weight, target.get_output_embeddings().weight


@dataclass
class TargetPass:
    aux: torch.Tensor  # [N, L, n_aux * H] concatenated aux hidden states
    logits: torch.Tensor  # [N, L, V] fp32 next-token logits at every position


@torch.no_grad()
def target_pass(target, input_ids: torch.Tensor, target_layer_ids) -> TargetPass:
    """One teacher-forced target forward returning aux features and logits."""
    num_layers = target.config.num_hidden_layers
    for i in target_layer_ids:
        if not 0 <= i < num_layers - 1:
            raise ValueError(
                f"target_layer_ids: layer {i} is not an inner layer of the {num_layers}-layer target "
                f"(valid 0..{num_layers - 2}; the last layer's HF output is post-norm)")
    out = target(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    aux = torch.cat([hs[i + 1] for i in target_layer_ids], dim=-1)
    return TargetPass(aux=aux, logits=out.logits.float())


@torch.no_grad()
def greedy_generate(target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts [N, P] -> [N, P + new_tokens].

    Never stops early (eos is just another token here), so every row has the
    same length. Uses the model's KV cache.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    out = target(input_ids=prompts, past_key_values=cache, use_cache=True)
    tok = out.logits[:, -1].float().argmax(-1, keepdim=True)
    seq = [prompts, tok]
    for _ in range(new_tokens - 1):
        out = target(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
        tok = out.logits[:, -1].float().argmax(-1, keepdim=True)
        seq.append(tok)
    return torch.cat(seq, dim=1)


def generate_distill_set(target, stream: np.ndarray, *, num_seqs: int, batch_size: int,
                         new_tokens: int, min_prompt: int, max_prompt: int, seed: int,
                         log=print) -> list[dict]:
    """Greedy continuations of random train-stream windows (the drafter's training text).

    Returns rows ``{"ids": int32 array, "prompt_len": int}``. Each batch shares one
    prompt length so no padding is needed.
    """
    gen = torch.Generator().manual_seed(seed)
    rows: list[dict] = []
    t0 = time.time()
    while len(rows) < num_seqs:
        n = min(batch_size, num_seqs - len(rows))
        plen = int(torch.randint(min_prompt, max_prompt + 1, (1,), generator=gen))
        starts = torch.randint(0, len(stream) - plen, (n,), generator=gen).tolist()
        prompts = torch.from_numpy(np.stack([stream[s:s + plen] for s in starts])).long()
        seqs = greedy_generate(target, prompts, new_tokens)
        for row in seqs:
            rows.append({"ids": row.numpy().astype(np.int32), "prompt_len": plen})
        el = time.time() - t0
        log(f"[generate] {len(rows)}/{num_seqs} sequences ({plen}+{new_tokens} tokens) "
            f"{el / 60:.1f}m elapsed")
    return rows
