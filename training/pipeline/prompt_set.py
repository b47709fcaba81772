"""The training prompt set: deduplicated, and disjoint from every evaluation prompt.

Evaluation prompts are the hand-written chat set (``chat_eval.jsonl``),
HumanEval, and whatever the demo and the benchmarks send (they draw from those
two). A training prompt is dropped when it

* equals one after normalisation (case, whitespace and punctuation folded), or
* is a near-duplicate: at least ``NEAR_DUP`` of an evaluation prompt's word
  5-grams (3-grams for short prompts) occur in it, so a code prompt that
  restates a HumanEval task with other words around it is caught. On short
  prompts this is conservative: "How do I reverse a linked list in C?" is
  dropped for sharing half its 3-grams with "How do I reverse a string in
  Python?" (97 of 14,615 candidates were dropped this way), or
* names a HumanEval entry point (``has_close_elements``, ...).

The set actually used is recorded in the repository as hashes plus a MinHash
sketch per prompt (:func:`write_record`), so a test can check disjointness
without the 125 MB source file; the package reads it
(:mod:`vllm_dspark.tools.prompt_record`, whose hashing this module uses).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from vllm_dspark.tools.prompt_record import normalize, prompt_hash

NEAR_DUP = 0.5
NUM_PERM = 16
_MERSENNE = (1 << 61) - 1


def shingles(text: str, n: int | None = None) -> set[str]:
    words = normalize(text).split()
    if n is None:
        n = 5 if len(words) >= 12 else 3
    if len(words) < n:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def _perm_params(num_perm: int = NUM_PERM) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(20261201)
    a = rng.integers(1, _MERSENNE, size=num_perm, dtype=np.uint64)
    b = rng.integers(0, _MERSENNE, size=num_perm, dtype=np.uint64)
    return a, b


def minhash(text: str, n: int = 5, num_perm: int = NUM_PERM) -> np.ndarray:
    """[num_perm] uint16 MinHash of the word ``n``-gram set (a fixed, seeded family).

    16 bits of each minimum are kept: two different minima then collide with
    probability 2^-16, far below the resolution of a 16-value Jaccard estimate.
    """
    sh = shingles(text, n) or {""}
    x = np.array([int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") >> 3
                  for s in sh], dtype=np.uint64)
    a, b = _perm_params(num_perm)
    # (a * x + b) mod p on 61-bit values: split the product to stay inside uint64 arithmetic.
    vals = np.empty((num_perm, len(x)), dtype=np.uint64)
    for k in range(num_perm):
        vals[k] = [(int(a[k]) * int(v) + int(b[k])) % _MERSENNE for v in x]
    return (vals.min(axis=1) & np.uint64(0xFFFF)).astype(np.uint16)


class EvalIndex:
    """Evaluation prompts, indexed for the exact, near-duplicate and entry-point tests."""

    def __init__(self, eval_prompts: Sequence[str], entry_points: Iterable[str] = ()):
        self.prompts = list(eval_prompts)
        self.hashes = {prompt_hash(p) for p in self.prompts}
        self.sizes: list[int] = []
        self.by_shingle: dict[str, list[int]] = {}
        for i, p in enumerate(self.prompts):
            sh = shingles(p)
            self.sizes.append(len(sh))
            for s in sh:
                self.by_shingle.setdefault(s, []).append(i)
        # Short or generic names ("add", "sort_array") would catch unrelated prompts.
        self.entry_points = {e for e in entry_points if "_" in e and len(e) >= 10}

    def why_excluded(self, text: str) -> str | None:
        """None when ``text`` may be trained on, else the reason it may not."""
        if prompt_hash(text) in self.hashes:
            return "equal to an evaluation prompt"
        low = text.lower()
        for e in self.entry_points:
            if e in low:
                return f"names the HumanEval entry point {e}"
        hits: dict[int, int] = {}
        for n in (5, 3):
            for s in shingles(text, n):
                for i in self.by_shingle.get(s, ()):
                    hits[i] = hits.get(i, 0) + 1
        for i, h in hits.items():
            if self.sizes[i] and h / self.sizes[i] >= NEAR_DUP:
                return f"near-duplicate of evaluation prompt {i} ({h}/{self.sizes[i]} of its n-grams)"
        return None


def evaluation_index() -> EvalIndex:
    """Every prompt the evaluation, the demo and the benchmarks use."""
    from training.pipeline.chat_prompts import chat_eval_prompts, humaneval_entry_points, humaneval_prompts

    return EvalIndex(chat_eval_prompts() + humaneval_prompts(), humaneval_entry_points())


def write_record(path: str | Path, prompts: Sequence[str], kinds: Sequence[str], stats: dict) -> None:
    """Hashes and MinHash sketches of the prompts used, plus how the set was filtered (npz)."""
    import json
    import os

    p = Path(path)
    sketches = np.stack([minhash(t) for t in prompts]) if prompts else np.zeros((0, NUM_PERM), np.uint16)
    names = sorted(set(kinds))
    tmp = p.with_name(p.name + ".tmp.npz")
    np.savez_compressed(tmp, hashes=np.array([prompt_hash(t) for t in prompts], dtype=np.uint64),
                        kinds=np.array([names.index(k) for k in kinds], dtype=np.uint8),
                        kind_names=np.array(names), minhash=sketches, stats=np.array(json.dumps(stats)))
    os.replace(tmp, p)


def estimated_jaccard(sketches: np.ndarray, query: np.ndarray) -> np.ndarray:
    """[N] MinHash estimates of the Jaccard similarity of each recorded prompt with ``query``'s sketch."""
    return (sketches == query[None, :]).mean(axis=1)


