#!/usr/bin/env python
"""The main job on the default pair: DSpark speculative decoding for SmolLM2-135M-Instruct in vLLM.

    bash scripts/setup_env.sh && .venv/bin/python scripts/demo.py

Serves the default pair (``vllm-dspark default``: the target converted from its
GGUF by setup, the DSpark drafter shipped in the package) with ``LLM.generate``
on held-out chat prompts, greedy, batch 1, each answer running to the end of
the assistant's turn (capped at ``--max-tokens``):

1. **Speed, in bf16** (the dtype users run): a no-speculation engine and a
   DSpark engine, both alive, measured ``--repeats`` times interleaved
   (A B, B A, A B); the speed-up is the median of the per-repeat ratios, with
   their spread.
2. **Identity, in float32**: the same prompts through both engines in float32,
   where a 1-token decode step and an 8-token verify step round alike, so the
   greedy outputs must be token-identical. (In bf16 at batch 1 they need not
   be: the CPU GEMMs of M = 1 and M = 8 round differently and a near-tie can
   flip. bf16 at batch >= 16 is identical; the tests check both.)

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
    from vllm_dspark.tools import cpu_setup

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=192, help="cap on each answer (it stops at end of turn)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--show", type=int, default=2, help="answers to print")
    ap.add_argument("--skip-identity", action="store_true", help="skip the float32 identity check")
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
    from training.pipeline.chat_prompts import chat_eval_prompts

    tok = AutoTokenizer.from_pretrained(paths["target"])
    questions = chat_eval_prompts(args.num_prompts)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in questions]
    configs = [EngineConfig("no-spec"), EngineConfig("dspark", dspark_spec(paths["draft"]))]
    machine = cpu_setup.describe()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"== DSpark on SmolLM2-135M-Instruct: {len(prompts)} held-out chat prompts, greedy, batch 1 ==\n"
          f"   {when}, {machine['cores']} cores, {machine['cpu']}, flags: {' '.join(machine['flags'])}"
          + ("" if machine["native_bf16"] else "  (no native bf16: bf16 is emulated and slow here)"), flush=True)

    def quiet(msg: str) -> None:
        if args.verbose:
            print(msg, flush=True)

    print(f"-- speed: bfloat16, {args.repeats} interleaved repeats (two engines start first; about a minute)",
          flush=True)
    speed = {r["config"]: r for r in run_interleaved(
        Pair("smollm2", paths["target"], paths["draft"], None, {"chat": prompts}, dtype="bfloat16"), configs,
        {"chat": prompts}, max_tokens=args.max_tokens, repeats=args.repeats, log=quiet)}
    same = None
    if not args.skip_identity:
        print("-- identity: float32, one pass each", flush=True)
        ident = {r["config"]: r for r in run_interleaved(
            Pair("smollm2", paths["target"], paths["draft"], None, {"chat": prompts}, dtype="float32"), configs,
            {"chat": prompts}, max_tokens=args.max_tokens, repeats=1, log=quiet)}
        same = [a == b for a, b in zip(ident["dspark"]["outputs"], ident["no-spec"]["outputs"], strict=True)]

    ds, base = speed["dspark"], speed["no-spec"]
    print("\n-- answers (DSpark, bf16) --")
    for q, ids in list(zip(questions, ds["outputs"]))[: args.show]:
        print(f">>> {q}\n{tok.decode(ids, skip_special_tokens=True).strip()}\n")
    lo, hi = ds["speedup_spread"]
    per_pos = " ".join(f"{a:.2f}" for a in ds["per_position_acceptance"]) or "-"
    st = ds["dspark"]["stats"]
    mean_len = sum(len(o) for o in ds["outputs"]) / len(ds["outputs"])
    print("-- results (measured in this run) --")
    print(f"| {'':24} | {'no speculation':>14} | {'DSpark':>10} |")
    print(f"|{'-' * 26}|{'-' * 16}|{'-' * 12}|")
    print(f"| {'tokens/s (bf16, median)':24} | {base['tokens_per_s']:14.1f} | {ds['tokens_per_s']:10.1f} |")
    print(f"| {'speed-up (median)':24} | {'1.00x':>14} | {ds['speedup_median']:9.2f}x |")
    print(f"| {'speed-up spread':24} | {'':14} | {lo:.2f}-{hi:.2f}x |")
    acc = ds["mean_acceptance_length"]
    acc_cell = f"{acc:10.2f}" if acc == acc else f"{'-':>10}"  # NaN: no draft was verified
    print(f"| {'mean acceptance length':24} | {'':14} | {acc_cell} |")
    print(f"per-position acceptance: {per_pos}; mean answer {mean_len:.0f} tokens")
    print(f"steps that drafted: {st['steps_drafted']} of {st['steps']} ({st['steps_probed']} probes); "
          f"draft tokens verified {st['tokens_verified_observed']}, accepted {st['tokens_accepted']}")
    if same is not None:
        print(f"greedy outputs identical to no speculation (float32): {sum(same)}/{len(same)}")
    return 0 if same is None or all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
