"""Training a DSpark (or DFlash-style) drafter on captured target features.

Data: a :class:`~training.pipeline.features.FeatureSet` (the target's aux
hidden states and top-K next-token distribution per token of its own answers).

One example is an anchor-first block at an anchor ``p`` whose next token the
target wrote: queries ``[ids[p], mask x (B-1)]`` at positions ``p..p+B-1``
read the context ``ids[:p]``; query ``i`` predicts the token after
``ids[p+i]``. Its label is the target's argmax there (what greedy
verification accepts; on sampled conversations it differs from the text), and
its soft target is the target's stored top-K distribution.

Dense anchors. Many anchors of one conversation run in one backbone pass with
a block mask, sharing one context forward (``fc``, ``hidden_norm`` and every
layer's context K/V), so the per-block cost is the queries' alone. Blocks see
their whole context: serving uses no window shorter than the trained context.

Loss (DeepSpec's weights), per query position ``k = i + 1``, weighted by
``exp(-(k-1)/gamma)`` with gamma 4::

    0.9 * sum|p_draft - p_target| + 0.1 * CE(draft, target argmax) + 1.0 * BCE(conf, 1 - TV)

where ``sum|p - q|`` is twice the total-variation distance ``TV``.

Candidate-set softmax. About 80% of a full-vocabulary step is the drafter's
``[positions, vocab]`` LM head and its backward. Most steps score the drafter
only on the union of the batch's per-position top-``cand_k`` target tokens
and labels (a few thousand of 49,152; the target's top 16 hold most of its
mass); every ``full_vocab_every``-th step uses the whole vocabulary, so mass
the drafter puts outside the candidates is still pushed down. The eval always
uses the full vocabulary.

Preconditioning: the target's hidden states carry "massive activations" (a
few dimensions near 10^4 against a typical RMS of ~30); the aux features are
divided by their per-dimension RMS while training and the scale is folded into
``fc.weight`` at export, so the exported drafter reads vLLM's raw features. The
confidence head's BCE is taken on detached hidden states.

Deterministic for a seed, and resumable: the model, optimiser, generator and
curve are saved atomically every ``ckpt_every_s`` seconds and at the end.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_dspark.config import DSparkConfig
from vllm_dspark.model.reference import DSparkDraftModel


@dataclass
class TrainArgs:
    """Optimisation settings (recorded with the run)."""

    steps: int = 4000
    seqs_per_step: int = 4
    anchors_per_seq: int = 64
    lr: float = 6e-4
    warmup_frac: float = 0.04
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float = 4.0
    w_l1: float = 0.9  # on sum|p - q| (= 2 TV), as the reference
    w_ce: float = 0.1
    w_bce: float = 1.0
    cand_k: int = 16
    full_vocab_every: int = 8
    standardize_aux: bool = True
    detach_confidence: bool = True
    ckpt_every_s: float = 300.0
    eval_every: int = 250
    served_walk_tokens: int = 4096  # per eval set: the served walk over its first conversations (0: off)
    log_every: int = 10
    seed: int = 0


@dataclass
class Blocks:
    aux: torch.Tensor  # [N, L, A] bf16 context features
    ctx_positions: torch.Tensor  # [N, L]
    query_ids: torch.Tensor  # [N, Q] Q = K * B
    query_positions: torch.Tensor  # [N, Q]
    mask: torch.Tensor  # [N, Q, L + Q] bool
    labels: torch.Tensor  # [N, Q] target argmax
    prev_ids: torch.Tensor  # [N, Q] the token before each label (Markov input)
    valid: torch.Tensor  # [N, Q] bool (label position written by the target)
    topk_ids: torch.Tensor  # [N, Q, K] target's top tokens at each query
    topk_p: torch.Tensor  # [N, Q, K]


def position_weights(block: int, gamma: float) -> torch.Tensor:
    """exp(-(k-1)/gamma) for k = 1..block."""
    return torch.exp(-torch.arange(block, dtype=torch.float32) / gamma)


def cosine_lr(step: int, total: int, base: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from ``base`` to ``min_ratio * base``."""
    if step < warmup:
        return base * (step + 1) / warmup
    t = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def eligible_anchors(gen: torch.Tensor, block: int) -> torch.Tensor:
    """Anchors p (1 <= p, p + block < L) whose next token the target wrote."""
    length = gen.shape[0]
    p = torch.arange(1, max(1, length - block))
    return p[gen[p + 1]]


