"""Where vllm_dspark keeps what it computes once: the converted default target, cost profiles.

``$VLLM_DSPARK_CACHE``, else ``$XDG_CACHE_HOME/vllm_dspark``, else ``~/.cache/vllm_dspark``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("VLLM_DSPARK_CACHE")
    if env:
        return Path(env).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return (base / "vllm_dspark").resolve()
