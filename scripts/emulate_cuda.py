#!/usr/bin/env python
"""Run the CUDA kernels of markov_draft on the CPU (SIMT emulation) and check them.

``csrc/markov_draft_kernels.cu`` is compiled as host C++ together with the
harness in ``tests/ops/simt`` (every CUDA thread a fiber, seeded random
interleaving, shared-memory race / barrier-divergence / bounds checks, byte and
launch counters; see ``tests/ops/simt/simt_compat.h``). The build is cached in
``build/simt/<hash>/`` (hash of the sources, flags and compiler).

``python scripts/emulate_cuda.py --check`` runs the op's test grid through the
real kernel source and compares every case with ``markov_draft_reference``:
tokens equal, confidences within 1e-6, logits within 1e-6 (draft-vocabulary
cases, ``d2t``, included: ``with_draft_vocab``; gated and rnn heads,
``head_type``: ``with_head``, ``head_grid``). It exits
0 only if every case matches and the harness reported no error. ``--quick``
runs the bounded subset that ``tests/ops/test_simt_emulation.py`` uses.

Also a library: ``build_harness``, ``emulate`` (one call of the kernels, with
the harness counters) and ``make_case`` are used by the tests and by
``benchmarks/bench_markov_op.py --model h200``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.ops.markov_cases import head_kwargs, with_draft_vocab, with_head  # noqa: E402  (one case builder)
from vllm_dspark.ops.markov_reference import (  # noqa: E402
    markov_draft_reference,
    markov_max_norms,
    markov_row_norms,
)

SIMT = ROOT / "tests" / "ops" / "simt"
CSRC = ROOT / "csrc"
BUILD = ROOT / "build" / "simt"
KERNEL = CSRC / "markov_draft_kernels.cu"
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CONF_ATOL = 1e-6
CXX = os.environ.get("CXX", "g++")
FLAGS = ["-std=c++17", "-ffp-contract=off", "-fno-strict-aliasing", "-g0"]


def _digest(paths, extra) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(str(p.name).encode())
        h.update(p.read_bytes())
    h.update(" ".join(extra).encode())
    with contextlib.suppress(OSError):  # no compiler: the build step reports it
        h.update(subprocess.run([CXX, "--version"], capture_output=True, text=True).stdout.encode())
    return h.hexdigest()[:16]


def build_harness(kernel_src: Path | None = None, opt: str = "-O2", quiet: bool = True) -> Path:
    """Compile (or reuse) the harness around ``kernel_src``; returns the executable."""
    kernel_src = Path(kernel_src or KERNEL)
    headers = sorted(CSRC.glob("*.h")) + sorted(SIMT.glob("*.h"))
    if kernel_src.parent != CSRC:
        headers += sorted(kernel_src.parent.glob("*.h"))
    sources = [kernel_src, SIMT / "simt_runtime.cpp", SIMT / "simt_main.cpp"]
    key = _digest(sources + headers, FLAGS + [opt])
    out = BUILD / key
    exe = out / "simt_markov"
    if exe.exists():
        return exe
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=BUILD.parent if BUILD.parent.exists() else None))
    incs = [f"-I{kernel_src.parent}", f"-I{CSRC}", f"-I{SIMT}"]
    objs = []
    for src in sources:
        obj = tmp / (src.stem + ".o")
        lang = ["-x", "c++"] if src.suffix == ".cu" else []
        cmd = [CXX, opt, *FLAGS, "-DDSPARK_SIMT", *incs, *lang, "-c", str(src), "-o", str(obj)]
        if not quiet:
            print(" ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"harness build failed:\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")
        objs.append(str(obj))
    link = [CXX, *objs, "-o", str(tmp / "simt_markov")]
    proc = subprocess.run(link, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"harness link failed:\n{proc.stderr[-4000:]}")
    out.mkdir(parents=True, exist_ok=True)
    shutil.move(str(tmp / "simt_markov"), str(exe))
    shutil.rmtree(tmp, ignore_errors=True)
    return exe


class HarnessError(RuntimeError):
    """The harness reported a race, divergence, bad access or crashed."""


def _write(t: torch.Tensor, path: Path) -> None:
    t.contiguous().view(torch.uint8).numpy().tofile(path)


def _read(path: Path, dtype, shape) -> torch.Tensor:
    data = path.read_bytes()
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape).clone()


def emulate(exe: Path, case: dict, temperature: torch.Tensor, *,
            return_logits: bool = False, pass_max_norms: bool = True, seed: int = 1,
            preempt: float = 0.0, resident: int = 1, checks: bool = True,
            timeout: float = 1800) -> dict:
    """One call of ``launch_markov_draft`` in the harness. Returns the outputs
    (``tokens``, ``conf``, ``logits``, ``stats``) and ``counters``."""
    base = case["base_logits"]
    R, B, V = base.shape
    w1, w2 = case["markov_w1"], case["markov_w2"]
    rank = w2.shape[1]
    norms = markov_row_norms(w2)
    with tempfile.TemporaryDirectory(prefix="simt-") as d:
        d = Path(d)
        meta = dict(R=R, B=B, V=V, V1=w1.shape[0], rank=rank, base_dtype=DTYPE_CODE[base.dtype],
                    w_dtype=DTYPE_CODE[w2.dtype],
                    logits=int(return_logits), stats=1)
        if case.get("d2t") is not None:
            _write(case["d2t"].to(torch.int64), d / "d2t.bin")
        if case.get("head_type"):
            meta["head_type"] = int(case["head_type"])
            _write(case["head_hidden"].to(torch.float32), d / "head_hidden.bin")
            _write(case["head_w"].to(torch.float32), d / "head_w.bin")
        (d / "meta.txt").write_text("".join(f"{k} {v}\n" for k, v in meta.items()))
        _write(base, d / "base.bin")
        _write(case["anchor_ids"].to(torch.int64), d / "anchor.bin")
        _write(w1, d / "w1.bin")
        _write(w2, d / "w2.bin")
        _write(norms, d / "norms.bin")
        if pass_max_norms:
            _write(markov_max_norms(w1, norms), d / "max_norms.bin")
        if case.get("conf_base") is not None:
            _write(case["conf_base"].to(torch.float32), d / "conf_base.bin")
        if case.get("conf_w_markov") is not None:
            _write(case["conf_w_markov"].to(torch.float32), d / "conf_w.bin")
        _write(temperature.to(torch.float32), d / "temperature.bin")
        _write(case["seeds"].to(torch.int64), d / "seeds.bin")
        env = dict(os.environ, SIMT_SEED=str(seed), SIMT_PREEMPT=str(preempt),
                   SIMT_RESIDENT=str(resident), SIMT_CHECKS="1" if checks else "0")
        proc = subprocess.run([str(exe), str(d)], capture_output=True, text=True, env=env,
                              timeout=timeout)
        if proc.returncode != 0:
            raise HarnessError(f"harness exit {proc.returncode}: {proc.stderr.strip()[-3000:]}")
        if os.environ.get("SIMT_VERBOSE"):
            sys.stderr.write(proc.stderr)
        out = dict(
            tokens=_read(d / "out_tokens.bin", torch.int64, (R, B)),
            conf=_read(d / "out_conf.bin", torch.float32, (R, B)),
            stats=_read(d / "out_stats.bin", torch.int32, (R, B)),
            logits=(_read(d / "out_logits.bin", torch.float32, (R, B, V))
                    if return_logits else None),
            counters=json.loads(proc.stdout),
        )
    return out


# ----------------------------------------------------------------- cases
def make_case(R, B, V, rank, dtype=torch.float32, *, seed=0, base_std=1.0, w_std=0.05,
              peaky=False, w_dtype=None, conf=True, conf_w=True):
    """Random inputs in the style of tests/ops/test_markov_op.py."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(R, B, V, generator=g) * base_std
    if peaky:
        top = torch.randint(0, V, (R, B, 4), generator=g)
        base.scatter_add_(2, top, 8.0 + 4.0 * torch.rand(R, B, 4, generator=g))
    w1 = torch.randn(V, rank, generator=g) * w_std
    w2 = torch.randn(V, rank, generator=g) * w_std
    wd = w_dtype or dtype
    return dict(
        base_logits=base.to(dtype),
        anchor_ids=torch.randint(0, V, (R,), generator=g),
        markov_w1=w1.to(wd),
        markov_w2=w2.to(wd),
        conf_base=(torch.randn(R, B, generator=g) * 1.5 + 2.5) if conf else None,
        conf_w_markov=(torch.randn(rank, generator=g) * 0.3) if (conf and conf_w) else None,
        seeds=torch.randint(-2**62, 2**62, (R,), generator=g),
    )


