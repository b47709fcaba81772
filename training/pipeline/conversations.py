"""The generated conversations, committed: a new machine re-captures features from them instead of
regenerating (the default pair's generation took 106 min on an AVX-512 bf16 machine, hours without).

One compressed ``.npz`` per set (``eval_sharegpt``, ``eval_chat``, ``eval_humaneval``,
``train_text``) under ``vllm_dspark/assets/smollm2/conversations/`` holds exactly what
``generate.py``'s ``done.jsonl`` holds, row for row:

* ``ids`` uint16 [T] every token of every conversation, end to end (the vocabulary is
  49,152 < 2^16; a larger one is refused), ``offsets`` int64 [N + 1];
* ``spans`` int32 [S, 2] the answers' ``[start, end)`` within their conversation,
  ``span_offsets`` int64 [N + 1];
* ``index`` int32 [N] the conversation's row in ``prompts.json``, ``temperature`` fp32 [N],
  ``kind`` uint8 [N] into ``meta["kinds"]``; ``meta`` (JSON) the generation summary.

:func:`restore` writes an archive back as ``done.jsonl`` + ``summary.json`` when the
cache holds fewer conversations, so ``generate`` continues after the last archived one
(a partly generated set is archived too, and resumed on the next machine).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

SETS = ("eval_sharegpt", "eval_chat", "eval_humaneval", "train_text")


def pack(rows: Sequence[dict], path: str | Path, summary: dict | None = None) -> dict:
    """Write ``rows`` (``done.jsonl``'s) to ``path`` atomically; returns the archive's counts."""
    ids = [np.asarray(r["ids"], dtype=np.int64) for r in rows]
    top = max((int(x.max()) for x in ids if len(x)), default=0)
    if top >= 1 << 16:
        raise ValueError(f"token id {top} does not fit the archive's uint16 ids")
    kinds = sorted({str(r.get("kind", "chat")) for r in rows})
    spans = [np.asarray(r["gen_spans"], dtype=np.int32).reshape(-1, 2) for r in rows]
    arrays: dict[str, Any] = {
        "ids": np.concatenate(ids).astype(np.uint16) if ids else np.zeros(0, np.uint16),
        "offsets": np.concatenate([[0], np.cumsum([len(x) for x in ids])]).astype(np.int64),
        "spans": np.concatenate(spans) if spans else np.zeros((0, 2), np.int32),
        "span_offsets": np.concatenate([[0], np.cumsum([len(s) for s in spans])]).astype(np.int64),
        "index": np.asarray([r["i"] for r in rows], dtype=np.int32),
        "temperature": np.asarray([r.get("temperature", 0.0) for r in rows], dtype=np.float32),
        "kind": np.asarray([kinds.index(str(r.get("kind", "chat"))) for r in rows], dtype=np.uint8),
        "meta": np.frombuffer(json.dumps({"kinds": kinds, "summary": summary or {}}).encode(), dtype=np.uint8),
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, out)
    return {"conversations": len(rows), "tokens": int(arrays["offsets"][-1]),
            "generated": int(sum(int((s[:, 1] - s[:, 0]).sum()) for s in spans))}


def unpack(path: str | Path) -> tuple[list[dict], dict]:
    """The rows an archive holds (``done.jsonl``'s format) and its summary."""
    with np.load(path) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        ids, off = z["ids"].astype(np.int64), z["offsets"]
        spans, soff = z["spans"], z["span_offsets"]
        rows = [{"i": int(z["index"][n]), "kind": meta["kinds"][int(z["kind"][n])],
                 "temperature": float(z["temperature"][n]), "ids": ids[off[n]:off[n + 1]].tolist(),
                 "gen_spans": spans[soff[n]:soff[n + 1]].tolist()} for n in range(len(z["index"]))]
    return rows, meta["summary"]


def read_rows(path: str | Path) -> list[dict]:
    """``done.jsonl``'s complete lines, without repairing the file: a generator may be appending to it
    (``generate.read_done`` cuts a half-written last line off, which only the writer may do)."""
    p = Path(path)
    if not p.exists():
        return []
    rows = []
    for line in p.read_bytes().splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def restore(archive: str | Path, set_dir: str | Path, log=print) -> int:
    """Seed ``set_dir/done.jsonl`` from ``archive`` when the archive holds more conversations than the
    cache; returns how many conversations the cache holds afterwards."""
    from training.pipeline.generate import read_done

    d = Path(set_dir)
    have = read_done(d / "done.jsonl")
    if not Path(archive).exists():
        return len(have)
    rows, summary = unpack(archive)
    if len(rows) <= len(have):
        return len(have)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / "done.jsonl.tmp"
    with open(tmp, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r, separators=(",", ":")) + "\n")
    os.replace(tmp, d / "done.jsonl")
    if summary:
        (d / "summary.json").write_text(json.dumps(summary, indent=1))
    log(f"[generate] {d.name}: restored {len(rows)} conversations from {archive}")
    return len(rows)
