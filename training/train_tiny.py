#!/usr/bin/env python
"""Regenerate the bundled default pair from scratch: tokenizer, target, DSpark drafter.

    python training/train_tiny.py                 # everything, fixed seed
    python training/train_tiny.py --stages target # one stage (earlier ones must exist)

Stages, in order (each reads the previous stages' outputs from --work-dir):

- ``data``: corpus split, tokenizer, held-out prompts;
- ``target``: train the Qwen3 target and save it (HF layout, bf16);
- ``generate``: the target's greedy continuations of train-split prompts (the
  drafter's distillation data: exactly the text it will draft at greedy), and
  the target's features of them (``training/features.py``, as for the default
  pair);
- ``drafter``: train the DSpark drafter on those features with the one trainer
  (``training/trainer.py``);
- ``export``: write the drafter in the SpecForge layout and copy both models
  and the loss curves into ``tests/fixtures/toy_pair``.

Everything is seeded; wall time per stage is printed and recorded in
``<work-dir>/timings.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STAGES = ("data", "target", "generate", "drafter", "export")


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def stage_data(args, work: Path) -> None:
    from training.pipeline import corpus
    from training.pipeline.tokenizer import train_tokenizer

    files = corpus.list_sources()
    train, held = corpus.split_sources(files)
    log(f"[data] stdlib {corpus.stdlib_root()}: {len(files)} files, "
        f"{len(train)} train / {len(held)} held out")
    (work / "split.json").write_text(json.dumps({
        "stdlib_root": str(corpus.stdlib_root()),
        "train": [f.rel_path for f in train], "heldout": [f.rel_path for f in held]},
        indent=1))
    train_tokenizer((f.text for f in train), args.vocab_size, work / "tokenizer")
    prompts = corpus.make_prompts(held, args.num_heldout_prompts, seed=args.seed)
    corpus.write_jsonl(prompts, work / "prompts_heldout.jsonl")
    log(f"[data] tokenizer (vocab {args.vocab_size}) and {len(prompts)} held-out prompts written")


def _streams(work: Path, tok, eos: int):
    import numpy as np

    from training.pipeline import corpus
    from training.pipeline.target import tokenize_documents

    cache = work / "streams.npz"
    if cache.exists():
        z = np.load(cache)
        return z["train"], z["heldout"]
    split = json.loads((work / "split.json").read_text())
    files = {f.rel_path: f for f in corpus.list_sources()}
    train = tokenize_documents(tok, [files[p].text for p in split["train"]], eos)
    held = tokenize_documents(tok, [files[p].text for p in split["heldout"]], eos)
    np.savez(cache, train=train, heldout=held)
    return train, held


def stage_target(args, work: Path) -> None:
    from training.pipeline.target import TargetShape, TargetTrainArgs, build_target, save_target, shape_dict
    from training.pipeline.tokenizer import load_tokenizer, special_ids

    tok = load_tokenizer(work / "tokenizer")
    special = special_ids(tok)
    train, held = _streams(work, tok, special["eos"])
    log(f"[target] {len(train)} train tokens, {len(held)} held-out tokens")
    shape = TargetShape(vocab_size=len(tok))
    model = build_target(shape, special, seed=args.seed)
    n = sum(p.numel() for p in model.parameters())
    log(f"[target] Qwen3 {shape_dict(shape)}: {n / 1e6:.2f} M parameters")
    targs = TargetTrainArgs(steps=args.target_steps, seed=args.seed)
    curve = train_target_logged(model, train, held, targs)
    save_target(model, tok, work / "target", special)
    (work / "target_loss.json").write_text(json.dumps(
        {"shape": shape_dict(shape), "train_args": vars(targs), "curve": curve}, indent=1))
    log(f"[target] saved to {work / 'target'}")


def stage_generate(args, work: Path) -> None:
    import numpy as np
    import torch

    from training.pipeline.capture import generate_distill_set, greedy_decode_vllm, load_target, sample_prompts
    from training.pipeline.features import capture
    from training.pipeline.tokenizer import load_tokenizer, special_ids

    tok = load_tokenizer(work / "tokenizer")
    train, held = _streams(work, tok, special_ids(tok)["eos"])
    target = load_target(work / "target")
    layer_ids = _drafter_config(args, target, tok).target_layer_ids
    kw = dict(min_prompt=16, max_prompt=64)
    sets = {"eval": (held, 32, args.seed + 1), "train": (train, args.gen_seqs, args.seed)}
    if args.gen_backend == "vllm":
        prompts = {name: sample_prompts(stream, num_seqs=num, seed=seed, **kw)
                   for name, (stream, num, seed) in sets.items()}
        ids = greedy_decode_vllm(work / "target", prompts["eval"] + prompts["train"], args.gen_len,
                                 seed=args.seed, log=log)
        n_eval = len(prompts["eval"])
        data = {"eval": (ids[:n_eval], np.array([len(p) for p in prompts["eval"]], np.int32)),
                "train": (ids[n_eval:], np.array([len(p) for p in prompts["train"]], np.int32))}
    else:
        data = {name: generate_distill_set(target, stream, num_seqs=num, seed=seed, batch_size=128,
                                           seq_len=args.gen_len, log=log, **kw)
                for name, (stream, num, seed) in sets.items()}
    for name, (ids, plens) in data.items():
        rows = [{"ids": [int(t) for t in seq], "gen_spans": [[int(p), len(seq)]]} for seq, p in zip(ids, plens)]
        capture(work / "target", rows, work / f"features_{name}", layer_ids, top_k=32, dtype=torch.float32, log=log)
        log(f"[generate] {name}: {len(ids)} sequences, {int(np.sum(ids.shape[1] - plens))} "
            f"generated tokens, features of target layers {list(layer_ids)}")


def _drafter_config(args, target, tok):
    from training.pipeline.drafter import build_drafter_config
    from training.pipeline.tokenizer import special_ids

    n = target.config.num_hidden_layers
    layer_ids = tuple(int(x) for x in args.target_layer_ids.split(",")) if args.target_layer_ids \
        else tuple(range(1, n - 1, 2))  # 7 layers -> (1, 3, 5); never the last layer
    return build_drafter_config(target.config, mask_token_id=special_ids(tok)["mask"],
                                target_layer_ids=layer_ids, num_hidden_layers=args.draft_layers,
                                markov_rank=args.markov_rank)


def stage_drafter(args, work: Path) -> None:
    import torch

    from training.pipeline.capture import load_target, target_embed_and_head
    from training.pipeline.drafter import init_drafter
    from training.pipeline.features import FeatureSet
    from training.pipeline.tokenizer import load_tokenizer
    from training.pipeline.trainer import TrainArgs, eval_anchors, fold_aux_scale, train

    tok = load_tokenizer(work / "tokenizer")
    target = load_target(work / "target")
    embed, lm_head = target_embed_and_head(target)
    cfg = _drafter_config(args, target, tok)
    model = init_drafter(cfg, seed=args.seed)
    n = sum(p.numel() for p in model.parameters())
    log(f"[drafter] {cfg.num_hidden_layers} layer(s), markov_rank {cfg.markov_rank}, "
        f"target_layer_ids {list(cfg.target_layer_ids)}: {n / 1e6:.2f} M parameters")
    held = FeatureSet(work / "features_eval")
    targs = TrainArgs(steps=args.drafter_steps, seed=args.seed, eval_every=max(1, args.drafter_steps // 6))
    rec = train(model, embed, lm_head, FeatureSet(work / "features_train"),
                {"heldout": (held, eval_anchors(held, cfg.block_size, 512, seed=args.seed + 1))}, targs,
                work / "drafter_run", log=log, stop_after_s=args.drafter_minutes * 60 or None)
    fold_aux_scale(model, torch.load(work / "drafter_run" / "ckpt.pt", weights_only=False)["aux_scale"])
    torch.save({"config": cfg.to_hf_dict(), "state": model.state_dict()}, work / "drafter_fp32.pt")
    (work / "drafter_loss.json").write_text(json.dumps(
        {"config": cfg.to_hf_dict(), "train_args": rec["args"], "steps_run": rec["steps_run"],
         "curve": rec["curve"]}, indent=1))
    log(f"[drafter] saved to {work / 'drafter_fp32.pt'}")


def stage_export(args, work: Path) -> None:
    import torch

    from training.pipeline import corpus
    from training.pipeline.export import export_drafter
    from training.pipeline.tokenizer import load_tokenizer, special_ids
    from vllm_dspark.config import DSparkConfig
    from vllm_dspark.model.reference import DSparkDraftModel

    tok = load_tokenizer(work / "tokenizer")
    special = special_ids(tok)
    ck = torch.load(work / "drafter_fp32.pt")
    model = DSparkDraftModel(DSparkConfig.from_dict(ck["config"]))
    model.load_state_dict(ck["state"])
    assets = args.assets_dir
    assets.mkdir(parents=True, exist_ok=True)
    export_drafter(model, assets / "drafter", bos_token_id=special["eos"],
                   eos_token_id=special["eos"], pad_token_id=special["pad"])
    if (assets / "target").exists():
        shutil.rmtree(assets / "target")
    shutil.copytree(work / "target", assets / "target")
    shutil.copy(work / "prompts_heldout.jsonl", assets / "prompts_heldout.jsonl")
    curves = {}
    for name in ("target", "drafter"):
        d = json.loads((work / f"{name}_loss.json").read_text())
        curves[name] = d
    (assets / "loss_curves.json").write_text(json.dumps(curves, separators=(",", ":")) + "\n")
    (assets / "train_info.json").write_text(json.dumps({
        "command": "python training/train_tiny.py", "seed": args.seed,
        "stdlib_root": str(corpus.stdlib_root()),
        "timings": json.loads((work / "timings.json").read_text()),
    }, indent=1) + "\n")
    sizes = {p.relative_to(assets).as_posix(): p.stat().st_size
             for p in sorted(assets.rglob("*")) if p.is_file()}
    total = sum(sizes.values())
    log(f"[export] assets in {assets}: {total / 2**20:.1f} MiB")
    if total > 50 * 10**6:
        raise RuntimeError(f"shipped artifacts are {total / 1e6:.1f} MB, over the 50 MB budget")


def train_target_logged(model, train, held, targs):
    from training.pipeline.target import train_target

    return train_target(model, train, held, targs, log=log)


def main(argv=None) -> int:
    from training.pipeline.stages import parse_stages, run_stages

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "tiny")
    ap.add_argument("--assets-dir", type=Path,
                    default=ROOT / "tests" / "fixtures" / "toy_pair")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help=f"comma-separated subset of {','.join(STAGES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=5000)
    ap.add_argument("--num-heldout-prompts", type=int, default=64)
    ap.add_argument("--target-steps", type=int, default=240)
    ap.add_argument("--gen-seqs", type=int, default=1024,
                    help="greedy target continuations the drafter trains on")
    ap.add_argument("--gen-len", type=int, default=256, help="tokens per sequence (prompt + greedy)")
    ap.add_argument("--gen-backend", choices=("vllm", "hf"), default="vllm",
                    help="greedy decoder for the distillation text (vLLM is much faster on CPU)")
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--markov-rank", type=int, default=128)
    ap.add_argument("--target-layer-ids", default="",
                    help="comma-separated; default every other inner layer")
    ap.add_argument("--drafter-steps", type=int, default=1200)
    ap.add_argument("--drafter-minutes", type=float, default=30.0,
                    help="wall-clock budget of this run of the drafter stage (0: none); a later run "
                         "resumes from its checkpoint until --drafter-steps")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    try:
        stages = parse_stages(args.stages, STAGES)
    except ValueError as exc:
        ap.error(str(exc))
    t_all = time.time()
    timings = run_stages(stages, lambda stage: globals()[f"stage_{stage}"](args, work), work, log=log)
    log(f"all requested stages done in {(time.time() - t_all) / 60:.1f} min (per stage: {timings})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
