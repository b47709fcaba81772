"""Upstream vLLM's own source, read at test time from its PyPI sdist (never copied into this repository).

Tests that check the plugin against a vLLM release that is not installed here
(vLLM 0.33's V2 model runner needs a CUDA build) use this module to

* download the release's source distribution once into
  ``vllm_dspark.cache.cache_dir() / "upstream"`` (:func:`fetch_sdist`): the
  sha256 comes from PyPI's JSON API and is checked before the file is moved
  into place (temporary file + rename, so an interrupted download leaves
  nothing behind);
* read files straight out of the tarball (:class:`Sdist`), nothing installed;
* execute chosen upstream files as private modules (:class:`UpstreamModules`):
  each runs under the name ``<prefix>.<upstream name>``, never under ``vllm.*``,
  so the installed vLLM stays untouched. An import inside a loaded file
  resolves to another chosen upstream file, to a stub the caller names
  explicitly, or else to the installed vLLM.

Upstream Triton kernels can run on a CPU in Triton's interpreter: a module
listed in ``interpret_triton`` is executed with ``TRITON_INTERPRET=1`` (Triton
reads it when ``@triton.jit`` decorates), and :func:`real_triton_utils` stands in
for ``vllm.triton_utils`` (whose CPU build hands out placeholders).
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import importlib.util
import json
import linecache
import os
import sys
import tarfile
import tempfile
import types
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

from vllm_dspark.cache import cache_dir, file_sha256

PYPI = "https://pypi.org/pypi"


class UpstreamUnavailable(RuntimeError):
    """The sdist could not be obtained (no network, PyPI error, or a checksum mismatch)."""


def sdist_release(project: str, version: str, *, timeout: float = 30.0) -> tuple[str, str, str]:
    """``(url, sha256, filename)`` of ``project==version``'s sdist, from PyPI's JSON API.

    Asks the release's own endpoint first, then the project's (its ``releases``
    table has the same entries); relative URLs, as some PyPI mirrors serve
    them, are resolved against the endpoint that gave them.
    """
    errors = []
    for endpoint in (f"{PYPI}/{project}/{version}/json", f"{PYPI}/{project}/json"):
        try:
            with urllib.request.urlopen(endpoint, timeout=timeout) as resp:
                data = json.load(resp)
        except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts, bad JSON
            errors.append(f"{endpoint}: {exc}")
            continue
        files = data.get("urls") if endpoint.endswith(f"/{version}/json") else data.get("releases", {}).get(version)
        for f in files or []:
            if f.get("packagetype") == "sdist":
                return urljoin(endpoint, f["url"]), f["digests"]["sha256"], f["filename"]
        errors.append(f"{endpoint}: no sdist listed for {project} {version}")
    raise UpstreamUnavailable(f"can't locate the sdist of {project} {version} on PyPI: " + "; ".join(errors))


def fetch_sdist(project: str = "vllm", version: str = "0.33.0", *, directory: Path | None = None,
                timeout: float = 120.0) -> Path:
    """The sdist of ``project==version``, downloaded once and verified against PyPI's sha256.

    A verified copy is reused without network access: its digest is kept next
    to it (``<file>.sha256``, written after the check) and rechecked on every
    call. Raises :class:`UpstreamUnavailable` when it can't be had.
    """
    directory = Path(directory) if directory is not None else cache_dir() / "upstream"
    stem = f"{project}-{version}"
    for cached in directory.glob(f"{stem}.tar.gz"):
        digest_file = cached.with_name(cached.name + ".sha256")
        if digest_file.is_file() and file_sha256(cached) == digest_file.read_text().strip():
            return cached
    url, sha256, filename = sdist_release(project, version)
    directory.mkdir(parents=True, exist_ok=True)
    dest = directory / filename
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{filename}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
            for chunk in iter(lambda: resp.read(1 << 20), b""):
                h.update(chunk)
                out.write(chunk)
        if h.hexdigest() != sha256:
            raise UpstreamUnavailable(f"{url}: sha256 {h.hexdigest()} does not match PyPI's {sha256}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except (OSError, urllib.error.URLError) as exc:
        raise UpstreamUnavailable(f"can't download {url}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    digest_tmp = dest.with_name(dest.name + ".sha256.part")
    digest_tmp.write_text(sha256 + "\n")
    os.replace(digest_tmp, dest.with_name(dest.name + ".sha256"))
    return dest


class Sdist:
    """Text files of an sdist, read out of the tarball (paths relative to its top folder)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._texts: dict[str, str] = {}
        with tarfile.open(self.path, "r:gz") as tar:
            first = tar.next()
            if first is None:
                raise UpstreamUnavailable(f"{self.path} is an empty archive")
            self.root = first.name.split("/", 1)[0]

    def read_many(self, paths: Iterable[str]) -> dict[str, str]:
        """Read several files in one pass over the (gzip, so sequential) archive."""
        want = {p for p in paths if p not in self._texts}
        if want:
            found = {}
            with tarfile.open(self.path, "r:gz") as tar:
                for member in tar:
                    rel = member.name.split("/", 1)[1] if "/" in member.name else ""
                    if rel in want and member.isfile():
                        f = tar.extractfile(member)
                        assert f is not None
                        found[rel] = f.read().decode("utf-8")
                        if len(found) == len(want):
                            break
            missing = want - set(found)
            if missing:
                raise FileNotFoundError(f"{self.path.name} has no {sorted(missing)}")
            self._texts.update(found)
        return {p: self._texts[p] for p in paths}

    def read(self, path: str) -> str:
        return self.read_many([path])[path]

    def display_path(self, path: str) -> str:
        """How tracebacks name a file of this sdist."""
        return f"{self.path.name}/{self.root}/{path}"


