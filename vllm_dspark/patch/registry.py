"""Registry of the plugin's patches to upstream vLLM.

Each patch lives in its own file under ``vllm_dspark/patch/``, named after the
upstream module it changes. A ``Patch`` records what it changes, why, the vLLM
versions it was written for and what would let it go. Originals are kept, so
``restore_all()`` puts vLLM back exactly as it was (the tests use this).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_dspark.versions import UnsupportedVLLMVersion, series_of, supported_text

logger = logging.getLogger("vllm_dspark.patch")


@dataclass
class Patch:
    name: str
    module: str  # upstream module whose attribute is replaced
    attribute: str  # "Class.method" or a module-level name
    what: str
    why: str
    versions: tuple[str, ...]  # vLLM release series ("0.32") the patch was written against
    removable_when: str
    make: Callable[[Any], Any]  # original -> replacement
    rebind_in: tuple[str, ...] = ()  # other modules that imported the name directly
    _original: Any = field(default=None, repr=False)
    applied: bool = False

    def _owner_and_name(self):
        mod = importlib.import_module(self.module)
        parts = self.attribute.split(".")
        owner = mod
        for p in parts[:-1]:
            owner = getattr(owner, p)
        return owner, parts[-1]

    def apply(self) -> None:
        if self.applied:
            return
        owner, name = self._owner_and_name()
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        replacement = self.make(original)
        replacement.__dspark_patch__ = self.name
        setattr(owner, name, replacement)
        for other in self.rebind_in:
            m = importlib.import_module(other)
            if getattr(m, name, None) is original:
                setattr(m, name, replacement)
        self._original = original
        self.applied = True

    def restore(self) -> None:
        if not self.applied:
            return
        owner, name = self._owner_and_name()
        replacement = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, self._original)
        for other in self.rebind_in:
            m = importlib.import_module(other)
            if getattr(m, name, None) is replacement:
                setattr(m, name, self._original)
        self.applied = False


PATCHES: list[Patch] = []


def register_patch(patch: Patch) -> Patch:
    PATCHES.append(patch)
    return patch


def apply_all(vllm_version: str) -> list[str]:
    """Apply every registered patch; refuse (before changing anything) a vLLM one was not written for."""
    series = series_of(vllm_version)
    for p in PATCHES:
        if series not in p.versions:
            raise UnsupportedVLLMVersion(
                f"vllm_dspark patch {p.name!r} was written for vLLM {', '.join(p.versions)}, not "
                f"{vllm_version}; install a supported vLLM ({supported_text()})")
    for p in PATCHES:
        p.apply()
    return [p.name for p in PATCHES]


def restore_all() -> None:
    for p in reversed(PATCHES):
        p.restore()


def describe() -> list[dict[str, Any]]:
    return [dict(name=p.name, module=p.module, attribute=p.attribute, what=p.what, why=p.why,
                 versions=list(p.versions), removable_when=p.removable_when, applied=p.applied)
            for p in PATCHES]
