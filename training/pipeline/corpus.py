"""The training corpus: the Python standard library's source on this machine.

Every machine that runs Python has it, so the bundled pair can be regenerated
anywhere without a download. Files are ordered by their path relative to the
library root, and split into train and held-out sets by a hash of that path, so
the split does not depend on which files a given Python build happens to ship.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directories never used: tests (huge, repetitive fixtures), third-party code,
# and generated or data-heavy modules.
EXCLUDED_DIRS = frozenset({
    "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
    "lib2to3", "ensurepip", "_vendor",
})
# Files above this size are mostly data tables (e.g. unicode databases).
MAX_FILE_BYTES = 400_000


@dataclass(frozen=True)
class SourceFile:
    """One corpus document."""

    rel_path: str  # path relative to the stdlib root, '/'-separated
    text: str


def stdlib_root() -> Path:
    """Root of the running interpreter's standard library (``.../lib/pythonX.Y``)."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_heldout(rel_path: str, heldout_percent: int = 5) -> bool:
    """Whether a file belongs to the held-out split (stable hash of its path)."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") % 100 < heldout_percent


def list_sources(root: Path | None = None) -> list[SourceFile]:
    """All ``.py`` files under ``root``, sorted by relative path, excluded dirs skipped."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        out.append(SourceFile(rel.as_posix(), text))
    return out


def split_sources(files: list[SourceFile], heldout_percent: int = 5
                  ) -> tuple[list[SourceFile], list[SourceFile]]:
    """Split into ``(train, heldout)`` by :func:`is_heldout`."""
    train = [f for f in files if not is_heldout(f.rel_path, heldout_percent)]
    held = [f for f in files if is_heldout(f.rel_path, heldout_percent)]
    return train, held


def make_prompts(files: list[SourceFile], num_prompts: int, *, seed: int,
                 min_lines: int = 6, max_lines: int = 16, max_chars: int = 600
                 ) -> list[dict]:
    """Code prompts cut from ``files``: a run of whole lines ending inside a function.

    Each prompt starts at a line that begins a top-level or method ``def`` and
    stops after a few lines of its body, so the continuation is ordinary code
    the target has a chance of predicting.
    """
    rng = random.Random(seed)
    starts = []
    for f in files:
        lines = f.text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and i + min_lines < len(lines):
                starts.append((f.rel_path, lines, i))
    rng.shuffle(starts)
    prompts: list[dict] = []
    seen_files: dict[str, int] = {}
    for rel, lines, i in starts:
        if seen_files.get(rel, 0) >= 3:  # spread prompts across files
            continue
        n = rng.randint(min_lines, max_lines)
        text = "".join(lines[i:i + n])
        if len(text) > max_chars or len(text.strip()) < 40:
            continue
        prompts.append({"prompt": text, "source": rel, "line": i + 1})
        seen_files[rel] = seen_files.get(rel, 0) + 1
        if len(prompts) >= num_prompts:
            break
    return prompts


def write_jsonl(rows: list[dict], path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
