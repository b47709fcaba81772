"""The copy source's acceptance by match length, measured offline and stored with the drafter.

Without it the copy's calibrator starts from the pessimistic prior every source starts from: no
copy is sent before probes have measured some, and 151 of 196 steps on copy-heavy requests sent
none (the record ``docs/benchmarks/copy-e2e-float32``, in git's history). n-gram drafts every
match from the first step. The prior makes the copy as eager where its matches are as good:
:func:`measure` replays greedy answers as served with the copy drafting at every step (the index
over the prompt and the answer so far, the drafts verified against what the target wrote, the step
advancing by what was accepted) and counts, per draft position and per confidence bin (a
match-length class, ``match_confidence``), what the copy's calibrator would have counted.
:meth:`Calibrator.seed` starts from those rates, weighed as a few dozen observations, and online
evidence takes over.

The file (``copy_prior.json`` beside the drafter's ``config.json``) is a property of the target's
text, measured on the answers the drafter was evaluated on (``training/copy_prior.py`` writes it).
A drafter without one serves as before: the copy proves itself online.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vllm_dspark.spec_decode.common.calibration import Calibrator
from vllm_dspark.spec_decode.common.suffix_index import SuffixIndex, match_confidence

PRIOR_FILE = "copy_prior.json"
FORMAT = "vllm_dspark.copy_prior/1"


class CopyPriorError(ValueError):
    """A copy prior file that cannot be used; the message names the file and the fix."""


@dataclass
class CopyPrior:
    """[positions, bins] hits, counts and summed confidences of copied drafts, greedy."""

    hits: np.ndarray
    counts: np.ndarray
    pred: np.ndarray
    min_match: int
    max_match: int
    meta: dict = field(default_factory=dict)

    @property
    def bins(self) -> int:
        return int(self.counts.shape[1])

    def accepted_per_step(self) -> float:
        """Mean accepted copied tokens per drafting step (position 0's count is the steps)."""
        steps = float(self.counts[0].sum())
        return float(self.hits.sum() / steps) if steps else 0.0

    def to_dict(self) -> dict:
        return {"format": FORMAT, "min_match": self.min_match, "max_match": self.max_match,
                "hits": self.hits.tolist(), "counts": self.counts.tolist(), "pred": self.pred.tolist(),
                "accepted_per_step": round(self.accepted_per_step(), 4), "meta": self.meta}

    def save(self, path: str | Path) -> None:
        """Write atomically (a half-written prior would refuse to load)."""
        out = Path(path)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        os.replace(tmp, out)


def load(draft_dir: str | Path) -> CopyPrior | None:
    """The prior stored with the drafter at ``draft_dir``, or None when it has none."""
    path = Path(draft_dir) / PRIOR_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT!r}")
        arrays = [np.asarray(raw[k], dtype=np.float64) for k in ("hits", "counts", "pred")]
        if arrays[0].ndim != 2 or any(a.shape != arrays[0].shape for a in arrays):
            raise ValueError("hits, counts and pred must be [positions, bins] tables of one shape")
        if (arrays[0] > arrays[1] + 1e-9).any() or (arrays[1] < 0).any():
            raise ValueError("hits exceed counts, or counts are negative")
        hits, counts, pred = arrays
        return CopyPrior(hits, counts, pred, int(raw["min_match"]), int(raw["max_match"]), dict(raw.get("meta", {})))
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise CopyPriorError(f"the copy prior {path} cannot be used ({e}); rewrite it with "
                             f"training/copy_prior.py, or delete it to let the copy prove itself online") from e


def measure(texts: Iterable[tuple[Sequence[int], Sequence[tuple[int, int]]]], positions: int, *,
            min_match: int = 2, max_match: int = 8, bins: int = 10) -> CopyPrior:
    """Replay each text's answers (``[start, end)`` spans of its tokens, each written greedily by the
    target after what precedes it) with the copy drafting up to ``positions`` tokens at every step."""
    # Counted by the copy's own calibrator (greedy mode, nothing faded), so the prior holds exactly what
    # serving would have counted.
    cal = Calibrator(positions, bins=bins, memory=0)
    steps = answers = 0
    for tokens, spans in texts:
        tokens = [int(t) for t in tokens]
        for start, end in spans:
            if end - start < 2:
                continue
            answers += 1
            idx = SuffixIndex(min_match, max_match)
            idx.extend(tokens[: start + 1])  # the prompt and the answer's first token (the prefill's)
            t = start
            while t < end - 1:
                got, match = idx.propose(positions)
                accepted = 0
                if got:
                    steps += 1
                    truth = tokens[t + 1: end]
                    while accepted < min(len(got), len(truth)) and got[accepted] == truth[accepted]:
                        accepted += 1
                    cal.observe([match_confidence(match)] * len(got), len(got), accepted, False)
                step = min(accepted + 1, end - 1 - t)  # the accepted drafts and the target's own token
                idx.extend(tokens[t + 1: t + 1 + step])
                t += step
    meta = {"answers": answers, "drafting_steps": steps}
    return CopyPrior(cal.total_hits[0], cal.total_counts[0], cal.total_pred[0], min_match, max_match, meta)