def module_path(name: str) -> str:
    """``vllm.a.b`` -> ``vllm/a/b.py`` (modules only; packages are not loaded from the sdist)."""
    return name.replace(".", "/") + ".py"


@contextlib.contextmanager
def _env(key: str, value: str | None) -> Iterator[None]:
    old = os.environ.get(key)
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def real_triton_utils() -> types.ModuleType:
    """A stand-in for ``vllm.triton_utils`` exposing the real ``triton`` and ``triton.language``.

    vLLM's CPU build replaces Triton by placeholders when no GPU driver is
    active; upstream kernels executed in Triton's interpreter need the real
    package (and nothing else from ``vllm.triton_utils``).
    """
    import triton
    import triton.language as tl

    mod = types.ModuleType("tests.upstream.triton_utils_stub")
    mod.triton = triton  # type: ignore[attr-defined]
    mod.tl = tl  # type: ignore[attr-defined]
    mod.HAS_TRITON = True  # type: ignore[attr-defined]
    return mod


@contextlib.contextmanager
def triton_interpreter_fixes() -> Iterator[None]:
    """Two gaps of Triton's CPU interpreter that upstream kernels hit, closed while this context is active.

    * Triton functions decorated BEFORE ``TRITON_INTERPRET=1`` was set (in a
      test process: ``triton.language``'s own ``@jit`` helpers such as
      ``tl.max(..., return_indices=True)``, imported with vLLM) are plain
      ``JITFunction`` objects, whose ``__call__`` only raises "Cannot call
      @triton.jit'd outside of the scope of a kernel". Here a call runs the
      function in the interpreter instead, as it would have been had the
      variable been set at import. (Compiled launches, ``kernel[grid](...)``,
      do not go through ``__call__``.)
    * Triton 3.9's interpreter evaluates ``block_mask & scalar_flag`` (two int1
      values, e.g. ``mask & is_valid_req`` in vLLM's ``gumbel_block_argmax``)
      to an int32/int64 array, and its masked load/store then fail with "mask
      has unsupported dtype"; compiled Triton keeps int1. Here they get ``mask
      != 0`` (the same truth values).
    """
    import triton.language as tl
    from triton.runtime import interpreter, jit

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store
    call = jit.JITFunction.__call__
    interpreted: dict[Any, Any] = {}

    def as_bool(mask: Any) -> Any:
        if mask.data.dtype == bool:
            return mask
        return interpreter.TensorHandle(mask.data != 0, tl.int1)

    def masked_load(self: Any, ptrs: Any, mask: Any, *args: Any) -> Any:
        return load(self, ptrs, as_bool(mask), *args)

    def masked_store(self: Any, ptrs: Any, value: Any, mask: Any, *args: Any) -> Any:
        return store(self, ptrs, value, as_bool(mask), *args)

    def interpret_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.fn not in interpreted:
            interpreted[self.fn] = interpreter.InterpretedFunction(self.fn)
        return interpreted[self.fn](*args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    jit.JITFunction.__call__ = interpret_call
    try:
        yield
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store
        jit.JITFunction.__call__ = call


class UpstreamModules:
    """Execute chosen upstream files from an sdist as private modules.

    Parameters
    ----------
    sdist : the release's :class:`Sdist`
    modules : dotted names (``vllm.v1.worker...``) executed from the sdist
    stubs : dotted name -> module used instead (for imports upstream code can't
        satisfy on this machine); every stub is the caller's to document
    interpret_triton : of ``modules``, those executed with ``TRITON_INTERPRET=1``
    prefix : the private package the loaded modules live under in ``sys.modules``
    """

    def __init__(self, sdist: Sdist, modules: Iterable[str], *, stubs: Mapping[str, types.ModuleType] | None = None,
                 interpret_triton: Iterable[str] = (), prefix: str = "_vllm_dspark_upstream"):
        self.sdist = sdist
        self.upstream = set(modules)
        self.stubs = dict(stubs or {})
        self.interpret = set(interpret_triton)
        unknown = self.interpret - self.upstream
        if unknown:
            raise ValueError(f"interpret_triton names modules that are not loaded from the sdist: {sorted(unknown)}")
        self.prefix = prefix
        self.loaded: dict[str, types.ModuleType] = {}
        self.resolved: dict[str, str] = {}  # every import a loaded file made -> "upstream" | "stub" | "installed"
        self._builtins = dict(vars(builtins))
        self._builtins["__import__"] = self._import
        sdist.read_many(module_path(m) for m in self.upstream)

    def __getitem__(self, name: str) -> types.ModuleType:
        return self.load(name)

    def load(self, name: str) -> types.ModuleType:
        if name in self.loaded:
            return self.loaded[name]
        if name not in self.upstream:
            raise KeyError(f"{name} is not one of the modules loaded from {self.sdist.path.name}")
        path = module_path(name)
        source = self.sdist.read(path)
        filename = self.sdist.display_path(path)
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        private = f"{self.prefix}.{name}"
        mod = types.ModuleType(private)
        mod.__file__ = filename
        mod.__package__ = name.rpartition(".")[0]  # upstream's package: relative imports resolve from it
        mod.__dict__["__builtins__"] = self._builtins
        mod.__dict__["__upstream_name__"] = name
        self.loaded[name] = mod
        sys.modules[private] = mod
        code = compile(source, filename, "exec")
        try:
            with _env("TRITON_INTERPRET", "1" if name in self.interpret else os.environ.get("TRITON_INTERPRET")):
                exec(code, mod.__dict__)
        except BaseException:
            del self.loaded[name]
            sys.modules.pop(private, None)
            raise
        return mod

    def _import(self, name: str, globals: Mapping[str, Any] | None = None, locals: Any = None,
                fromlist: Iterable[str] | None = (), level: int = 0) -> types.ModuleType:
        """``__import__`` for the loaded files: upstream file, stub, or installed vLLM."""
        package = (globals or {}).get("__package__")
        absolute = importlib.util.resolve_name("." * level + name, package) if level else name
        fromlist = tuple(fromlist or ())
        if absolute in self.stubs or absolute in self.upstream:
            if not fromlist and "." in absolute:  # `import a.b` binds `a`, the installed package: can't be redirected
                raise ImportError(f"`import {absolute}` in an upstream file can't be redirected to the stub or the "
                                  "sdist's copy; only `from ... import ...` can")
            if absolute in self.stubs:
                self.resolved[absolute] = "stub"
                return self.stubs[absolute]
            self.resolved[absolute] = "upstream"
            return self.load(absolute)
        self.resolved.setdefault(absolute, "installed")
        if level:
            return builtins.__import__(absolute, None, None, fromlist, 0)
        return builtins.__import__(name, globals, locals, fromlist, level)

    def close(self) -> None:
        """Drop the private modules from ``sys.modules``."""
        for name in list(self.loaded):
            sys.modules.pop(f"{self.prefix}.{name}", None)
        self.loaded.clear()


__all__ = ["Sdist", "UpstreamModules", "UpstreamUnavailable", "fetch_sdist", "module_path", "real_triton_utils",
           "sdist_release", "triton_interpreter_fixes"]
