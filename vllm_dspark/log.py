"""vllm_dspark's log lines go where vLLM's go (bottom layer: any module may call it)."""

from __future__ import annotations

import logging


def share_vllm_logging() -> None:
    """Attach vLLM's handlers, format and level to the ``vllm_dspark`` logger (every process).

    vLLM configures its handlers after the plugin loaded, so callers that log
    early (the CPU platform patch) call this again once vLLM's are there.
    """
    ours = logging.getLogger("vllm_dspark")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False
