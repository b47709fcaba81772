"""The DSpark proposer's acceptance per draft source (the drafter, the copy source) on vLLM's ``/metrics``.

vLLM's own spec-decode counters (``vllm:spec_decode_num_draft_tokens`` ...) are made by the scheduler,
which does not know which source drafted a token; the proposer does (``VerifyStats.by_source``). It runs
in the worker, while ``/metrics`` is served by the API server's process, so the counts travel through a
small file: the process that loads the plugin first (the API server, or the ``LLM`` script) names a
directory in ``VLLM_DSPARK_METRICS_DIR``, which the engine and its workers inherit; the TP rank-0
proposer writes its counters there (atomically, at most every ``PUBLISH_INTERVAL_S`` and when its
report is read); a collector on ``prometheus_client``'s default registry sums the files at each scrape:

    vllm:dspark_spec_decode_num_drafts_total{model_name=..., source="dspark"|"copy"}
    vllm:dspark_spec_decode_num_draft_tokens_total{source=...}      verified draft tokens
    vllm:dspark_spec_decode_num_accepted_tokens_total{source=...}

with the definitions of vLLM's unlabelled counters of the same names (a draft is a (request, step) that
verified at least one token). They trail vLLM's by what the last steps' acceptances were not yet fed
back (the proposer learns a step's acceptances at the next step).

Not shown: with ``--api-server-count`` > 1 (vLLM then serves a multi-process registry), or when the
rank-0 worker does not share a file system with the API server (Ray across nodes).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ENV = "VLLM_DSPARK_METRICS_DIR"
PUBLISH_INTERVAL_S = 1.0
FIELDS = ("drafts", "verified", "accepted")  # VerifyStats.as_dict()["by_source"]'s keys
NAMES = {"drafts": ("vllm:dspark_spec_decode_num_drafts", "Drafts (requests x steps with a verified draft token)"),
         "verified": ("vllm:dspark_spec_decode_num_draft_tokens", "Draft tokens verified"),
         "accepted": ("vllm:dspark_spec_decode_num_accepted_tokens", "Draft tokens accepted")}

_ids = itertools.count()
_lock = threading.Lock()
_collector = None


def ensure_dir() -> Path:
    """The directory of this process tree (made here, and removed at exit, when no parent named one)."""
    existing = os.environ.get(ENV)
    if existing:
        return Path(existing)
    path = tempfile.mkdtemp(prefix="vllm_dspark-metrics-")
    os.environ[ENV] = path
    import atexit

    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:  # forked children inherit the handler; the maker removes the directory
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    return Path(path)


def register_collector() -> None:
    """Add the per-source counters to ``prometheus_client``'s default registry (once per process)."""
    global _collector
    with _lock:
        if _collector is not None:
            return
        from prometheus_client import REGISTRY

        _collector = SourceCollector(ensure_dir())
        REGISTRY.register(_collector)


def read_totals(directory: Path) -> dict[tuple[str, str], dict[str, int]]:
    """{(model name, source): {drafts, verified, accepted}} summed over the publishers' files in ``directory``."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    for f in sorted(directory.glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue  # a publisher's file is replaced atomically; a vanished one is skipped
        for source, counts in data["by_source"].items():
            tot = out.setdefault((data["model_name"], source), dict.fromkeys(FIELDS, 0))
            for k in FIELDS:
                tot[k] += int(counts.get(k, 0))
    return out


class SourceCollector:
    """A ``prometheus_client`` collector reading the publishers' files at each scrape."""

    def __init__(self, directory: Path):
        self.directory = directory

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily

        totals = read_totals(self.directory)
        for field in FIELDS:
            name, doc = NAMES[field]
            fam = CounterMetricFamily(name, f"DSpark: {doc}, by draft source.", labels=["model_name", "source"])
            for key in sorted(totals):
                fam.add_metric(list(key), totals[key][field])
            yield fam


class Publisher:
    """The proposer's side: its ``by_source`` counters written to its own file in the directory."""

    def __init__(self, model_name: str = "", directory: str | None = None, interval_s: float = PUBLISH_INTERVAL_S):
        d = directory or os.environ.get(ENV)
        self.model_name = model_name
        self.path = None if not d else Path(d) / f"{os.getpid()}-{next(_ids)}.json"
        self.interval_s = interval_s
        self._last = float("-inf")
        self._written: dict | None = None

    def maybe_publish(self, by_source: Callable[[], dict[str, dict[str, int]]], *, force: bool = False) -> None:
        """``by_source()``: ``VerifyStats.as_dict()["by_source"]`` ({source: {drafts, verified, accepted}}),
        read only when a write is due (this runs every step)."""
        now = time.monotonic()
        if self.path is None or (not force and now - self._last < self.interval_s):
            return
        self._last = now
        data = {"model_name": self.model_name,
                "by_source": {s: {k: int(v[k]) for k in FIELDS} for s, v in by_source().items()}}
        if data == self._written:
            return
        tmp = self.path.with_suffix(".tmp")
        with contextlib.suppress(OSError):  # metrics never stop serving (a removed directory at exit)
            tmp.write_text(json.dumps(data))
            tmp.replace(self.path)
            self._written = data
