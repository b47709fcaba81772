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
                         seq_len: int, min_prompt: int, max_prompt: int, seed: int,
                         log=print) -> tuple[np.ndarray, np.ndarray]:
    """Greedy continuations of random train-stream windows (the drafter's training text).

    Every sequence has ``seq_len`` tokens: a prompt of ``min_prompt..max_prompt``
    corpus tokens (one length per batch, so no padding) and the target's greedy
    continuation. Returns ``(ids [num_seqs, seq_len] int32, prompt_lens [num_seqs])``.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = np.zeros((num_seqs, seq_len), dtype=np.int32)
    plens = np.zeros(num_seqs, dtype=np.int32)
    done = 0
    t0 = time.time()
    while done < num_seqs:
        n = min(batch_size, num_seqs - done)
        plen = int(torch.randint(min_prompt, max_prompt + 1, (1,), generator=gen))
        starts = torch.randint(0, len(stream) - plen, (n,), generator=gen).tolist()
        prompts = torch.from_numpy(np.stack([stream[s:s + plen] for s in starts])).long()
        seqs = greedy_generate(target, prompts, seq_len - plen)
        ids[done:done + n] = seqs.numpy()
        plens[done:done + n] = plen
        done += n
        log(f"[generate] {done}/{num_seqs} sequences ({plen}+{seq_len - plen} tokens) "
            f"{(time.time() - t0) / 60:.1f}m elapsed")
    return ids, plens


def sample_prompts(stream: np.ndarray, *, num_seqs: int, min_prompt: int, max_prompt: int,
                   seed: int, batch_size: int = 128) -> list[list[int]]:
    """Random windows of a token stream, one length per group of ``batch_size``."""
    gen = torch.Generator().manual_seed(seed)
    prompts: list[list[int]] = []
    while len(prompts) < num_seqs:
        n = min(batch_size, num_seqs - len(prompts))
        plen = int(torch.randint(min_prompt, max_prompt + 1, (1,), generator=gen))
        starts = torch.randint(0, len(stream) - plen, (n,), generator=gen).tolist()
        prompts += [[int(t) for t in stream[s:s + plen]] for s in starts]
    return prompts


def greedy_decode_vllm(target_dir, prompts: list[list[int]], seq_len: int, *, seed: int = 0,
                       max_num_seqs: int = 128, log=print) -> np.ndarray:
    """Greedy continuations to ``seq_len`` tokens, decoded by vLLM: [len(prompts), seq_len] int32.

    vLLM batches the greedy decode far better than a Python loop over the HF
    model on a CPU. Its bf16 kernels may break a near-tie differently from the
    HF forward; the drafter's labels are the HF target's argmax recomputed at
    capture time, so such a token only puts that spot of text slightly
    off-chain.
    """
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model=str(target_dir), dtype="bfloat16", max_model_len=seq_len + 8,
              enforce_eager=True, max_num_seqs=max_num_seqs, seed=seed)
    params = [SamplingParams(temperature=0.0, max_tokens=seq_len - len(p),
                             min_tokens=seq_len - len(p), ignore_eos=True) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ids = np.zeros((len(prompts), seq_len), dtype=np.int32)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ids[i] = (p + list(o.outputs[0].token_ids))[:seq_len]
    del llm
    log(f"[generate] vLLM decoded {len(prompts)} sequences of {seq_len} tokens in "
        f"{(time.time() - t0) / 60:.1f}m")
    return ids