def make_blocks(cfg: DSparkConfig, data, convs: Sequence[int], anchors: Sequence[torch.Tensor],
                window: int | None = None) -> Blocks:
    """Blocks at the given anchors (one sorted tensor per conversation, equal counts).

    ``window``: each block sees only the last ``window`` context tokens (0: none);
    the eval's context table, never training.
    """
    b = cfg.block_size
    k = len(anchors[0])
    ends = [int(a.max()) + b + 1 for a in anchors]
    rows = [data.get(c, end=e) for c, e in zip(convs, ends, strict=True)]
    length = max(ends)
    n = len(rows)

    def pad(key: str, fill) -> torch.Tensor:
        x = rows[0][key]
        out = torch.full((n, length, *x.shape[1:]), fill, dtype=x.dtype)
        for r, row in enumerate(rows):
            out[r, :len(row[key])] = row[key]
        return out

    ids, gen, aux = pad("ids", 0), pad("gen", False), pad("aux", 0)
    tk_ids, tk_p = pad("topk_ids", 0), pad("topk_p", 0.0)
    anc = torch.stack(list(anchors))  # [N, K]
    q_pos = (anc[:, :, None] + torch.arange(b)).reshape(n, k * b)  # [N, Q]
    q_ids = torch.full((n, k, b), cfg.mask_token_id, dtype=torch.long)
    q_ids[:, :, 0] = torch.gather(ids, 1, anc)
    q_ids = q_ids.reshape(n, k * b)
    gi = q_pos[:, :, None].expand(-1, -1, tk_ids.shape[-1])
    q_tk_ids, q_tk_p = torch.gather(tk_ids, 1, gi), torch.gather(tk_p, 1, gi)
    cols = torch.arange(length)[None, None, :]
    hi = anc.repeat_interleave(b, 1)[:, :, None]  # [N, Q, 1]
    ctx_ok = cols < hi
    if window is not None:
        ctx_ok &= cols >= hi - window
    blk = torch.arange(k).repeat_interleave(b)
    q_ok = (blk[:, None] == blk[None, :])[None].expand(n, -1, -1)
    return Blocks(aux=aux, ctx_positions=torch.arange(length)[None].expand(n, -1), query_ids=q_ids,
                  query_positions=q_pos, mask=torch.cat([ctx_ok, q_ok], -1), labels=q_tk_ids[..., 0],
                  prev_ids=torch.gather(ids, 1, q_pos), valid=torch.gather(gen, 1, q_pos + 1),
                  topk_ids=q_tk_ids, topk_p=q_tk_p)


def sample_anchors(data, conv: int, k: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """``k`` distinct anchors of conversation ``conv`` (with repeats only if it has fewer), sorted."""
    g = torch.from_numpy(data.gen[int(data.offsets[conv]):int(data.offsets[conv + 1])].astype(bool))
    cand = eligible_anchors(g, block)
    if len(cand) == 0:
        raise RuntimeError(f"conversation {conv} has no target-written tokens to anchor on")
    pick = cand[torch.randperm(len(cand), generator=gen)[:k]]
    if len(pick) < k:
        pick = torch.cat([pick, cand[torch.randint(0, len(cand), (k - len(pick),), generator=gen)]])
    return pick.sort().values


def aux_scale(data, n: int = 32, floor: float = 1e-2) -> torch.Tensor:
    """Per-dimension RMS of the aux features over the first ``n`` conversations (token 0, the sink, left out)."""
    xs = [data.get(i)["aux"][1:].float() for i in range(min(n, len(data)))]
    x = torch.cat(xs)
    return x.pow(2).mean(0).sqrt().clamp(min=floor)


def bf16_autocast() -> bool:
    """Whether training runs under bf16 autocast: only where oneDNN computes bf16 natively (AVX-512 or
    AMX). On an AVX2-only CPU bf16 is emulated, slower than float32, so the trainer stays in float32."""
    global _BF16
    if _BF16 is None:
        env = os.environ.get("VLLM_DSPARK_TRAIN_BF16")
        _BF16 = env == "1" if env in ("0", "1") else bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return _BF16


_BF16: bool | None = None


def _hidden(model: DSparkDraftModel, blocks: Blocks, embed: torch.Tensor, scale: torch.Tensor | None):
    aux = blocks.aux.float() if scale is None else blocks.aux.float() / scale
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast()):
        hidden = model.backbone(aux, blocks.ctx_positions, embed[blocks.query_ids], blocks.query_positions,
                                blocks.mask)
    return hidden.float()


