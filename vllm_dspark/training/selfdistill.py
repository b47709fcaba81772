"""Self-distillation data for a drafter of a real chat target.

Two stages, both resumable after a kill (each writes its results atomically):

1. :func:`generate_conversations`: multi-turn chats answered by the target
   itself through vLLM (most greedy, a share sampled at temperature 1 with a
   fixed seed per conversation). A conversation keeps going with follow-up
   questions until it holds ``seq_len`` tokens, so every training sequence is
   exactly ``seq_len`` long. The token ids are kept exactly as generated (no
   re-tokenisation), with a mask of which tokens the target produced.
2. :func:`capture_features`: one teacher-forced Hugging Face forward per
   sequence (fp32) that stores, memory-mapped, the target's hidden states at
   the drafter's ``target_layer_ids`` (bf16) and its final-normed hidden state
   (fp32). The training loop turns the latter into the target's logits at just
   the positions it needs (``final @ lm_head.T``): storing full-vocabulary
   logits of 1,024-token sequences would take 200 MB per sequence.

Aux convention: ``target_layer_ids`` entry ``i`` is the output of decoder layer
``i``, Hugging Face's ``hidden_states[i + 1]`` (see ``capture.py``).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


def _atomic_write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _progress(total: int, desc: str, initial: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="seq", dynamic_ncols=True,
                mininterval=5.0, smoothing=0.1)


@dataclass
class GenerateArgs:
    seq_len: int = 1024
    max_rounds: int = 6
    max_tokens_per_turn: int = 320
    min_generated: int = 64  # target-generated tokens a kept conversation needs within seq_len
    sampled_share: float = 0.25  # conversations answered at temperature 1.0 (seeded)
    seed: int = 0
    max_num_seqs: int = 96
    kv_cache_gib: int = 8
    dtype: str = "float32"  # fastest vLLM CPU path on machines without AVX-512 bf16


def generate_conversations(target_dir: str | Path, first_turns: list[dict], out_dir: str | Path,
                           args: GenerateArgs, log: Callable[[str], None] = print) -> Path:
    """Run the conversations round by round; writes ``out_dir/conversations.npz``.

    ``conversations.npz``: ``ids`` [N, seq_len] int32, ``gen_mask`` [N, seq_len]
    uint8 (1 where the target generated the token), ``temperature`` [N] and the
    first-turn ``kind`` per row. Conversations still shorter than ``seq_len``
    after ``max_rounds`` are dropped (logged). State after every round lives in
    ``state.json``, so a killed run resumes at the round it was in.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / "conversations.npz"
    if final.exists():
        log(f"[generate] {final} exists; skipping")
        return final
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_dspark.training.chat_prompts import follow_up

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    eos = tok.eos_token_id
    state_path = out / "state.json"
    rng = random.Random(args.seed)
    if state_path.exists():
        state = json.loads(state_path.read_text())
        log(f"[generate] resuming at round {state['round']}")
    else:
        convs = []
        for i, turn in enumerate(first_turns):
            text = tok.apply_chat_template([{"role": "user", "content": turn["prompt"]}],
                                           add_generation_prompt=True, tokenize=False)
            ids = tok.encode(text, add_special_tokens=False)
            temp = 1.0 if rng.random() < args.sampled_share else 0.0
            convs.append({"ids": ids, "gen": [0] * len(ids), "temperature": temp, "kind": turn["kind"],
                          "seed": args.seed * 100003 + i})
        state = {"round": 0, "convs": convs}
        _atomic_write_json(state_path, state)
    # No chunked prefill: vLLM 0.32's CPU runner crashes when a seeded request's prefill is split
    # ("CPU Generator does not use offset" while discarding the partial step's sample).
    max_len = args.seq_len + args.max_tokens_per_turn + 64
    llm = LLM(model=str(target_dir), dtype=args.dtype, max_model_len=max_len, enforce_eager=True,
              max_num_seqs=args.max_num_seqs, seed=args.seed, enable_chunked_prefill=False,
              max_num_batched_tokens=max(8192, max_len))
    t0 = time.time()
    while state["round"] < args.max_rounds:
        r = state["round"]
        active = [c for c in state["convs"] if len(c["ids"]) < args.seq_len]
        if not active:
            break
        params = [SamplingParams(max_tokens=args.max_tokens_per_turn, temperature=c["temperature"],
                                 seed=c["seed"] + r if c["temperature"] > 0 else None)
                  for c in active]
        outs = llm.generate([{"prompt_token_ids": c["ids"]} for c in active], params, use_tqdm=True)
        n_new = 0
        for c, o in zip(active, outs):
            new = list(o.outputs[0].token_ids)
            n_new += len(new)
            c["ids"] += new
            c["gen"] += [1] * len(new)
            if not new or new[-1] != eos:
                tail = tok.encode("<|im_end|>", add_special_tokens=False)
                c["ids"] += tail
                c["gen"] += [0] * len(tail)
            nxt = tok.encode("\n<|im_start|>user\n" + follow_up(rng) + "<|im_end|>\n<|im_start|>assistant\n",
                             add_special_tokens=False)
            c["ids"] += nxt
            c["gen"] += [0] * len(nxt)
        state["round"] = r + 1
        _atomic_write_json(state_path, state)
        done = sum(len(c["ids"]) >= args.seq_len for c in state["convs"])
        log(f"[generate] round {r + 1}: {len(active)} conversations, {n_new} tokens generated, "
            f"{done}/{len(state['convs'])} at {args.seq_len} tokens, {(time.time() - t0) / 60:.1f} min")
    del llm
    # A conversation must fill the sequence and hold enough of the target's own tokens to anchor on
    # (a long first prompt can leave too few).
    keep = [c for c in state["convs"]
            if len(c["ids"]) >= args.seq_len and sum(c["gen"][:args.seq_len]) >= args.min_generated]
    dropped = len(state["convs"]) - len(keep)
    if dropped:
        log(f"[generate] dropped {dropped} conversations shorter than {args.seq_len} tokens or with fewer "
            f"than {args.min_generated} generated tokens in them")
    L = args.seq_len
    ids = np.array([c["ids"][:L] for c in keep], dtype=np.int32)
    gen = np.array([c["gen"][:L] for c in keep], dtype=np.uint8)
    temps = np.array([c["temperature"] for c in keep], dtype=np.float32)
    kinds = np.array([c["kind"] for c in keep])
    tmp = out / "conversations.tmp.npz"
    np.savez(tmp, ids=ids, gen_mask=gen, temperature=temps, kind=kinds)
    os.replace(tmp, final)
    log(f"[generate] {len(keep)} conversations of {L} tokens ({int(gen.sum())} generated) -> {final}")
    return final