def build(*, seed: int, num_code: int, num_heldout: int, log=print) -> dict:
    """Training conversations (ShareGPT human turns + code tasks) and held-out ShareGPT ones.

    Returns ``{"train": [{"turns": [...], "kind": ...}], "heldout": [...], "stats": {...}}``;
    the order is a seeded shuffle, so a prefix is a fair sample.
    """
    import random

    from training.pipeline import corpus, sharegpt
    from training.pipeline.chat_prompts import _code_prompt, code_tasks

    rng = random.Random(seed)
    index = evaluation_index()
    convs = [{"turns": t, "kind": "sharegpt"} for t in sharegpt.human_turn_lists(sharegpt.ensure_installed(log),
                                                                                   log=log)]
    files, _ = corpus.split_sources(corpus.list_sources())
    tasks = code_tasks(files)
    rng.shuffle(tasks)
    convs += [{"turns": [_code_prompt(t, rng)], "kind": "code"} for t in tasks[:num_code]]
    seen: set[int] = set()
    kept, why = [], {"duplicate": 0}
    for c in convs:
        h = prompt_hash(c["turns"][0])
        if h in seen:
            why["duplicate"] += 1
            continue
        reason = next((r for r in map(index.why_excluded, c["turns"]) if r), None)
        if reason is not None:
            key = ("near_duplicate" if reason.startswith("near") else
                   "humaneval_entry_point" if "entry point" in reason else "equal_to_eval")
            why[key] = why.get(key, 0) + 1
            continue
        seen.add(h)
        kept.append(c)
    rng.shuffle(kept)
    held = [c for c in kept if c["kind"] == "sharegpt"][:num_heldout]
    held_ids = {id(c) for c in held}
    train = [c for c in kept if id(c) not in held_ids]
    stats = {"candidates": len(convs), "kept": len(kept), "dropped": why, "train": len(train),
             "heldout": len(held), "code": sum(c["kind"] == "code" for c in train), "seed": seed}
    log(f"[prompts] {len(train):,} training conversations ({stats['code']:,} code), {len(held)} held out; "
        f"dropped {why}")
    return {"train": train, "heldout": held, "stats": stats}