def candidate_logits(model: DSparkDraftModel, hidden: torch.Tensor, prev_ids: torch.Tensor,
                     lm_head: torch.Tensor, cand: torch.Tensor | None, use_markov: bool = True) -> torch.Tensor:
    """Drafter logits [P, C] (fp32) over the candidate tokens ``cand`` (None: the whole vocabulary)."""
    w = lm_head if cand is None else lm_head[cand]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast()):
        logits = hidden @ w.t()
        if use_markov and model.markov_head is not None:
            w2 = model.markov_head.markov_w2.weight
            logits = logits + model.markov_embed(prev_ids) @ (w2 if cand is None else w2[cand]).t()
    return logits.float()


def block_loss(model: DSparkDraftModel, blocks: Blocks, embed: torch.Tensor, lm_head: torch.Tensor,
               args: TrainArgs, scale: torch.Tensor | None, full_vocab: bool,
               draft_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The step's loss. ``draft_ids``: score on this fixed vocabulary (the one serving drafts from)
    instead of the candidate set or the whole vocabulary; the target's mass outside it is dropped
    and renormalised, and a label outside it has no CE term (serving can never draft it)."""
    b = model.config.block_size
    vocab = lm_head.shape[0]
    hidden = _hidden(model, blocks, embed, scale)  # [N, Q, H]
    sel = blocks.valid  # positions with a loss
    h, prev = hidden[sel], blocks.prev_ids[sel]  # [P, H], [P]
    tk_ids, tk_p, labels = blocks.topk_ids[sel], blocks.topk_p[sel], blocks.labels[sel]
    if draft_ids is not None:
        cand = draft_ids
        where = torch.full((vocab,), -1, dtype=torch.long)
        where[cand] = torch.arange(len(cand))
    elif full_vocab:
        cand, where = None, torch.arange(vocab)
    else:
        cand = torch.unique(torch.cat([tk_ids[:, :args.cand_k].reshape(-1), labels]))
        where = torch.full((vocab,), -1, dtype=torch.long)
        where[cand] = torch.arange(len(cand))
    n_cand = vocab if cand is None else len(cand)
    logp = candidate_logits(model, h, prev, lm_head, cand).log_softmax(-1)  # [P, C]
    col = where[tk_ids]
    tgt = torch.zeros(len(h), n_cand)
    tgt.scatter_add_(1, col.clamp(min=0), tk_p * (col >= 0))
    tgt = tgt / tgt.sum(-1, keepdim=True).clamp(min=1e-6)
    l1 = (logp.exp() - tgt).abs().sum(-1)  # [P] = 2 TV
    label_col = where[labels]
    ce = -logp.gather(1, label_col.clamp(min=0)[:, None]).squeeze(1) * (label_col >= 0)
    tv = 0.5 * l1
    conf_label = (1.0 - tv).detach().clamp(0, 1)
    if model.confidence_head is not None:
        hc = h.detach() if args.detach_confidence else h
        conf_logit = model.confidence_logits(hc, prev)
        bce = F.binary_cross_entropy_with_logits(conf_logit, conf_label, reduction="none")
    else:
        conf_logit, bce = None, torch.zeros_like(tv)
    w = position_weights(b, args.gamma).repeat(blocks.labels.shape[1] // b)[None].expand_as(sel)[sel]
    per = args.w_l1 * l1 + args.w_ce * ce + args.w_bce * bce
    loss = (per * w).sum() / w.sum().clamp(min=1.0)
    with torch.no_grad():
        m = {"loss": float(loss), "tv": float((tv * w).sum() / w.sum()), "ce": float((ce * w).sum() / w.sum()),
             "bce": float((bce * w).sum() / w.sum()), "candidates": n_cand}
        if conf_logit is not None:
            m["conf_mae"] = float(((conf_logit.sigmoid() - conf_label).abs() * w).sum() / w.sum())
    return loss, m


@torch.no_grad()
def block_hits(model: DSparkDraftModel, data, conv: int, anchors: torch.Tensor, embed, lm_head,
               scale: torch.Tensor | None, *, window: int | None = None, use_markov: bool = True) -> torch.Tensor:
    """[K, B] bool: whether the draft at each of ``anchors`` (of conversation ``conv``) is right at each
    position (the drafter's full-vocabulary argmax equals the target's, on a target-written label)."""
    blk = make_blocks(model.config, data, [conv], [anchors], window=window)
    hidden = _hidden(model, blk, embed, scale)[0]
    logits = candidate_logits(model, hidden, blk.prev_ids[0], lm_head, None, use_markov)
    hit = (logits.argmax(-1) == blk.labels[0]) & blk.valid[0]
    return hit.view(-1, model.config.block_size)


@torch.no_grad()
def evaluate(model: DSparkDraftModel, data, anchors: dict[int, torch.Tensor], embed, lm_head,
             scale: torch.Tensor | None, *, window: int | None = None, use_markov: bool = True,
             chunk: int = 48) -> dict:
    """Teacher-forced acceptance on fixed blocks: mean accepted length and per-position acceptance.

    A block's accepted length is 1 + the drafts before its first miss (a miss: the drafter's
    full-vocabulary argmax differs from the target's argmax, or the label is not the target's).
    """
    was = model.training
    model.eval()
    hits = [block_hits(model, data, conv, anc[s:s + chunk], embed, lm_head, scale, window=window,
                       use_markov=use_markov).float()
            for conv, anc in anchors.items() for s in range(0, len(anc), chunk)]
    hit = torch.cat(hits)
    model.train(was)
    return {"blocks": len(hit), "acc_per_pos": [round(x, 4) for x in hit.mean(0).tolist()],
            "tf_accept_len": round(float(1 + hit.cumprod(1).sum(1).mean()), 4)}


def eval_row(model: DSparkDraftModel, eval_sets: dict, embed, lm_head, scale, served_tokens: int) -> dict:
    """Teacher-forced acceptance on each set's fixed anchors, and the served walk beside it."""
    from training.pipeline.served_walk import served_walk

    out = {}
    for name, (ds, anc) in eval_sets.items():
        out[name] = evaluate(model, ds, anc, embed, lm_head, scale)
        if served_tokens > 0:
            out[name]["served"] = served_walk(model, ds, embed, lm_head, scale, block_hits=block_hits,
                                              max_tokens=served_tokens)
    return out


