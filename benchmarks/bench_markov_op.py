#!/usr/bin/env python
"""Benchmark: the Markov draft op vs the obvious dense loop, side by side.

At Kimi K3's sizes (vocab 163840, rank 256, block 7) it times, for each batch,
dtype, logit regime and decoding mode:

* ``dense loop``: the obvious PyTorch loop a model would run: per position
  ``logits = base_i + w1[prev] @ w2.T`` (matmul in the weights' dtype, fp32
  logits), argmax (plus the reference Gumbel noise when sampling);
* ``op``: ``vllm_dspark.ops.markov_draft`` (compiled; the run fails if the op
  would fall back to Python);

and checks the op's tokens against the golden reference
(``markov_draft_reference``: fp64-accumulated bias) and against the dense loop.
Confidences use a confidence head with Markov input.

Logit regimes (synthetic; stated so that the numbers can be judged):

* ``peaky``: base ~ N(0, 2^2) plus 4 tokens per row raised by 8..12 (a trained
  LM head: a few clear candidates); Markov weights N(0, 0.05^2) -> bias std
  ~0.04, Cauchy-Schwarz bound ~0.64.
* ``flat``: base ~ N(0, 1) with no structure (the pruning's hard case: ~1/V of
  the mass near the top); same Markov weights.
* ``flat-strong`` (only with ``--regimes`` naming it): Markov weights
  N(0, 0.15^2), bias std ~0.36 against N(0, 1) base: the bound (~5.8) no longer
  separates anything, rows go dense, and the op is no faster than the loop.

Times are the best of ``--reps`` (op) and ``--loop-reps`` (loop) runs, so a
busy shared machine penalises both sides alike.

Run: ``python benchmarks/bench_markov_op.py`` (CPU, ~2-3 minutes on 2 cores);
``--device cuda`` on a GPU machine (measured: the CUDA op against the same
dense loop on the GPU); ``--out FILE`` also writes the table.

``--model h200`` prints a MODEL, not a measurement: the CUDA kernels run in the
SIMT harness (``scripts/emulate_cuda.py``) at Kimi K3's sizes, and the
harness's counters (distinct DRAM bytes, blocks, threads, launches, barriers
and barrier intervals with a global load on each block's critical path) are
turned into an H200 time with the assumptions printed above the table;
upstream vLLM's dense loop is modelled from its byte counts with the same
assumptions. ``--draft-vocab N`` models a draft vocabulary of N tokens against
the ``--vocab`` target vocabulary (``d2t``: base logits and markov_w2 have N
rows, markov_w1 keeps the target's), for the kernels and the upstream loop.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from vllm_dspark.ops import markov as M
from vllm_dspark.ops.markov_reference import (
    gumbel_noise,
    markov_draft_reference,
    markov_max_norms,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
W_STD = {"peaky": 0.05, "flat": 0.05, "flat-strong": 0.15}


def make_inputs(R, B, V, rank, dtype, regime, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    if regime == "peaky":
        base = torch.randn(R, B, V, generator=g) * 2.0
        top = torch.randint(0, V, (R, B, 4), generator=g)
        base.scatter_add_(2, top, 8.0 + 4.0 * torch.rand(R, B, 4, generator=g))
    else:
        base = torch.randn(R, B, V, generator=g)
    w1 = torch.randn(V, rank, generator=g) * W_STD[regime]
    w2 = torch.randn(V, rank, generator=g) * W_STD[regime]
    return dict(
        base_logits=base.to(dtype).to(device),
        anchor_ids=torch.randint(0, V, (R,), generator=g).to(device),
        markov_w1=w1.to(dtype).to(device),
        markov_w2=w2.to(dtype).to(device),
        conf_base=(torch.randn(R, B, generator=g) + 2.5).to(device),
        conf_w_markov=(torch.randn(rank, generator=g) * 0.3).to(device),
        seeds=torch.randint(0, 2**62, (R,), generator=g).to(device),
    )


def dense_loop(inp, temperature):
    """The obvious loop (what the op replaces): tokens [R, B]."""
    base, w1, w2 = inp["base_logits"], inp["markov_w1"], inp["markov_w2"]
    R, B, V = base.shape
    sampled = bool((temperature > 0).any())
    prev = inp["anchor_ids"]
    toks = []
    for i in range(B):
        logits = base[:, i].float() + (w1[prev] @ w2.T).float()
        if sampled:
            logits = logits / temperature[:, None] + gumbel_noise(inp["seeds"], i, V)
        prev = logits.argmax(dim=-1)
        toks.append(prev)
    return torch.stack(toks, dim=1)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps, device):
    times = []
    out = None
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times), out  # best of reps: the machine may be shared


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--block", type=int, default=7)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--regimes", default="peaky,flat")
    ap.add_argument("--modes", default="greedy,sampled",
                    help="sampled runs only for batches <= --max-sampled-batch")
    ap.add_argument("--max-sampled-batch", type=int, default=8,
                    help="the reference Gumbel noise in torch is slow on CPU")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--loop-reps", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    ap.add_argument("--model", default=None, choices=["h200"],
                    help="print the modelled H200 time of the CUDA kernels (SIMT counts)")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="with --model: a draft vocabulary of N tokens (d2t) against --vocab")
    args = ap.parse_args(argv)
    if args.model:
        return model_h200(args)

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    if not M.is_compiled_available(device):
        probe = (torch.empty(1, 1, 1, device=device), *(torch.empty(1, 1, device=device),) * 2,
                 torch.empty(1, device=device))
        sys.exit(f"compiled markov_draft is not available for {device}: {M._why_not(*probe)}")

    V, rank, B = args.vocab, args.rank, args.block
    header = ("| device | dtype | regime | mode | batch | dense loop ms | op ms | speed-up "
              "| tokens == reference | tokens == loop | exact scores / row |")
    rows = [f"threads={torch.get_num_threads()} vocab={V} rank={rank} block={B} "
            "", header, "|" + "---|" * 11]
    print("\n".join(rows), flush=True)
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for regime in args.regimes.split(","):
            for R in (int(b) for b in args.batches.split(",")):
                inp = make_inputs(R, B, V, rank, dtype, regime, device)
                norms = M.markov_row_norms(inp["markov_w2"])  # once per model
                max_norms = markov_max_norms(inp["markov_w1"], norms)  # once per model
                for mode in args.modes.split(","):
                    if mode == "sampled" and args.max_sampled_batch < R:
                        continue
                    temp = (torch.zeros(R) if mode == "greedy" else torch.ones(R)).to(device)

                    def op(inp=inp, norms=norms, max_norms=max_norms, temp=temp):
                        return M.markov_draft(
                            inp["base_logits"], inp["anchor_ids"], inp["markov_w1"],
                            inp["markov_w2"], norms, inp["conf_base"], inp["conf_w_markov"],
                            temp, inp["seeds"], max_norms=max_norms,
                            return_stats=True, allow_fallback=False)

                    op()  # warm-up (tables, caches)
                    t_op, out = timed(op, args.reps, device)
                    t_loop, loop_tokens = timed(lambda inp=inp, temp=temp: dense_loop(inp, temp), args.loop_reps,
                                                device)
                    ref = markov_draft_reference(
                        inp["base_logits"], inp["anchor_ids"], inp["markov_w1"],
                        inp["markov_w2"], inp["conf_base"], inp["conf_w_markov"], temp,
                        inp["seeds"])
                    same_ref = (torch.equal(out.tokens, ref[0])
                                and torch.allclose(out.conf, ref[1], atol=1e-6, rtol=0))
                    same_loop = torch.equal(out.tokens, loop_tokens)
                    line = (f"| {device} | {dname} | {regime} | {mode} | {R} | "
                            f"{t_loop * 1e3:.1f} | {t_op * 1e3:.2f} | {t_loop / t_op:.0f}x | "
                            f"{'yes' if same_ref else 'NO'} | {'yes' if same_loop else 'no'} | "
                            f"{out.stats.float().mean().item():.0f} |")
                    rows.append(line)
                    print(line, flush=True)
                del inp, norms, max_norms
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")


# --------------------------------------------------------------------------- model
H200 = dict(
    hbm_bytes_per_s=4.8e12,  # HBM3e peak
    sms=132,
    launch_us=3.0,           # per kernel launch (launch, ramp-up, drain), same for both sides
    mem_round_trip_us=0.6,   # one dependent round trip to DRAM under load
    l2_round_trip_us=0.3,    # one dependent round trip that hits L2 (data written by this call)
    barrier_us=0.03,         # one __syncthreads of a 512-thread block (~50 cycles)
    shuffle_us=0.015,        # one warp shuffle / vote on a warp's dependent chain (~27 cycles)
    sm_bytes_per_s=110e9,    # what one block can stream (~3x an SM's fair share of HBM)
)


def _kernel_us(L, hw):
    """Model of one launch from the harness counters."""
    dram = L["dram_read"] + L["dram_written"]
    occupancy = min(1.0, L["blocks"] / hw["sms"])  # fewer blocks than SMs: that share of HBM
    bw_us = dram / (hw["hbm_bytes_per_s"] * occupancy) * 1e6
    cold = L["max_cold_intervals"]
    hot = max(0, L["max_load_intervals"] - cold)
    crit_us = (cold * hw["mem_round_trip_us"] + hot * hw["l2_round_trip_us"]
               + L["max_barriers"] * hw["barrier_us"]
               + L["max_warp_collectives"] * hw["shuffle_us"]
               + L["max_block_bytes"] / hw["sm_bytes_per_s"] * 1e6)
    return hw["launch_us"] + max(bw_us, crit_us), bw_us >= crit_us


def _upstream_us(R, B, V, rank, hw, wbytes=2, bbytes=2, draft_vocab=None):
    """Upstream vLLM's loop, per position: w1[prev] gather, [R, rank] x [rank, V]
    matmul reading all of markov_w2 (bias written in the weights' dtype), the
    add to the base logits (fp32 out) and the argmax; every kernel at full
    bandwidth (generous to the loop).

    With a draft vocabulary of Vd tokens only markov_w2, the base logits and the
    argmax shrink to Vd; the gathered markov_w1 rows are target rows, so that
    launch does not change. Upstream's greedy path then maps the argmax to a
    target id (``draft_ids + d2t[draft_ids]``, ``map_draft_to_target`` in 0.33.0's
    qwen3_dspark.py), which is two more launches per position that move almost
    no bytes but still pay the launch."""
    Vd = V if draft_vocab is None else draft_vocab
    per_pos = [
        R * rank * wbytes * 2,                       # gather
        Vd * rank * wbytes + R * Vd * wbytes,        # matmul: all of markov_w2
        R * Vd * (bbytes + wbytes) + R * Vd * 4,     # add: base + bias -> fp32 logits
        R * Vd * 4,                                  # argmax
    ]
    if draft_vocab is not None:
        per_pos += [R * 8 * 3, R * 8 * 3]            # d2t[ids] gather, ids + offsets
    t = sum(hw["launch_us"] + b / hw["hbm_bytes_per_s"] * 1e6 for b in per_pos)
    return B * t, len(per_pos) * B, B * sum(per_pos)


def model_h200(args):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "emulate_cuda", Path(__file__).resolve().parents[1] / "scripts" / "emulate_cuda.py")
    E = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(E)
    hw = H200
    V, rank, B = args.vocab, args.rank, args.block
    Vd = args.draft_vocab
    if Vd is not None and not 0 < Vd <= V:
        sys.exit(f"--draft-vocab {Vd}: must be in [1, --vocab {V}]")
    pre = []

    def say(line):
        pre.append(line)
        print(line)

    say("MODEL (not a measurement): modelled H200 time of the markov_draft CUDA kernels, "
        "from the SIMT harness's counters")
    say(f"assumptions: HBM {hw['hbm_bytes_per_s'] / 1e12:.1f} TB/s, {hw['sms']} SMs, "
        f"{hw['launch_us']:.1f} us per kernel launch, {hw['mem_round_trip_us']:.1f} us per "
        f"dependent DRAM round trip, {hw['l2_round_trip_us']:.1f} us per dependent L2 round "
        f"trip (data written earlier in the call), {hw['barrier_us'] * 1e3:.0f} ns per barrier,"
        f" {hw['shuffle_us'] * 1e3:.0f} ns per warp shuffle on the busiest warp, one block "
        f"streams <= {hw['sm_bytes_per_s'] / 1e9:.0f} GB/s")
    say("kernel time = launch + max(DRAM bytes / (HBM x min(1, blocks / SMs)), critical path)"
        " [a kernel with fewer blocks than SMs gets that fraction of HBM]; critical path ="
        " max over blocks of (barrier intervals with a global load, DRAM or L2 round trip each"
        " + barriers + warp shuffles of the busiest warp + block bytes / block bandwidth);"
        " DRAM bytes = distinct 32-byte sectors touched per launch (perfect L2 reuse within a"
        " launch, none across)")
    if Vd is None:
        say("upstream loop = per position 4 launches (gather, matmul reading all of markov_w2, "
            "add, argmax) at full bandwidth")
        say(f"sizes: vocab {V}, rank {rank}, block {B}, bf16 base logits and weights, greedy, "
            f"max_norms passed (computed once per model)")
    else:
        say("upstream loop = per position 6 launches (gather of markov_w1 target rows, matmul "
            "reading all Vd rows of markov_w2, add, argmax over Vd, and the d2t map: "
            "d2t[ids] and ids + offsets) at full bandwidth")
        say(f"sizes: draft vocabulary {Vd} of target vocabulary {V} (d2t sorted, as exported; "
            f"base logits and markov_w2 {Vd} rows, markov_w1 {V} rows), rank {rank}, block {B}, "
            f"bf16 base logits and weights, greedy, max_norms passed (computed once per model, "
            f"over all {V} markov_w1 rows)")
    exe = E.build_harness()
    rows = []
    header = ("| batch | regime | upstream loop us (model) | kernel us (model) | speed-up (model) "
              "| launches | DRAM MB | exact scores / row | dense rows | per launch us |")
    print(header)
    print("|" + "---|" * 10)
    dense_rows = 0
    for R in (int(b) for b in args.batches.split(",")):
        for regime in args.regimes.split(","):
            w_std = W_STD.get(regime, 0.05)
            case = E.make_case(R, B, Vd or V, rank, torch.bfloat16, seed=0, peaky=regime == "peaky",
                               base_std=2.0 if regime == "peaky" else 1.0, w_std=w_std)
            if Vd is not None:
                # Redraws both Markov weights at the regime's std (its default is the
                # tests' loose 0.5), so the pruning bound matches the full-vocabulary rows.
                case = E.with_draft_vocab(case, V, seed=0, sort=True, w_std=w_std)
            out = E.emulate(exe, case, torch.zeros(R), checks=False)
            launches = out["counters"]["launches"]
            parts = [_kernel_us(L, hw) for L in launches]
            t_new = sum(t for t, _ in parts)
            t_up, n_up, _ = _upstream_us(R, B, V, rank, hw, draft_vocab=Vd)
            dram = sum(L["dram_read"] + L["dram_written"] for L in launches) / 1e6
            # A row that scored every token went down the dense fallback.
            n_dense = int((out["stats"] >= (Vd or V)).sum())
            dense_rows += n_dense
            per = ", ".join(f"{L['name']} {t:.1f}{' bw' if bw else ' lat'}"
                            for L, (t, bw) in zip(launches, parts))
            line = (f"| {R} | {regime} | {t_up:.0f} | {t_new:.1f} | {t_up / t_new:.1f}x | "
                    f"{len(launches)} (loop: {n_up}) | {dram:.1f} | "
                    f"{out['stats'].float().mean().item():.0f} | {n_dense} of {R * B} | {per} |")
            rows.append(line)
            print(line, flush=True)
            del case, out
    post = []
    if dense_rows:
        # The harness runs one block at a time, so the walker posting a dense job serves
        # every tile of it before any helper block starts; on the GPU the helpers are
        # resident and share the tiles. The counters cannot show that sharing.
        post.append("dense rows: the harness runs the walk's blocks one at a time, so each dense"
                    " job is served by its walker alone; the walk's time for those rows is that"
                    " one-block upper bound, not the grid-wide fallback a GPU would run")
        print(post[0])
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(pre) + "\n\n" + header + "\n" + "|" + "---|" * 10 + "\n"
                    + "\n".join(rows) + "\n" + "".join("\n" + line + "\n" for line in post))
    return 0


if __name__ == "__main__":
    sys.exit(main())