def temperatures(R, mode):
    if mode == "greedy":
        return torch.zeros(R)
    if mode == "sampled":
        return torch.linspace(0.6, 1.4, R) if R > 1 else torch.ones(1)
    t = torch.ones(R)
    t[::2] = 0.0
    return t


def adversarial(kind, dtype=torch.float32, seed=0):
    """Rows that stress the certificate: ties, -inf, all-equal, bias at the
    bound, NaN, out-of-range anchors."""
    if kind == "ties":
        c = make_case(2, 7, 2000, 16, dtype, seed=seed, base_std=0.1)
        for j in (1500, 40, 900):
            c["base_logits"][:, :, j] = 10.0
            c["markov_w2"][j] = c["markov_w2"][40]
        return c
    if kind == "minus_inf":
        c = make_case(3, 7, 6000, 16, dtype, seed=seed)
        g = torch.Generator().manual_seed(seed + 1)
        b = c["base_logits"]
        b[torch.rand(b.shape, generator=g) < 0.6] = float("-inf")
        b[0, 2] = float("-inf")
        b[1, :, :4000] = float("-inf")
        return c
    if kind == "all_equal":
        c = make_case(2, 3, 1500, 8, dtype, seed=seed)
        c["base_logits"].fill_(0.25)
        c["markov_w2"].zero_()
        return c
    if kind == "bias_at_bound":
        V, rank = 1500, 32
        c = make_case(2, 7, V, rank, dtype, seed=seed, w_std=0.1)
        v = torch.randn(rank)
        c["markov_w1"][:] = (v / v.norm()).to(c["markov_w1"].dtype)
        scale = torch.rand(V) * 2.0 - 1.0
        scale[777], scale[123] = 1.0, -1.0
        c["markov_w2"][:] = (scale[:, None] * v[None, :]).to(c["markov_w2"].dtype)
        c["base_logits"][:, :, 123] = 5.0
        c["base_logits"][:, :, 777] = 5.0 - 2.0 * v.norm() + 1e-6
        return c
    if kind == "nan":
        c = make_case(4, 3, 500, 16, dtype, seed=seed)
        b = c["base_logits"]
        b[0, 0, 17] = float("nan")
        b[0, 1, :] = float("nan")
        b[1, 0, :] = float("-inf")
        b[1, 0, :3] = float("nan")
        b[1, 1, ::2] = float("nan")
        b[2, :, 0] = float("nan")
        b[2, :, 1:] = 0.25
        c["markov_w2"][:] = 0
        return c
    if kind == "bad_anchor":
        c = make_case(4, 5, 300, 8, dtype, seed=seed)
        c["anchor_ids"] = torch.tensor([300, -1, 7, 2**40])
        return c
    if kind == "strong_bias":  # bias std ~16x the base std: loose bound
        return make_case(3, 7, 1000, 64, dtype, seed=seed, base_std=0.05, w_std=0.5)
    raise ValueError(kind)