def eval_anchors(data, block: int, min_blocks: int, seed: int) -> dict[int, torch.Tensor]:
    """At least ``min_blocks`` fixed anchors (when the set has them), spread evenly over its conversations."""
    cands = {}
    for c in range(len(data)):
        gm = torch.from_numpy(data.gen[int(data.offsets[c]):int(data.offsets[c + 1])].astype(bool))
        cand = eligible_anchors(gm, block)
        if len(cand):
            cands[c] = cand
    per = max(1, math.ceil(min_blocks / max(1, len(cands))))
    while True:
        g = torch.Generator().manual_seed(seed)
        out = {c: cand[torch.randperm(len(cand), generator=g)[:per]].sort().values for c, cand in cands.items()}
        total = sum(len(a) for a in out.values())
        if total >= min_blocks or total == sum(len(c) for c in cands.values()):
            return out
        per *= 2


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(model: DSparkDraftModel, embed: torch.Tensor, lm_head: torch.Tensor, train_data,
          eval_sets: dict[str, tuple[object, dict[int, torch.Tensor]]], args: TrainArgs, work_dir: str | Path,
          log: Callable[[str], None] = print, stop_after_s: float | None = None,
          conversations: Sequence[int] | None = None, draft_ids: torch.Tensor | None = None) -> dict:
    """Train in place, resuming from ``work_dir/ckpt.pt``; returns the run record.

    ``eval_sets``: name -> (FeatureSet, fixed eval anchors). ``stop_after_s``: return
    (checkpointed) after that many seconds of this call, to be resumed later; the
    record then has ``"finished": False``. ``conversations``: train on these conversations of
    ``train_data`` only (e.g. the greedy ones). ``draft_ids``: every step scores the drafter on
    this vocabulary (:func:`block_loss`), with no full-vocabulary steps.
    """
    pool = list(range(len(train_data))) if conversations is None else [int(c) for c in conversations]
    if not pool:
        raise ValueError("train: no conversations to train on")
    from tqdm import tqdm

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path = work / "ckpt.pt"
    embed, lm_head = embed.detach().float(), lm_head.detach().float()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)
    curve: list[dict] = []
    order: list[int] = []
    step0, spent, blocks_seen = 0, 0.0, 0
    scale = aux_scale(train_data) if args.standardize_aux else None
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        curve, order, step0, spent = ck["curve"], ck["order"], ck["step"], ck["seconds"]
        blocks_seen, scale = ck.get("blocks", 0), ck.get("aux_scale", scale)
        log(f"[train] resuming {work.name} at step {step0}/{args.steps} ({spent / 60:.1f} min spent)")
    warmup = max(1, int(args.warmup_frac * args.steps))

    def save(done: int) -> None:
        _save_atomic({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "curve": curve,
                      "order": order, "step": done, "seconds": time.time() - t0, "blocks": blocks_seen,
                      "args": asdict(args), "aux_scale": scale}, ckpt_path)

    model.train()
    t0 = time.time() - spent
    t_call, last_ckpt = time.time(), time.time()
    bar = tqdm(total=args.steps, initial=step0, desc=work.name, unit="step", dynamic_ncols=True, mininterval=10)
    done = step0
    for step in range(step0, args.steps):
        lr = cosine_lr(step, args.steps, args.lr, warmup, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        if len(order) < args.seqs_per_step:
            order += [pool[i] for i in torch.randperm(len(pool), generator=gen).tolist()]
        convs, order = order[:args.seqs_per_step], order[args.seqs_per_step:]
        anchors = [sample_anchors(train_data, c, args.anchors_per_seq, model.config.block_size, gen) for c in convs]
        blocks = make_blocks(model.config, train_data, convs, anchors)
        full = draft_ids is None and args.full_vocab_every > 0 and step % args.full_vocab_every == 0
        loss, m = block_loss(model, blocks, embed, lm_head, args, scale, full, draft_ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip))
        if not math.isfinite(gnorm):
            raise RuntimeError(f"non-finite gradient norm at step {step + 1}; lower the learning rate")
        opt.step()
        blocks_seen += len(convs) * args.anchors_per_seq
        done = step + 1
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.3f}", tv=f"{m['tv']:.3f}")
        # Full-vocabulary steps are logged too (their loss is on another scale than a candidate step's).
        if done % args.log_every == 0 or done == args.steps or full:
            el = time.time() - t0
            row = {"step": done, "lr": lr, "grad_norm": gnorm, "elapsed_s": round(el, 1), "blocks": blocks_seen,
                   "blocks_per_s": round(blocks_seen / max(el, 1e-9), 1), "full_vocab": full, **m}
            if done % args.eval_every == 0 or done == args.steps:
                row["eval"] = eval_row(model, eval_sets, embed, lm_head, scale, args.served_walk_tokens)
                log(f"[train] {work.name} step {done} ({el / 60:.0f} min, {row['blocks_per_s']} blocks/s): "
                    f"loss {m['loss']:.3f} tv {m['tv']:.3f} | eval tf_len "
                    + ", ".join(f"{k} {v['tf_accept_len']:.2f}" for k, v in row["eval"].items())
                    + " | served " + ", ".join(f"{k} {v['served']['accept_len']:.2f}"
                                               for k, v in row["eval"].items() if "served" in v))
            curve.append(row)
        if time.time() - last_ckpt > args.ckpt_every_s:
            save(done)
            last_ckpt = time.time()
        if stop_after_s is not None and time.time() - t_call > stop_after_s:
            break
    bar.close()
    save(done)
    record = {"args": asdict(args), "config": model.config.to_hf_dict(), "steps_run": done,
              "finished": done >= args.steps, "train_seconds": round(time.time() - t0, 1),
              "blocks": blocks_seen, "curve": curve}
    (work / "record.json").write_text(json.dumps(record, indent=1))
    return record


