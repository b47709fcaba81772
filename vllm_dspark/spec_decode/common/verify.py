"""How many of each request's drafts the target verifies: the fixed, threshold and product rules.

The budget rule lives in :mod:`.budget`; these are the per-request rules, all
pure functions of the confidences so the tests check them without an engine.

* ``fixed``: ``cap`` drafts (``num_speculative_tokens``).
* ``threshold`` (the DSpark reference, DeepSpec ``_confident_prefix_length``):
  the drafts before the FIRST position whose own confidence is below ``t``.
* ``product`` (this project's earlier rule, kept for comparison): the longest
  prefix whose running product of confidences stays ``>= t``.

Example, confidences [.95, .9, .9, .85, .8, .8, .7] at t = 0.8: ``threshold``
keeps 6, ``product`` keeps 2.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np


def threshold_length(conf: Sequence[float], t: float) -> int:
    if t <= 0:
        return len(conf)
    for i, c in enumerate(conf):
        if c < t:
            return i
    return len(conf)


def product_length(conf: Sequence[float], t: float) -> int:
    if t <= 0:
        return len(conf)
    run = 1.0
    for i, c in enumerate(conf):
        run *= float(c)
        if run < t:
            return i
    return len(conf)


def rule_lengths(conf: np.ndarray, caps: Sequence[int], rule: str, t: float) -> list[int]:
    """Kept drafts per request for a per-request rule ([R, N] confidences, [R] caps)."""
    out = []
    for row, cap in zip(conf, caps):
        if rule == "fixed":
            k = len(row)
        elif rule == "threshold":
            k = threshold_length(row, t)
        elif rule == "product":
            k = product_length(row, t)
        else:
            raise ValueError(f"unknown verification rule {rule!r}")
        out.append(max(0, min(int(cap), k)))
    return out


class VerifyStats:
    """What the verification rule kept, and what the target then accepted (thread-safe counters)."""

    FIELDS = ("steps", "steps_drafted", "steps_probed", "steps_skipped", "requests", "tokens_drafted",
              "tokens_admitted", "empty_drafts", "drafts_observed", "tokens_verified_observed", "tokens_accepted")
    # Set to 0 for each name in FIELDS by __init__ (declared here for type checkers).
    steps: int
    steps_drafted: int  # the drafter ran: full drafting steps and probes
    steps_probed: int  # of which probes (a few requests' first drafts only)
    steps_skipped: int
    requests: int
    tokens_drafted: int
    tokens_admitted: int
    empty_drafts: int
    drafts_observed: int  # (request, step) pairs that verified at least one draft: vLLM's num_drafts
    tokens_verified_observed: int
    tokens_accepted: int

    def __init__(self) -> None:
        self._lock = threading.Lock()
        for f in self.FIELDS:
            setattr(self, f, 0)
        self.accepted_per_position: list[int] = []  # drafts whose position j was accepted (vLLM's per-pos)
        # source -> [drafts observed, tokens verified, tokens accepted] (the drafter, the copy source)
        self.by_source: dict[str, list[int]] = {}

    def add_step(self, *, drafted: bool, cap: int, kept: Sequence[int], probe: bool = False) -> None:
        with self._lock:
            self.steps += 1
            if not drafted:
                self.steps_skipped += 1
                return
            self.steps_drafted += 1
            if probe:  # only the probed requests drafted, and only what they verify
                self.steps_probed += 1
                self.requests += sum(1 for k in kept if k > 0)
                self.tokens_drafted += int(sum(kept))
                self.tokens_admitted += int(sum(kept))
                return
            self.requests += len(kept)
            self.tokens_drafted += cap * len(kept)
            self.tokens_admitted += int(sum(kept))
            self.empty_drafts += sum(1 for k in kept if k == 0)

    def add_acceptance(self, verified: int, accepted: int, source: str = "dspark") -> None:
        with self._lock:
            per = self.by_source.setdefault(source, [0, 0, 0])
            per[0] += 1 if verified > 0 else 0
            per[1] += verified
            per[2] += accepted
            self.drafts_observed += 1 if verified > 0 else 0
            self.tokens_verified_observed += verified
            self.tokens_accepted += accepted
            if accepted > len(self.accepted_per_position):
                self.accepted_per_position += [0] * (accepted - len(self.accepted_per_position))
            for j in range(accepted):
                self.accepted_per_position[j] += 1

    def as_dict(self) -> dict:
        with self._lock:
            return {**{f: getattr(self, f) for f in self.FIELDS},
                    "accepted_per_position": list(self.accepted_per_position),
                    "by_source": {k: dict(zip(("drafts", "verified", "accepted"), v, strict=True))
                                  for k, v in self.by_source.items()}}

    def line(self, mode: str) -> str:
        d = self.as_dict()
        adm = d["tokens_admitted"] / d["tokens_drafted"] if d["tokens_drafted"] else 0.0
        acc = d["tokens_accepted"] / d["tokens_verified_observed"] if d["tokens_verified_observed"] else 0.0
        return (f"DSpark verification ({mode}): admitted {d['tokens_admitted']}/{d['tokens_drafted']} drafted "
                f"tokens ({adm:.1%}), {d['empty_drafts']} empty drafts, {d['steps_skipped']}/{d['steps']} steps "
                f"without drafting, {d['steps_probed']} probes; accepted {d['tokens_accepted']}/"
                f"{d['tokens_verified_observed']} verified draft tokens ({acc:.1%})" + _by_source(d["by_source"]))


def _by_source(per: dict) -> str:
    """The per-source split, when more than the drafter drafted."""
    if set(per) <= {"dspark"}:
        return ""
    parts = [f"{k} {v['accepted']}/{v['verified']}" for k, v in sorted(per.items())]
    return " [" + ", ".join(parts) + "]"
