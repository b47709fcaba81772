"""Registry of the plugin's patches to upstream vLLM.

Each patch lives in its own file under ``vllm_dspark/patch/``, named after the
upstream module it changes. A ``Patch`` records what it changes, why, the vLLM
versions it was written for and what would let it go. Originals are kept, so
``restore_all()`` puts vLLM back exactly as it was (the tests use this).

A ``lazy`` patch is for a module the plugin must not import itself (the n-gram
proposer pulls in numba, and vLLM's CPU worker scans every loaded module for
kernels to override): it is applied as soon as something else imports it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
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
    lazy: bool = False  # applied when ``module`` is first imported, if it is not yet
    prepare: Callable[[], None] | None = None  # a lazy patch's work just before its module runs
    _original: Any = field(default=None, repr=False)
    _hook: Any = field(default=None, repr=False)
    applied: bool = False

    def _owner_and_name(self):
        mod = importlib.import_module(self.module)
        parts = self.attribute.split(".")
        owner = mod
        for p in parts[:-1]:
            owner = getattr(owner, p)
        return owner, parts[-1]

    def apply(self) -> None:
        if self.applied or self._hook is not None:
            return
        if self.lazy and self.module not in sys.modules:
            self._hook = _ApplyOnImport(self)
            sys.meta_path.insert(0, self._hook)
            return
        self._apply_now()

    def _apply_now(self) -> None:
        if self.applied:  # a lazy patch's module may call apply_all while it runs
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
        self._drop_hook()
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

    def _drop_hook(self) -> None:
        if self._hook is not None:
            if self._hook in sys.meta_path:
                sys.meta_path.remove(self._hook)
            self._hook = None


class _ApplyOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of one module so that its patch is applied
    right after the module has run."""

    def __init__(self, patch: Patch):
        self.patch = patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.patch.module:
            return None
        sys.meta_path.remove(self)  # the real finders answer, and this hook fires once
        self.patch._hook = None
        if self.patch.prepare is not None:
            self.patch.prepare()
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        patch, run = self.patch, loader.exec_module

        def exec_module(module):
            run(module)
            patch._apply_now()

        loader.exec_module = exec_module
        return spec


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
