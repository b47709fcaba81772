"""The CPU's flags that decide the dtype to time and serve in: native bf16 or not.

Below the plugin's patches (the CPU platform patch warns with :func:`emulated_bf16_note`) and
the tools (``tools/cpu_setup.py`` describes the machine for records, the demo picks its dtype with
:func:`native_dtype`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def read(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, list[str]]:
    """The CPU's model name and which of :data:`FLAGS` it has (``"unknown"``, [] where unreadable)."""
    model, flags = "unknown", []
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in FLAGS if f in have]
                break
    except OSError:
        pass
    return model, flags


def has_native_bf16(flags: Sequence[str] | None = None) -> bool:
    flags = read()[1] if flags is None else flags
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_dtype(native_bf16: bool | None = None) -> str:
    """The dtype speed is measured in here: ``bfloat16`` where the CPU has native bf16, else ``float32``
    (emulated bf16 is slower than float32 and prices a verify step's tokens as decode steps)."""
    return "bfloat16" if (has_native_bf16() if native_bf16 is None else native_bf16) else "float32"


def emulated_bf16_note(dtype: str, speculative: bool, native_bf16: bool | None = None) -> str | None:
    """A warning for speculation served in bf16 on a CPU without native bf16 (``avx512_bf16`` or
    ``amx_bf16``), else None. There bf16 matmuls are emulated: a verify step of k tokens costs about
    k decode steps (the default pair's start-up profile on the AVX2 EPYC: 38 ms for 1 token, 66 for
    2, 128 for 4; in float32 42, 44, 51), so no draft can pay and DSpark's budget drafts little."""
    if not speculative or "bfloat16" not in str(dtype):
        return None
    if has_native_bf16() if native_bf16 is None else native_bf16:
        return None
    return ("this CPU has no native bf16 (no avx512_bf16 or amx_bf16): bf16 matmuls are emulated, a verify step "
            "costs about one decode step per token, and speculative decoding cannot pay; serve in float32 "
            "(--dtype float32) for the drafts to pay")