ADVERSARIAL = ["ties", "minus_inf", "all_equal", "bias_at_bound", "nan", "bad_anchor",
               "strong_bias"]


def check_case(exe, name, case, temperature, *, return_logits=False, **kw):
    """Emulate one case and compare with the reference; returns (ok, message, out)."""
    t0 = time.time()
    try:
        out = emulate(exe, case, temperature, return_logits=return_logits, **kw)
    except HarnessError as exc:
        return False, f"{name}: HARNESS {exc}", None
    ref = markov_draft_reference(
        case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
        case.get("conf_base"), case.get("conf_w_markov"), temperature, case["seeds"],
        return_logits=return_logits, d2t=case.get("d2t"), **head_kwargs(case))
    problems = []
    if not torch.equal(out["tokens"], ref[0]):
        bad = (out["tokens"] != ref[0]).nonzero()[:4].tolist()
        problems.append(f"tokens differ at {bad}")
    if not torch.allclose(out["conf"], ref[1], atol=CONF_ATOL, rtol=0):
        problems.append(f"conf max err {(out['conf'] - ref[1]).abs().max().item():.3g}")
    if return_logits:
        a, b = out["logits"], ref[2]
        same = torch.isclose(a, b, atol=1e-6, rtol=1e-6) | (torch.isnan(a) & torch.isnan(b))
        if not bool(same.all()):
            problems.append("logits differ")
    dt = time.time() - t0
    stats = out["stats"].float().mean().item()
    msg = (f"{name}: {'ok' if not problems else 'MISMATCH ' + '; '.join(problems)} "
           f"({dt:.1f}s, exact scores/row {stats:.0f})")
    return not problems, msg, out