def fold_aux_scale(model: DSparkDraftModel, scale: torch.Tensor | None) -> None:
    """fc(aux / s) == (fc.weight / s) @ aux: the exported drafter reads raw aux features."""
    if scale is not None:
        with torch.no_grad():
            model.fc.weight.div_(scale[None, :].to(model.fc.weight.dtype))


def plot_curves(records: dict[str, dict], out_png: str | Path) -> None:
    """Training loss, TV, and held-out teacher-forced acceptance of each run, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, rec in records.items():
        c = [r for r in rec["curve"] if not r.get("full_vocab")]
        full = [r for r in rec["curve"] if r.get("full_vocab")]
        for ax, key in ((axes[0], "loss"), (axes[1], "tv")):
            ax.plot([r["step"] for r in c], [r[key] for r in c], label=f"{name} (candidate set)")
            if full:
                ax.plot([r["step"] for r in full], [r[key] for r in full], "x", ms=3,
                        label=f"{name} (full vocabulary)")
        ev = [r for r in rec["curve"] if "eval" in r]
        for set_name in (ev[0]["eval"] if ev else {}):
            line = axes[2].plot([r["step"] for r in ev], [r["eval"][set_name]["tf_accept_len"] for r in ev],
                                marker="o", ls="--", label=f"{name} {set_name} teacher-forced")
            served = [r for r in ev if "served" in r["eval"][set_name]]
            if served:
                axes[2].plot([r["step"] for r in served], [r["eval"][set_name]["served"]["accept_len"] for r in served],
                             marker="s", color=line[0].get_color(), label=f"{name} {set_name} served walk")
    axes[0].set_title("training loss (0.9 L1 + 0.1 CE + 1.0 BCE)")
    axes[1].set_title("training TV distance to the target")
    axes[2].set_title("held-out acceptance length (served walk, teacher-forced)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