class FeatureSet:
    """Memory-mapped training features of one set of conversations.

    Files: ``ids.npy`` [N, L] int32, ``gen_mask.npy`` [N, L] uint8,
    ``aux.npy`` [N, L, n_aux * H] bf16 (stored as uint16), ``final.npy``
    [N, L, H] fp32, ``done.json`` (sequences captured so far).
    """

    def __init__(self, directory: str | Path):
        d = Path(directory)
        done = json.loads((d / "done.json").read_text())
        self.n = int(done["done"])
        if self.n < int(done["total"]):
            raise RuntimeError(f"{d}: capture incomplete ({self.n}/{done['total']}); rerun the capture stage")
        self.ids = np.load(d / "ids.npy")
        self.gen_mask = np.load(d / "gen_mask.npy")
        self.aux = np.load(d / "aux.npy", mmap_mode="r")
        self.final = np.load(d / "final.npy", mmap_mode="r")
        self.layer_ids = tuple(done["target_layer_ids"])

    def __len__(self) -> int:
        return self.n

    def get(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [n, L] int64, gen_mask [n, L] bool, aux [n, L, A] fp32, final [n, L, H] fp32)."""
        order = sorted(range(len(idx)), key=lambda k: idx[k])
        rows = [idx[k] for k in order]
        inv = torch.empty(len(idx), dtype=torch.long)
        inv[torch.tensor(order)] = torch.arange(len(idx))
        aux = torch.from_numpy(np.ascontiguousarray(self.aux[rows])).view(torch.bfloat16).float()[inv]
        final = torch.from_numpy(np.ascontiguousarray(self.final[rows]))[inv]
        ids = torch.from_numpy(self.ids[idx]).long()
        gen = torch.from_numpy(self.gen_mask[idx]).bool()
        return ids, gen, aux, final


@torch.no_grad()
def capture_features(target_dir: str | Path, conversations: str | Path, out_dir: str | Path,
                     target_layer_ids, *, rows: slice | None = None, batch_size: int = 2,
                     log: Callable[[str], None] = print) -> FeatureSet:
    """Teacher-forced fp32 forward of every conversation; resumable (``done.json``)."""
    from transformers import AutoModelForCausalLM

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    z = np.load(conversations)
    ids, gen = z["ids"], z["gen_mask"]
    if rows is not None:
        ids, gen = ids[rows], gen[rows]
    n, length = ids.shape
    done_path = d / "done.json"
    target_layer_ids = [int(i) for i in target_layer_ids]
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    model.eval()
    nl = model.config.num_hidden_layers
    for i in target_layer_ids:
        if not 0 <= i < nl - 1:
            raise ValueError(f"target_layer_ids: {i} is not an inner layer of the {nl}-layer target "
                             f"(valid 0..{nl - 2}; HF's last hidden state is post-norm)")
    h = model.config.hidden_size
    a_dim = len(target_layer_ids) * h
    if done_path.exists():
        done = json.loads(done_path.read_text())
        if done["total"] != n or done["target_layer_ids"] != target_layer_ids:
            raise RuntimeError(f"{d} holds a capture of other data; delete it to recapture")
        aux = np.load(d / "aux.npy", mmap_mode="r+")
        final = np.load(d / "final.npy", mmap_mode="r+")
        start = int(done["done"])
        log(f"[capture] resuming at {start}/{n}")
    else:
        np.save(d / "ids.npy", ids)
        np.save(d / "gen_mask.npy", gen)
        aux = np.lib.format.open_memmap(d / "aux.npy", mode="w+", dtype=np.uint16, shape=(n, length, a_dim))
        final = np.lib.format.open_memmap(d / "final.npy", mode="w+", dtype=np.float32, shape=(n, length, h))
        start = 0
        _atomic_write_json(done_path, {"done": 0, "total": n, "target_layer_ids": target_layer_ids})
    bar = _progress(n, "capture", initial=start)
    for s in range(start, n, batch_size):
        x = torch.from_numpy(ids[s:s + batch_size]).long()
        out = model.model(input_ids=x, output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        a = torch.cat([hs[i + 1] for i in target_layer_ids], dim=-1)
        aux[s:s + len(x)] = a.to(torch.bfloat16).view(torch.uint16).numpy()
        final[s:s + len(x)] = out.last_hidden_state.float().numpy()
        aux.flush()
        final.flush()
        _atomic_write_json(done_path, {"done": s + len(x), "total": n, "target_layer_ids": target_layer_ids})
        bar.update(len(x))
    bar.close()
    del aux, final
    return FeatureSet(d)
