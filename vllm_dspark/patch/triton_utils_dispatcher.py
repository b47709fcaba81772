"""Patch of ``vllm.triton_utils.dispatcher``: the kernel-override scan survives objects that fake ``__dict__``.

When an engine starts, vLLM's CPU platform registers its replacements of
Triton kernels (``register_kernels``), and ``_rebind_kernels`` walks every
loaded module's namespace to re-point copies of the originals. For each value
that ``hasattr(value, "__dict__")``, it reads ``vars(value).get("kernel")``.

llvmlite's library handle (``llvmlite.binding.ffi.lib``) answers any attribute
name with a wrapper around a C function of that name, ``__dict__`` included.
``vars`` then returns that wrapper, ``.get`` raises ``AttributeError``, and the
engine fails to start. llvmlite is loaded by numba, which vLLM's n-gram proposer
imports. So in a process that has built an n-gram engine, or imported numba for
any other reason, no further in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
can be built: seen in the lockstep benchmark's second build.

While ``_rebind_kernels`` runs, ``vars`` in its module resolves to
:func:`instance_dict`, which gives an object's real instance dict, and an empty
one where ``__dict__`` is not a mapping. Such an object holds no kernel, so
nothing the scan should find is skipped. The scan also touches
``torch.distributed.reduce_op``, a deprecated object that warns on every
attribute read (a FutureWarning per engine start, the user cannot act on it):
that one warning is silenced while the scan runs, nothing else.
"""

from __future__ import annotations

import builtins
import warnings
from collections.abc import Mapping
from typing import Any

from vllm_dspark.patch.registry import Patch, register_patch


def instance_dict(obj: Any) -> Mapping:
    """``vars(obj)``, or an empty mapping when what ``obj`` calls its ``__dict__`` is not one."""
    d = builtins.vars(obj)
    return d if isinstance(d, Mapping) else {}


def _make_rebind(original):
    def _rebind_kernels(overrides):
        g = original.__globals__
        shadowed = g.get("vars", _MISSING)
        g["vars"] = instance_dict
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op.* is deprecated",
                                        category=FutureWarning)
                return original(overrides)
        finally:
            if shadowed is _MISSING:
                g.pop("vars", None)
            else:
                g["vars"] = shadowed
    return _rebind_kernels


_MISSING = object()

PATCH = register_patch(Patch(
    name="kernel-scan-fake-dict",
    module="vllm.triton_utils.dispatcher",
    attribute="_rebind_kernels",
    what="while the kernel-override scan runs, vars() of an object whose __dict__ is not a mapping gives {}",
    why="llvmlite's library handle (loaded with numba, which the n-gram proposer imports) fakes __dict__; "
        "the scan's vars(value).get raised AttributeError and no further in-process engine could start",
    versions=("0.32",),
    removable_when="vLLM's _rebind_kernels reads instance dicts without trusting __dict__ (or catches the error)",
    make=_make_rebind,
))