def grid(quick: bool):
    """(name, case, temperature, kwargs) of the check grid."""
    cases = []
    dts = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    shapes = [(1, 7, 111, 1), (5, 7, 111, 256), (3, 1, 1000, 16), (4, 7, 4099, 32)]
    if quick:
        shapes = [(1, 7, 111, 1), (3, 4, 1000, 16)]
    k = 0
    for (R, B, V, rank) in shapes:
        for dn in (["fp32", "bf16"] if quick else ["fp32", "bf16", "fp16"]):
            for mode in ["greedy", "sampled", "mixed"]:
                k += 1
                c = make_case(R, B, V, rank, dts[dn], seed=k, peaky=V > 1000)
                cases.append((f"R{R}-B{B}-V{V}-r{rank}-{dn}-{mode}", c, temperatures(R, mode), {}))
    # Mixed dtypes, the dense (out_logits) path, max_norms computed on device.
    c = make_case(3, 7, 2000, 32, torch.float32, w_dtype=torch.bfloat16, seed=31)
    cases.append(("fp32-base-bf16-w-mixed", c, temperatures(3, "mixed"), {}))
    c = make_case(3, 5, 777, 32, torch.bfloat16, seed=32)
    cases.append(("out_logits-bf16-mixed", c, temperatures(3, "mixed"), dict(return_logits=True)))
    c = make_case(2, 3, 1500, 8, torch.float16, seed=33)
    cases.append(("max_norms-on-device-fp16-sampled", c, temperatures(2, "sampled"),
                  dict(pass_max_norms=False)))
    for kind in (["ties", "nan", "bad_anchor", "all_equal"] if quick else ADVERSARIAL):
        for mode in (["greedy", "sampled"] if quick else ["greedy", "sampled", "mixed"]):
            c = adversarial(kind, torch.float32, seed=40)
            cases.append((f"adv-{kind}-{mode}", c, temperatures(c["base_logits"].shape[0], mode), {}))
    if not quick:
        c = adversarial("nan", torch.bfloat16, seed=41)
        cases.append(("adv-nan-bf16-out_logits", c, temperatures(4, "mixed"), dict(return_logits=True)))
        c = adversarial("all_equal", torch.float32, seed=42)
        cases.append(("adv-all_equal-resident4-preempt", c, temperatures(2, "greedy"),
                      dict(resident=4, preempt=0.001)))
        # Kimi K3 sizes (few rows: emulation is slow).
        for dn, mode, peaky in [("bf16", "greedy", True), ("bf16", "sampled", False),
                                ("fp32", "greedy", False), ("fp16", "mixed", True)]:
            R = 2 if mode == "mixed" else 1
            c = make_case(R, 7, 163840, 256, dts[dn], seed=50, peaky=peaky)
            cases.append((f"K3-R{R}-{dn}-{mode}-{'peaky' if peaky else 'flat'}", c,
                          temperatures(R, mode), {}))
        c = make_case(2, 7, 163840, 1, torch.float32, seed=51)
        cases.append(("K3-rank1-mixed", c, temperatures(2, "mixed"), {}))
    return cases + draft_vocab_grid(quick) + head_grid(quick)


