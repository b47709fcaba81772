"""The target's features of the self-distillation text, captured once.

One teacher-forced Hugging Face forward per conversation (bf16; the machine has
AVX-512 bf16) stores, memory-mapped and ragged (conversations end to end):

* ``aux.npy`` [T, n_aux * H] bf16 (as uint16): the hidden states at the
  drafter's ``target_layer_ids``, what vLLM hands the drafter when serving;
* ``topk_ids.npy`` [T, K] uint16 and ``topk_p.npy`` [T, K] fp16: the target's
  ``K`` most likely next tokens and their probabilities. Position ``t``'s
  distribution is over token ``t + 1``; ``topk_ids[:, 0]`` is the target's
  argmax, the label greedy verification accepts. Only positions whose next
  token the target wrote (the only labels training uses) are filled; the rest
  are zero. Storing them once replaces a
  ``[positions, vocab]`` target-logits matmul (and its softmax) in every
  training step;
* ``ids.npy`` [T] int32, ``gen.npy`` [T] uint8 (1 where the target wrote the
  token), ``offsets.npy`` [N + 1] int64.

Aux convention: ``target_layer_ids`` entry ``i`` is the output of decoder layer
``i``, Hugging Face's ``hidden_states[i + 1]``.

Resumable: ``done.json`` counts the conversations written; a rerun continues
after the last one.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

FEATURE_VERSION = 2


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def gen_mask_of(row: dict) -> np.ndarray:
    m = np.zeros(len(row["ids"]), dtype=np.uint8)
    for a, b in row["gen_spans"]:
        m[a:b] = 1
    return m


@torch.no_grad()
def capture(target_dir: str | Path, rows: Sequence[dict], out_dir: str | Path, target_layer_ids: Sequence[int], *,
            top_k: int = 64, dtype: torch.dtype = torch.bfloat16,
            log: Callable[[str], None] = print) -> FeatureSet:
    """Capture ``rows`` (``generate.py``'s conversations); returns the :class:`FeatureSet`."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    layer_ids = [int(i) for i in target_layer_ids]
    lengths = np.array([len(r["ids"]) for r in rows], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total = int(offsets[-1])
    meta = {"version": FEATURE_VERSION, "conversations": len(rows), "tokens": total, "target_layer_ids": layer_ids,
            "top_k": top_k, "dtype": str(dtype).replace("torch.", "")}
    done_path = d / "done.json"
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype)
    model.eval()
    nl, h = model.config.num_hidden_layers, model.config.hidden_size
    for i in layer_ids:
        if not 0 <= i < nl - 1:
            raise ValueError(f"target_layer_ids: {i} is not an inner layer of the {nl}-layer target "
                             f"(valid 0..{nl - 2}; Hugging Face's last hidden state is post-norm)")
    a_dim = len(layer_ids) * h
    shapes = {"aux": (np.uint16, (total, a_dim)), "topk_ids": (np.uint16, (total, top_k)),
              "topk_p": (np.float16, (total, top_k))}
    if done_path.exists():
        state = json.loads(done_path.read_text())
        if state["meta"] != meta:
            raise RuntimeError(f"{d} holds a capture of other data ({state['meta']} vs {meta}); "
                               "delete the directory to capture again")
        mm = {k: np.load(d / f"{k}.npy", mmap_mode="r+") for k in shapes}
        start = int(state["done"])
        if start < len(rows):
            log(f"[capture] {d.name}: resuming at conversation {start}/{len(rows)}")
    else:
        np.save(d / "ids.npy", np.concatenate([np.asarray(r["ids"], dtype=np.int32) for r in rows]))
        np.save(d / "gen.npy", np.concatenate([gen_mask_of(r) for r in rows]))
        np.save(d / "offsets.npy", offsets)
        mm = {k: np.lib.format.open_memmap(d / f"{k}.npy", mode="w+", dtype=dt, shape=shp)
              for k, (dt, shp) in shapes.items()}
        start = 0
        _atomic_json(done_path, {"done": 0, "meta": meta, "seconds": 0.0})
    lm_head = model.lm_head.weight
    bar = tqdm(total=total, initial=int(offsets[start]), desc=f"capture {d.name}", unit="tok", dynamic_ncols=True,
               mininterval=10)
    t0 = time.time()
    spent = float(json.loads(done_path.read_text()).get("seconds", 0.0))
    for n in range(start, len(rows)):
        a, b = int(offsets[n]), int(offsets[n + 1])
        x = torch.tensor(rows[n]["ids"], dtype=torch.long)[None]
        out = model.model(input_ids=x, output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        mm["aux"][a:b] = torch.cat([hs[i + 1][0] for i in layer_ids], -1).to(torch.bfloat16).view(torch.uint16).numpy()
        # Only positions whose next token the target wrote are ever a label; the rest stay zero.
        g = gen_mask_of(rows[n])
        at = np.flatnonzero(np.concatenate([g[1:], [0]]))
        probs = (out.last_hidden_state[0, torch.from_numpy(at)] @ lm_head.t()).float().softmax(-1)
        p, ids = probs.topk(top_k, dim=-1)
        mm["topk_ids"][a + at] = ids.to(torch.int32).numpy().astype(np.uint16)
        mm["topk_p"][a + at] = p.numpy().astype(np.float16)
        bar.update(b - a)
        if n % 16 == 15 or n == len(rows) - 1:
            for m in mm.values():
                m.flush()
            _atomic_json(done_path, {"done": n + 1, "meta": meta, "seconds": round(spent + time.time() - t0, 1)})
    bar.close()
    for m in mm.values():
        m.flush()
    del mm
    return FeatureSet(d)


class FeatureSet:
    """A captured set, memory-mapped (see the module docstring for the files)."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        state = json.loads((d / "done.json").read_text())
        self.meta = state["meta"]
        n = int(self.meta["conversations"])
        if int(state["done"]) < n:
            raise RuntimeError(f"{d}: capture incomplete ({state['done']}/{n}); rerun the capture stage")
        self.ids = np.load(d / "ids.npy")
        self.gen = np.load(d / "gen.npy")
        self.offsets = np.load(d / "offsets.npy")
        self.aux = np.load(d / "aux.npy", mmap_mode="r")
        self.topk_ids = np.load(d / "topk_ids.npy", mmap_mode="r")
        self.topk_p = np.load(d / "topk_p.npy", mmap_mode="r")
        self.layer_ids = tuple(self.meta["target_layer_ids"])
        self.seconds = float(state.get("seconds", 0.0))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def get(self, i: int, end: int | None = None) -> dict[str, torch.Tensor]:
        """Conversation ``i`` (its first ``end`` tokens): ids [L] int64, gen [L] bool, aux [L, A] bf16,
        topk_ids [L, K] int64, topk_p [L, K] fp32."""
        a = int(self.offsets[i])
        b = int(self.offsets[i + 1]) if end is None else a + end
        return {"ids": torch.from_numpy(self.ids[a:b].astype(np.int64)),
                "gen": torch.from_numpy(self.gen[a:b].astype(bool)),
                "aux": torch.from_numpy(np.array(self.aux[a:b])).view(torch.bfloat16),
                "topk_ids": torch.from_numpy(self.topk_ids[a:b].astype(np.int64)),
                "topk_p": torch.from_numpy(self.topk_p[a:b].astype(np.float32))}
