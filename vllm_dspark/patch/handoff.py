"""The one hand-off between the two start-up patches: the speculative config's ``"dspark"`` block.

vLLM's ``SpeculativeConfig`` forbids unknown fields, so the engine-args patch
(``engine_arg_utils``) takes the block out of the user's dict and calls vLLM's
own ``create_speculative_config`` inside :func:`carrying`; the config patch
(``config_speculative``), which vLLM calls from there, reads it with
:func:`current` and validates it with the draft. Nothing else reads or sets it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

_options: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "vllm_dspark_spec_options", default=None)


@contextlib.contextmanager
def carrying(options: Mapping[str, Any]) -> Iterator[None]:
    """Make ``options`` the DSpark block of the speculative config built inside this block."""
    token = _options.set(options)
    try:
        yield
    finally:
        _options.reset(token)


def current() -> Mapping[str, Any] | None:
    """The DSpark block of the speculative config being built, or None when none was given."""
    return _options.get()
