#!/usr/bin/env python
"""Probe the default drafter's training recipe: short runs on one shard of the committed corpus,
each judged by the served walk over the whole held-out chat and HumanEval sets.

    .venv/bin/python training/train_probes.py                          # capture, every arm, the record
    .venv/bin/python training/train_probes.py --arms baseline,ce       # some arms
    .venv/bin/python training/train_probes.py --record-only            # the record from the runs so far

Each arm changes one thing against ``baseline`` (today's recipe, ``docs/training.md``):

* ``ce``: CE weight 1.0 with L1 0.3, against 0.9 L1 + 0.1 CE (L1's gradient vanishes where the
  drafter puts little mass on the label; DeepSpec's DFlash config trains with CE alone);
* ``greedy``: labels from the greedy conversations only, against all of them;
* ``draftvocab``: every step scores the drafter on the 8,192-token draft vocabulary serving uses
  (``draft_vocab: auto``), against the candidate set with a full-vocabulary step every 8th;
* ``warm``: a warm start from the shipped drafter, against a fresh start.

Every arm runs the same number of steps with its own cosine schedule, so arms compare at equal
work whatever else the machine ran; blocks per second are recorded beside (they do depend on it).
Arms resume from their checkpoints (``<work-dir>/probes/<arm>-shard<N>-steps<S>``); the record is rewritten after
each arm, so a session cut short leaves the arms it finished.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "training"))

import train_default as td  # noqa: E402  (the pipeline's stages and helpers)

ARMS = ("baseline", "ce", "greedy", "draftvocab", "warm")
WALK_SETS = ("eval_chat", "eval_humaneval")
DRAFT_VOCAB = 8192  # what serving's draft_vocab 'auto' picks for the default pair


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def shard_tag(args) -> str:
    """The shard's name in run and feature folders: its size, and its start when not 0 (the earlier
    runs' folders keep their names)."""
    return f"{args.shard_convs}" + (f"from{args.shard_start}" if args.shard_start else "")


def capture_shard(args, work: Path):
    """The walk sets' features and the shard's (``--shard-convs`` training conversations from
    ``--shard-start``)."""
    import torch

    from training.pipeline.conversations import restore
    from training.pipeline.features import capture
    from training.pipeline.generate import read_done

    dtype = getattr(torch, td.target_dtype(args))
    sets = {}
    for name in (*WALK_SETS, "train_text"):
        restore(td.archive_path(args, name), work / name, log=log)
        rows = read_done(work / name / "done.jsonl")
        out = work / f"features_{name}"
        if name == "train_text":
            rows = rows[args.shard_start:args.shard_start + args.shard_convs]
            out = work / f"features_train_shard{shard_tag(args)}"
        sets[name] = (capture(args.target, rows, out, args.target_layer_ids, log=log, dtype=dtype), rows)
        fs = sets[name][0]
        log(f"[capture] {out.name}: {len(fs)} conversations, {int(fs.offsets[-1]):,} tokens, "
            f"{fs.seconds / 60:.1f} min ({int(fs.offsets[-1]) / max(fs.seconds, 1e-9):.0f} tok/s)")
    return sets


def draft_vocabulary(args):
    """The draft vocabulary serving picks by default (``spec_decode/v1/model.py``'s rule)."""
    import torch
    from transformers import AutoConfig

    from vllm_dspark.checkpoint.token_frequency import draft_vocab_ids, load_frequency_table

    table = load_frequency_table(args.assets_dir / "dspark" / "token_frequency.json")
    eos = AutoConfig.from_pretrained(args.target).eos_token_id
    ends = [eos] if isinstance(eos, int) else list(eos or [])
    return torch.tensor(draft_vocab_ids(table, DRAFT_VOCAB, required=ends), dtype=torch.int64)


