"""A token frequency table, and the serve-time draft vocabulary chosen from it.

A drafter that scores the target's whole vocabulary can be served over its N
most frequent tokens only (the ``draft_vocab`` setting): the LM head and the
Markov stage then work on N rows instead of V. The table that ranks the tokens
is a small JSON file (``token_frequency.json`` in the drafter's directory by
default; ``vllm-dspark vocab-table`` writes one)::

    {"format": "vllm_dspark.token_frequency/1", "vocab_size": V, "source": "how it was built",
     "tokens": T, "ids": [most frequent first, ...], "counts": [their counts, ...]}

``tokens`` is every token counted (the coverage's denominator); ``ids`` /
``counts`` rank the ids seen, at most :data:`MAX_IDS` of them (the rest are
the table's tail, unranked). The table is read at start-up (validation) and at
load time (the drafter's weights); this module has no torch or vLLM imports.

Serving stays lossless: the target verifies every draft, and a token outside
the draft vocabulary is simply never proposed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "vllm_dspark.token_frequency/1"
FILE_NAME = "token_frequency.json"
MAX_IDS = 32768  # the ranked ids a table keeps (a draft vocabulary past them is filled in id order)


class FrequencyTableError(ValueError):
    """A frequency table that cannot be read or does not fit; the message names the file and the fix."""


@dataclass(frozen=True)
class FrequencyTable:
    vocab_size: int
    source: str
    tokens: int  # every token counted
    ids: tuple[int, ...]  # ranked, most frequent first
    counts: tuple[int, ...]  # their counts, non-increasing
    path: str | None = None

    def coverage(self, ids: Iterable[int]) -> float:
        """The share of the counted tokens that ``ids`` cover (0 for an empty table)."""
        if self.tokens <= 0:
            return 0.0
        count = dict(zip(self.ids, self.counts))
        return sum(count.get(int(i), 0) for i in set(ids)) / self.tokens

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "vocab_size": self.vocab_size, "source": self.source, "tokens": self.tokens,
                "ids": list(self.ids), "counts": list(self.counts)}


def table_from_counts(counts: Mapping[int, int] | Sequence[int], *, vocab_size: int, source: str,
                      top: int = MAX_IDS) -> FrequencyTable:
    """A table from per-id counts (a mapping id -> count, or a sequence indexed by id): the ids seen,
    ranked by count (ties: lower id first), at most ``top`` of them."""
    items = counts.items() if isinstance(counts, Mapping) else enumerate(counts)
    pairs = [(int(i), int(c)) for i, c in items if int(c) > 0]
    bad = [i for i, _ in pairs if not 0 <= i < vocab_size]
    if bad:
        raise FrequencyTableError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    total = sum(c for _, c in pairs)
    pairs.sort(key=lambda p: (-p[1], p[0]))
    pairs = pairs[:top]
    return FrequencyTable(int(vocab_size), str(source), total, tuple(i for i, _ in pairs),
                          tuple(c for _, c in pairs))


def write_frequency_table(path: str | Path, table: FrequencyTable) -> Path:
    """Write ``table`` to ``path`` atomically (a temporary file beside it, then a rename)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table.to_dict(), separators=(",", ":")) + "\n")
    os.replace(tmp, out)
    return out


def load_frequency_table(path: str | Path) -> FrequencyTable:
    """Read and check a table; :class:`FrequencyTableError` names the file and what is wrong."""
    p = Path(path)
    fix = "rebuild it with `vllm-dspark vocab-table`"
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise FrequencyTableError(f"{p}: no such file; {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrequencyTableError(f"{p}: not a readable JSON frequency table ({exc}); {fix}") from None
    if not isinstance(raw, dict):
        raise FrequencyTableError(f"{p}: expected a JSON object; {fix}")
    if raw.get("format", FORMAT) != FORMAT:
        raise FrequencyTableError(f"{p}: format {raw.get('format')!r}, expected {FORMAT!r}; {fix}")
    v: Any = raw.get("vocab_size")
    tokens: Any = raw.get("tokens")
    ids: Any = raw.get("ids")
    counts: Any = raw.get("counts")

    def is_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    problems = []
    if not is_int(v) or v < 1:
        problems.append(f"vocab_size {v!r} is not a positive integer")
    if not isinstance(ids, list) or not isinstance(counts, list) or len(ids) != len(counts):
        problems.append("ids and counts must be two lists of one length")
    elif not all(is_int(i) for i in ids) or not all(is_int(c) and c >= 0 for c in counts):
        problems.append("ids and counts must hold non-negative integers")
    else:
        if is_int(v) and any(not 0 <= i < v for i in ids):
            problems.append(f"an id lies outside the vocabulary (0..{v - 1})")
        if len(set(ids)) != len(ids):
            problems.append("an id is listed twice")
        if any(a < b for a, b in zip(counts, counts[1:])):
            problems.append("counts are not ranked (most frequent first)")
        if not is_int(tokens) or tokens < sum(counts):
            problems.append(f"tokens {tokens!r} is below the sum of the counts")
    if problems:
        raise FrequencyTableError(f"{p}: " + "; ".join(problems) + f"; {fix}")
    assert isinstance(ids, list) and isinstance(counts, list) and is_int(v) and is_int(tokens)
    return FrequencyTable(int(v), str(raw.get("source", "")), int(tokens), tuple(ids), tuple(counts), str(p))


def draft_vocab_ids(table: FrequencyTable, n: int, *, required: Iterable[int] = ()) -> list[int]:
    """The draft vocabulary of size ``n``: the table's ``n`` most frequent ids, ascending.

    Past the table's ranked ids the rest are taken in id order. Each id of ``required`` (the
    target's end-of-sequence / end-of-turn ids) that is missing replaces the least frequent one.
    """
    v = table.vocab_size
    if not 1 <= n < v:
        raise FrequencyTableError(f"a draft vocabulary of {n} tokens: expected 1 <= N < {v} (the vocabulary)")
    must = [r for r in dict.fromkeys(int(r) for r in required) if 0 <= r < v]
    if len(must) > n:
        raise FrequencyTableError(f"a draft vocabulary of {n} tokens cannot hold the {len(must)} end-of-sequence "
                                  f"ids {must}")
    chosen = list(table.ids[:n])
    if len(chosen) < n:
        ranked = set(chosen)
        chosen += [i for i in range(v) if i not in ranked][: n - len(chosen)]
    have = set(chosen)
    missing = [r for r in must if r not in have]
    keep = set(must)
    slot = len(chosen) - 1
    for r in missing:
        while chosen[slot] in keep:  # never evict a required id
            slot -= 1
        chosen[slot] = r
        slot -= 1
    return sorted(chosen)
