#!/usr/bin/env python
"""The main job on the default pair: DSpark speculative decoding for SmolLM2-135M-Instruct in vLLM.

    bash scripts/setup_env.sh && .venv/bin/python scripts/demo.py

Serves the default pair (``vllm-dspark default``: the target converted from its
GGUF by setup, the DSpark drafter shipped in the package) with ``LLM.generate``
on held-out chat prompts and on copy-heavy requests (code edits, paragraphs to correct),
greedy, batch 1, each answer running to the end of the assistant's turn (capped at
``--max-tokens``):

1. **Speed, in the machine's native dtype** (``--dtype native``): bf16 where the CPU
   has native bf16 (``avx512_bf16`` or ``amx_bf16``), float32 elsewhere. Emulated bf16
   (AVX2 alone) prices every token of a verify step as a decode step of its own,
   so no speculation pays there, and a user would not serve in it. No speculation,
   vLLM's n-gram proposer and DSpark with its defaults (the drafter and the copy
   source), all alive, measured ``--repeats`` times interleaved; each speed-up is
   the median of the per-repeat ratios, with their spread.
2. **Identity, in float32**: the same prompts through both engines in float32,
   where a 1-token decode step and an 8-token verify step round alike, so the
   greedy outputs must be token-identical (when the speed ran in float32, its own
   outputs are compared). In bf16 at batch 1 they need not be: the CPU GEMMs of
   M = 1 and M = 8 round differently and a near-tie can flip. bf16 at batch >= 16
   is identical; the tests check both.

Unless ``--verbose``, the demo prints its own lines only: it runs itself as a child whose
output goes through ``vllm_dspark/tools/quiet.py`` (vLLM's and torch's warnings that a user
cannot act on are hidden, and counted in one closing line; failures and the plugin's own
lines always show), and vLLM's INFO logs are off. The CPU set-up vLLM recommends
(tcmalloc and Intel OpenMP preloaded, ``vllm_dspark/tools/cpu_setup.py``) is on
unless ``--no-cpu-setup``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CHILD = "VLLM_DSPARK_DEMO_CHILD"  # set in the filtered child run


def main() -> int:
    from vllm_dspark.serving.cpu_flags import native_dtype
    from vllm_dspark.tools import cpu_setup

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=192, help="cap on each answer (it stops at end of turn)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--show", type=int, default=2, help="answers to print")
    ap.add_argument("--skip-identity", action="store_true", help="skip the float32 identity check")
    ap.add_argument("--dtype", choices=("native", "bfloat16", "float32"), default="native",
                    help="the speed run's dtype (native: bfloat16 where the CPU has native bf16, else float32)")
    cpu_setup.add_flag(ap)
    ap.add_argument("--verbose", action="store_true", help="show vLLM's INFO logs")
    args = ap.parse_args()
    if not args.verbose and os.environ.get(CHILD) != "1":
        from vllm_dspark.tools.quiet import run_filtered

        return run_filtered([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]], env={CHILD: "1"})
    cpu_setup.reexec_with(not args.no_cpu_setup)
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

    from vllm_dspark.tools import default_pair as dp

    try:
        paths = dp.default_paths()
    except dp.DefaultPairError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from benchmarks.harness.e2e import EngineConfig, Pair, dspark_spec, run_interleaved
    from training.pipeline.chat_prompts import chat_eval_prompts, copy_eval_prompts

    tok = AutoTokenizer.from_pretrained(paths["target"])
    questions = {"chat": chat_eval_prompts(args.num_prompts), "copy-heavy": copy_eval_prompts(args.num_prompts)}
    sets = {name: [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in qs] for name, qs in questions.items()}
    ngram = EngineConfig("ngram", {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 4,
                                   "prompt_lookup_min": 2})
    configs = [EngineConfig("no-spec"), ngram, EngineConfig("dspark", dspark_spec(paths["draft"]))]
    machine = cpu_setup.describe()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"== DSpark on SmolLM2-135M-Instruct: {args.num_prompts} held-out chat and {args.num_prompts} copy-heavy "
          f"prompts, greedy, batch 1 ==\n"
          f"   {when}, {machine['cores']} cores, {machine['cpu']}, flags: {' '.join(machine['flags'])}"
          + ("" if machine["native_bf16"] else "  (no native bf16: bf16 is emulated and slow here)"), flush=True)

    def quiet(msg: str) -> None:
        if args.verbose:
            print(msg, flush=True)

    dtype = args.dtype if args.dtype != "native" else native_dtype(machine["native_bf16"])
    why = " (this CPU's native dtype)" if args.dtype == "native" else ""
    print(f"-- speed: {dtype}{why}, {args.repeats} interleaved repeats (three engines start first; a few minutes)",
          flush=True)
    rows = run_interleaved(Pair("smollm2", paths["target"], paths["draft"], None, sets, dtype=dtype), configs,
                           sets, max_tokens=args.max_tokens, repeats=args.repeats, log=quiet)
    speed = {(r["dataset"], r["config"]): r for r in rows}
    same = None
    if not args.skip_identity and dtype == "float32":  # the speed run's own outputs are the float32 ones
        same = {name: [a == b for a, b in zip(speed[(name, "dspark")]["outputs"],
                                              speed[(name, "no-spec")]["outputs"], strict=True)] for name in sets}
    elif not args.skip_identity:
        print("-- identity: float32, one pass each", flush=True)
        ident = {(r["dataset"], r["config"]): r for r in run_interleaved(
            Pair("smollm2", paths["target"], paths["draft"], None, sets, dtype="float32"), [configs[0], configs[2]],
            sets, max_tokens=args.max_tokens, repeats=1, log=quiet)}
        same = {name: [a == b for a, b in zip(ident[(name, "dspark")]["outputs"], ident[(name, "no-spec")]["outputs"],
                                              strict=True)] for name in sets}

    print(f"\n-- answers (DSpark, {dtype}) --")
    for q, ids in list(zip(questions["chat"], speed[("chat", "dspark")]["outputs"]))[: args.show]:
        print(f">>> {q}\n{tok.decode(ids, skip_special_tokens=True).strip()}\n")
    print(f"-- results (measured in this run: {dtype}, batch 1, median of the repeats' speed-ups) --")
    print(f"| {'workload':10} | {'no speculation':>14} | {'n-gram':>14} | {'DSpark':>14} |")
    print(f"|{'-' * 12}|{'-' * 16}|{'-' * 16}|{'-' * 16}|")
    for name in sets:
        cells = [speed[(name, c.name)] for c in configs]
        ups = ["1.00x" if r["config"] == "no-spec" else f"{r['speedup_median']:.2f}x" for r in cells]
        print(f"| {name:10} | " + " | ".join(f"{u:>5} {r['tokens_per_s']:5.1f} t/s" for u, r in zip(ups, cells))
              + " |")
    for name in sets:
        ds = speed[(name, "dspark")]
        lo, hi = ds["speedup_spread"]
        st = ds["dspark"]["stats"]
        by = st.get("by_source", {})
        parts = ", ".join(f"{src} {c.get('accepted', 0)} of {c.get('verified', 0)}" for src, c in sorted(by.items()))
        acc = ds["mean_acceptance_length"]
        print(f"DSpark on {name}: spread {lo:.2f}-{hi:.2f}x, acceptance length "
              + (f"{acc:.2f}" if acc == acc else "-") + f"; drafted in {st['steps_drafted']} of {st['steps']} "
              f"steps; draft tokens accepted of verified, by source: {parts or 'none'}")
    if same is not None:
        print("greedy outputs identical to no speculation (float32): "
              + ", ".join(f"{name} {sum(v)}/{len(v)}" for name, v in same.items()))
    return 0 if same is None or all(all(v) for v in same.values()) else 1

if __name__ == "__main__":
    sys.exit(main())