def draft_vocab_grid(quick: bool):
    """Draft-vocabulary cases (``d2t``): the pruned walk (pair tables and certified sets), the
    dense path, ``max_norms`` on the device with markov_w1 taller than markov_w2, bad anchors."""
    cases = []
    # w_std 0.5: a bias that moves tokens (loose bound, large certified sets); 0.15: small sets, so
    # the walk goes through its pair tables (a wrong w1 row there shows in the confidences).
    dv = [("sorted", True, "greedy", torch.float32, 0.3), ("shuffled", False, "sampled", torch.bfloat16, 0.5),
          ("shuffled", False, "mixed", torch.float32, 0.15)]
    for k, (order, sort, mode, dt, w_std) in enumerate(dv if quick else dv + [
            ("sorted", True, "mixed", torch.float16, 0.5), ("sorted", True, "greedy", torch.bfloat16, 0.15)]):
        c = with_draft_vocab(make_case(3, 7, 300, 16, dt, seed=60 + k, peaky=True), 1000, seed=k, sort=sort,
                             w_std=w_std)
        cases.append((f"d2t-{order}-R3-B7-Vd300-V1000-w{w_std}-{mode}", c, temperatures(3, mode), {}))
    c = with_draft_vocab(make_case(3, 5, 257, 8, torch.bfloat16, seed=70), 700, seed=7, sort=False)
    cases.append(("d2t-out_logits-mixed", c, temperatures(3, "mixed"), dict(return_logits=True)))
    c = with_draft_vocab(make_case(2, 3, 200, 8, torch.float32, seed=71), 900, seed=8)
    c["anchor_ids"] = torch.tensor([900, 850])  # outside markov_w1 / a target id off the draft subset
    c["d2t"][::5] = 10**6  # mapped outside markov_w1 (refused by the loaders): no embedding, no bad read
    c["d2t"][1::5] = -(10**6)
    cases.append(("d2t-max_norms-on-device-bad-anchor-bad-map", c, temperatures(2, "mixed"),
                  dict(pass_max_norms=False)))
    if not quick:
        c = with_draft_vocab(make_case(1, 1, 120, 4, torch.float32, seed=72), 500, seed=9)
        cases.append(("d2t-B1-greedy", c, temperatures(1, "greedy"), {}))
        for mode in ("greedy", "sampled"):
            c = with_draft_vocab(make_case(2, 7, 32000, 256, torch.bfloat16, seed=73, peaky=True), 163840,
                                 seed=10, w_std=0.05)
            cases.append((f"d2t-K3-Vd32000-{mode}", c, temperatures(2, mode), {}))
    return cases


