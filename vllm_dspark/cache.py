"""Where vllm_dspark keeps what it computes once: the converted default target, cost profiles.

``$VLLM_DSPARK_CACHE``, else ``$XDG_CACHE_HOME/vllm_dspark``, else ``~/.cache/vllm_dspark``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("VLLM_DSPARK_CACHE")
    if env:
        return Path(env).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return (base / "vllm_dspark").resolve()


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks (the cache's way of telling a file changed)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()