def warm_start(model, shipped: Path, scale) -> None:
    """The shipped drafter's weights; its ``fc`` reads raw features (the aux scale folded in at
    export), so the scale is unfolded for a trainer that standardises them."""
    import torch

    from vllm_dspark.checkpoint.io import load_reference_model

    src = load_reference_model(shipped).state_dict()
    missing, unexpected = model.load_state_dict(src, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"warm start: the shipped drafter {shipped} does not match the recipe's drafter "
                           f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    if scale is not None:
        with torch.no_grad():
            model.fc.weight.mul_(scale[None, :].to(model.fc.weight.dtype))


def walk_eval(model, sets, embed, scale) -> dict:
    """The served walk over every conversation of each walk set, with a bootstrap interval, and the
    teacher-forced acceptance on the set's fixed anchors."""
    from training.pipeline.served_walk import bootstrap_accept_len, walk_conversations
    from training.pipeline.trainer import block_hits, eval_anchors, evaluate

    out = {}
    for name in WALK_SETS:
        fs = sets[name][0]
        per_conv = walk_conversations(model, fs, embed, embed, scale, block_hits=block_hits)
        anc = eval_anchors(fs, model.config.block_size, 1536, seed=1)
        tf = evaluate(model, fs, anc, embed, embed, scale)["tf_accept_len"]
        out[name.removeprefix("eval_")] = {"walk": bootstrap_accept_len(per_conv), "tf_accept_len": tf}
    return out


def run_arm(args, work: Path, arm: str, sets, embed, final_norm, draft_ids, shipped: dict) -> dict:
    import torch
    from transformers import AutoConfig

    from training.pipeline.drafter import init_drafter
    from training.pipeline.trainer import TrainArgs, aux_scale, train

    train_fs, rows = sets["train_text"]
    cfg = td.drafter_config(args, AutoConfig.from_pretrained(args.target), args.markov_rank)
    model = init_drafter(cfg, seed=args.seed)
    with torch.no_grad():
        model.norm.weight.copy_(final_norm)
    targs = TrainArgs(steps=args.steps, seed=args.seed, eval_every=args.eval_every or 10**9,
                      served_walk_tokens=4096 if args.eval_every else 0,
                      **({"w_ce": 1.0, "w_l1": 0.3} if arm == "ce" else {}))
    convs = [i for i, r in enumerate(rows) if float(r.get("temperature", 0.0)) == 0.0] if arm == "greedy" else None
    run_dir = work / "probes" / f"{arm}-shard{shard_tag(args)}-steps{args.steps}"
    if arm == "warm" and not (run_dir / "ckpt.pt").exists():
        warm_start(model, args.assets_dir / "dspark", aux_scale(train_fs))
    t0 = time.time()
    curve_sets = {}
    if args.eval_every:  # the curve: teacher-forced and the walk over each set's first 4,096 tokens
        from training.pipeline.trainer import eval_anchors

        curve_sets = {n.removeprefix("eval_"): (sets[n][0], eval_anchors(sets[n][0], cfg.block_size, 768, seed=1))
                      for n in WALK_SETS}
    rec = train(model, embed, embed, train_fs, curve_sets, targs, run_dir, log=log, conversations=convs,
                draft_ids=draft_ids if arm == "draftvocab" else None,
                stop_after_s=args.stop_after_min * 60 if args.stop_after_min else None)
    log(f"[{arm}] {rec['steps_run']} steps, {rec['blocks']:,} blocks in {rec['train_seconds'] / 60:.1f} min "
        f"(this call {(time.time() - t0) / 60:.1f} min)")
    ck = torch.load(run_dir / "ckpt.pt", weights_only=False)
    ev = walk_eval(model, sets, embed, ck["aux_scale"])
    log(f"[{arm}] walk " + ", ".join(f"{k} {v['walk']['accept_len']:.3f} [{v['walk']['lo']:.3f}, "
                                     f"{v['walk']['hi']:.3f}]" for k, v in ev.items()))
    last = [r for r in rec["curve"] if not r.get("full_vocab")][-1]
    out = {"arm": arm, "steps": rec["steps_run"], "blocks": rec["blocks"], "train_seconds": rec["train_seconds"],
            "blocks_per_s": round(rec["blocks"] / max(rec["train_seconds"], 1e-9), 1),
            "conversations": len(convs) if convs is not None else len(train_fs),
            "final_loss": last["loss"], "final_tv": last["tv"], "args": rec["args"], "eval": ev,
           "finished": rec["finished"], "curve": [r for r in rec["curve"] if "eval" in r]}
    if args.export_if_better:
        out["export"] = export_if_better(args, work, arm, model, ck["aux_scale"], sets, embed, shipped)
    return out


def export_if_better(args, work: Path, arm: str, model, scale, sets, embed, shipped: dict) -> dict:
    """Export the arm's drafter (bf16, the aux scale folded in), walk the export itself, and ship it
    into ``--assets-dir/dspark`` (its frequency table kept) when it beats ``shipped`` (the shipped
    drafter's walk, taken once per run) on both sets."""
    import copy
    import shutil

    from training.pipeline.export import export_drafter
    from training.pipeline.trainer import fold_aux_scale
    from vllm_dspark.checkpoint.io import load_reference_model

    m = copy.deepcopy(model)
    fold_aux_scale(m, scale)
    where = work / "probes" / f"export-{arm}-shard{shard_tag(args)}-steps{args.steps}"
    out = export_drafter(m.eval(), where, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    ev = walk_eval(load_reference_model(out).eval(), sets, embed, None)
    better = all(ev[k]["walk"]["accept_len"] > shipped[k]["walk"]["accept_len"] for k in ("chat", "humaneval"))
    log(f"[{arm}] export walk " + ", ".join(f"{k} {ev[k]['walk']['accept_len']:.3f} (shipped "
                                           f"{shipped[k]['walk']['accept_len']:.3f})" for k in ev)
        + ("; shipping it" if better else "; the shipped drafter stays"))
    if better:
        dst = args.assets_dir / "dspark"
        for name in ("config.json", "model.safetensors"):
            tmp = dst / f"{name}.tmp"
            shutil.copyfile(Path(out) / name, tmp)
            tmp.replace(dst / name)
    return {"eval": ev, "shipped_before": shipped, "shipped": better}


def shipped_row(args, sets, embed) -> dict:
    from vllm_dspark.checkpoint.io import load_reference_model

    model = load_reference_model(args.assets_dir / "dspark").eval()
    return {"arm": "shipped", "eval": walk_eval(model, sets, embed, None)}


def write_record(args, out: Path, rows: list[dict], shard: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results = {"command": "python training/train_probes.py " + " ".join(sys.argv[1:]),
               "machine": td.machine_description(), "dtype": _train_dtype(), "shard": shard,
               "steps_per_arm": args.steps, "rows": rows}
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(out / "results.json")
    lines = ["# The training recipe's probes", "",
             f"`{results['command']}` on {results['machine']}, trainer in {results['dtype']}.",
             f"Shard: {shard['conversations']} conversations of the committed corpus from conversation "
             f"{shard.get('start', 0)} "
             f"({shard['tokens']:,} tokens). Every arm: {args.steps} steps of 4 conversations x 64 anchors, "
             "its own warm-up and cosine; judged by the served walk (every draft verified, greedy) over every "
             "conversation of the held-out chat and HumanEval sets, 95% bootstrap interval over conversations. "
             "Teacher-forced acceptance beside it (fixed anchors, 1,536 blocks).", "",
             "| arm | walk chat | walk HumanEval | teacher-forced chat / HumanEval | blocks/s | final loss / TV |",
             "|---|---|---|---|---|---|"]
    def cell(ev: dict, name: str) -> str:
        w = ev[name]["walk"]
        return f"{w['accept_len']:.3f} [{w['lo']:.3f}, {w['hi']:.3f}]"

    for r in rows:
        ev = r["eval"]
        lines.append(f"| {r['arm']} | {cell(ev, 'chat')} | {cell(ev, 'humaneval')} | "
                     f"{ev['chat']['tf_accept_len']:.3f} / {ev['humaneval']['tf_accept_len']:.3f} | "
                     f"{r.get('blocks_per_s', '-')} | "
                     + (f"{r['final_loss']:.3f} / {r['final_tv']:.3f} |" if "final_loss" in r else "- |"))
    lines += ["", "`shipped` is the drafter in `vllm_dspark/assets/smollm2/dspark`, walked the same way. "
              "Blocks per second depend on what else ran on the 2 cores; the arms' comparison is at equal steps.", ""]
    (out / "report.md").write_text("\n".join(lines))


def _train_dtype() -> str:
    from training.pipeline.trainer import bf16_autocast

    return "bf16 autocast" if bf16_autocast() else "float32"


def main(argv=None) -> int:
    from vllm_dspark.cache import cache_dir
    from vllm_dspark.tools.default_pair import default_paths

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-dir", type=Path, default=cache_dir() / "train" / "smollm2")
    ap.add_argument("--assets-dir", type=Path, default=ROOT / "vllm_dspark" / "assets" / "smollm2")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "training" / "probes")
    ap.add_argument("--target", default=None)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--shard-convs", type=int, default=400)
    ap.add_argument("--shard-start", type=int, default=0,
                    help="the shard's first conversation: a run that continues the shipped drafter trains on "
                         "conversations it has not seen, and its capture is only theirs")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record-only", action="store_true", help="write the record from finished arms only")
    ap.add_argument("--eval-every", type=int, default=0, help="steps between curve points (0: only at the end)")
    ap.add_argument("--stop-after-min", type=float, default=0.0,
                    help="checkpoint and stop an arm after this many minutes of this call (0: run it out)")
    ap.add_argument("--export-if-better", action="store_true",
                    help="export each arm's drafter and ship it when it beats the shipped one on the walk")
    args = ap.parse_args(argv)
    # The recipe's shape is train_default's: the same defaults.
    for k, v in (("dtype", "auto"), ("seq_len", 2048), ("block", 7), ("draft_layers", 2),
                 ("draft_intermediate", 1024), ("markov_rank", 64), ("target_layer_ids", [1, 8, 15, 22, 28])):
        setattr(args, k, v)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arms {unknown}; expected some of {list(ARMS)}")
    if args.target is None:
        args.target = default_paths(require=False)["target"]

    import torch

    torch.set_num_threads(args.threads)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    sets = capture_shard(args, work)
    embed, final_norm = td._target_tensors(args.target)
    shard = {"start": args.shard_start, "conversations": len(sets["train_text"][0]),
             "tokens": int(sets["train_text"][0].offsets[-1]),
             "greedy_conversations": sum(float(r.get("temperature", 0.0)) == 0.0 for r in sets["train_text"][1])}
    done_path = args.out / "results.json"
    rows = {r["arm"]: r for r in json.loads(done_path.read_text())["rows"]} if done_path.exists() else {}
    if "shipped" not in rows:
        rows["shipped"] = shipped_row(args, sets, embed)
        write_record(args, args.out, list(rows.values()), shard)
    draft_ids = draft_vocabulary(args)
    for arm in arms:
        if arm in rows and rows[arm].get("steps") == args.steps and rows[arm].get("finished", True):
            continue
        if args.record_only:
            continue
        rows[arm] = run_arm(args, work, arm, sets, embed, final_norm, draft_ids, rows["shipped"]["eval"])
        write_record(args, args.out, list(rows.values()), shard)
    write_record(args, args.out, list(rows.values()), shard)
    return 0


if __name__ == "__main__":
    sys.exit(main())