def head_grid(quick: bool):
    """Gated and rnn heads (``head_type``): the walk (certified sets with each row's ||v||, dense jobs
    posting v), the dense path (``head_kernel`` before each position), draft vocabularies, bad
    anchors (the rnn head's v reads h even with e = 0), the candidate pass's rnn bound sqrt(rank)."""
    cases = []
    dts = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    combos = [("greedy", False, "fp32", {}), ("sampled", True, "bf16", {}), ("mixed", False, "bf16", {}),
              ("mixed", True, "fp32", dict(return_logits=True))]
    if not quick:
        combos = [(mode, dv, dn, {}) for mode in ("greedy", "sampled", "mixed") for dv in (False, True)
                  for dn in ("fp32", "bf16", "fp16")] + [
                  ("mixed", False, "bf16", dict(return_logits=True)),
                  ("greedy", True, "fp32", dict(return_logits=True)),
                  ("mixed", False, "fp32", dict(pass_max_norms=False))]
    for k, head in enumerate(("gated", "rnn")):
        for j, (mode, dv, dn, kw) in enumerate(combos):
            seed = 80 + 40 * k + j
            c = make_case(3, 7, 1000, 16, dts[dn], seed=seed, peaky=True, w_std=0.15)
            if dv:
                c = with_draft_vocab(c, 2500, seed=seed, w_std=0.15)
            c = with_head(c, head, seed=seed)
            extra = "-out_logits" if kw.get("return_logits") else "-max_norms-on-device" if kw else ""
            cases.append((f"head-{head}-{'d2t' if dv else 'full'}-{dn}-{mode}{extra}", c, temperatures(3, mode), kw))
        c = with_head(make_case(4, 5, 300, 8, torch.float32, seed=120 + k), head, seed=120 + k)
        c["anchor_ids"] = torch.tensor([300, -1, 7, 2**40])
        cases.append((f"head-{head}-bad-anchor-mixed", c, temperatures(4, "mixed"), {}))
        # A flat base is never certified: every row is a dense job of the walk, posting v.
        c = with_head(make_case(2, 4, 700, 16, torch.float32, seed=125 + k, w_std=0.3), head, seed=125 + k)
        c["base_logits"].fill_(0.25)
        cases.append((f"head-{head}-flat-base-dense-jobs-mixed", c, temperatures(2, "mixed"), {}))
        if not quick:
            c = with_head(make_case(3, 7, 1000, 64, torch.float32, seed=130 + k, base_std=0.05, w_std=0.5), head,
                          seed=130 + k)
            cases.append((f"head-{head}-strong-bias-mixed-resident4-preempt", c, temperatures(3, "mixed"),
                          dict(resident=4, preempt=0.001)))
            # (rnn: ||v|| up to sqrt(256) = 16 leaves the candidate pass no certificate at this size, every
            # row is a dense job: minutes per case in emulation, so greedy only.)
            for mode in (("greedy", "sampled") if head == "gated" else ("greedy",)):
                c = with_head(make_case(1, 7, 163840, 256, torch.bfloat16, seed=140 + k, peaky=True), head,
                              seed=140 + k)
                cases.append((f"head-{head}-K3-R1-bf16-{mode}", c, temperatures(1, mode), {}))
    return cases


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="run the full grid (a few minutes)")
    ap.add_argument("--quick", action="store_true", help="run the CI subset")
    ap.add_argument("--kernel", default=None, help="a copy of the kernel source to build instead")
    ap.add_argument("--seed", type=int, default=1, help="fiber interleaving seed")
    args = ap.parse_args(argv)
    if not (args.check or args.quick):
        ap.print_help()
        return 2
    t0 = time.time()
    exe = build_harness(Path(args.kernel) if args.kernel else None, quiet=False)
    print(f"harness: {exe} (built/reused in {time.time() - t0:.0f}s)", flush=True)
    ok_all = True
    cases = grid(quick=args.quick and not args.check)
    for name, case, temp, kw in cases:
        ok, msg, _ = check_case(exe, name, case, temp, seed=args.seed, **kw)
        ok_all &= ok
        print(msg, flush=True)
    print(f"{'ALL OK' if ok_all else 'FAILED'}: {len(cases)} cases in {time.time() - t0:.0f}s")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
