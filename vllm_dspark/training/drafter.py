"""Training the DSpark drafter against a frozen target.

One training example is a sequence the target itself generated greedily (so
every block's labels are exactly the chain the target verifies at greedy). For
each sequence we draw random anchors ``p`` and build anchor-first query blocks:
queries ``[tok[p], mask x (B-1)]`` at positions ``p .. p+B-1``, the context is
the target's aux features of tokens ``0 .. p-1``, and query ``i`` predicts
token ``p+i+1``. All blocks of one sequence run in one backbone pass with a
block mask (each block sees its own context prefix and its own queries, never
another block).

Loss per query position ``k = i + 1`` (paper recipe)::

    0.1 * CE(draft logits, target argmax)
  + 0.9 * TV(draft probs, target probs)
  + 1.0 * BCE(confidence, 1 - TV)          # label detached
    weighted by exp(-(k - 1) / gamma), normalised by the weights' sum.

The draft logits are teacher-forced: the Markov head sees the previous LABEL
token (the anchor for ``i == 0``), as in the sequential drafting stage where it
sees the previously drafted token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from vllm_dspark.config import DSparkConfig
from vllm_dspark.model.reference import DraftLayer, DSparkDraftModel
from vllm_dspark.training.capture import target_embed_and_head


def build_drafter_config(target_config, *, mask_token_id: int, target_layer_ids,
                         num_hidden_layers: int = 1, intermediate_size: int | None = None,
                         markov_rank: int = 128, block_size: int = 7) -> DSparkConfig:
    """A DSpark config whose backbone matches the target's attention shape."""
    rope = getattr(target_config, "rope_parameters", None) or {}
    return DSparkConfig(
        hidden_size=target_config.hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=target_config.head_dim,
        intermediate_size=intermediate_size or target_config.intermediate_size,
        rms_norm_eps=target_config.rms_norm_eps,
        vocab_size=target_config.vocab_size,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
        rope_scaling=None,
        block_size=block_size,
        target_layer_ids=tuple(target_layer_ids),
        num_target_layers=target_config.num_hidden_layers,
        mask_token_id=mask_token_id,
        markov_rank=markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=markov_rank > 0,
        confidence_head_alpha=1.0,
    )


def init_drafter(config: DSparkConfig, seed: int, std: float = 0.02) -> DSparkDraftModel:
    """Fresh drafter: normal(0, std) matrices, unit norms, zero Markov output."""
    torch.manual_seed(seed)
    model = DSparkDraftModel(config)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        elif name.endswith(".bias"):
            torch.nn.init.zeros_(p)
        else:
            torch.nn.init.normal_(p, std=std)
    if model.markov_head is not None:
        # Start as the plain DFlash-style drafter; the bias grows from zero.
        torch.nn.init.zeros_(model.markov_head.markov_w2.weight)
    return model


@dataclass
class DrafterTrainArgs:
    """Optimisation settings for the drafter."""

    steps: int = 1500
    batch_size: int = 8  # sequences per step
    anchors_per_seq: int = 32
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 5.0  # position-weight decay exp(-(k-1)/gamma)
    w_ce: float = 0.1
    w_tv: float = 0.9
    w_bce: float = 1.0
    log_every: int = 10
    eval_every: int = 100
    seed: int = 0
    # Wall-clock budget (minutes) or None. When set, the cosine schedule advances by
    # max(step / steps, elapsed / budget) and training stops when either runs out,
    # so a contended machine still ends with a decayed learning rate. The steps
    # actually run are recorded; rerun with that step count and no budget to repeat
    # the run exactly.
    max_minutes: float | None = None


@dataclass
class BlockBatch:
    aux: torch.Tensor  # [N, L, n_aux * H]
    ctx_positions: torch.Tensor  # [N, L]
    query_ids: torch.Tensor  # [N, K * B]
    query_positions: torch.Tensor  # [N, K * B]
    mask: torch.Tensor  # [N, K * B, L + K * B] bool
    labels: torch.Tensor  # [N, K * B] target argmax at each query's predicted token
    prev_ids: torch.Tensor  # [N, K * B] previous label (anchor at block position 0)
    target_probs: torch.Tensor  # [N, K * B, V] fp32


def sample_anchors(lengths: list[int], low: list[int], num: int, block: int,
                   gen: torch.Generator) -> torch.Tensor:
    """[N, num] anchor positions p with low[n] <= p <= len - block (sorted per row)."""
    rows = []
    for length, lo in zip(lengths, low):
        hi = length - block  # query i predicts token p + i + 1 <= length - 1
        lo = max(1, min(lo, hi))
        cand = torch.arange(lo, hi + 1)
        pick = cand[torch.randperm(len(cand), generator=gen)[:num]]
        if len(pick) < num:  # short sequence: repeat anchors
            pick = pick[torch.randint(0, len(pick), (num,), generator=gen)]
        rows.append(pick.sort().values)
    return torch.stack(rows)


def build_blocks(config: DSparkConfig, tp_aux: torch.Tensor, tp_logits: torch.Tensor,
                 input_ids: torch.Tensor, anchors: torch.Tensor) -> BlockBatch:
    """Anchor-first query blocks for the anchors [N, K] of sequences [N, L]."""
    n, length = input_ids.shape
    b = config.block_size
    k = anchors.shape[1]
    offs = torch.arange(b)
    q_pos = (anchors[:, :, None] + offs).reshape(n, k * b)  # [N, K*B]
    q_ids = torch.full((n, k, b), config.mask_token_id, dtype=torch.long)
    q_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    q_ids = q_ids.reshape(n, k * b)
    # Query i at position p + i predicts token p + i + 1: the target's logits at p + i.
    logits = torch.gather(tp_logits, 1, q_pos[:, :, None].expand(-1, -1, tp_logits.shape[-1]))
    labels = logits.argmax(-1)  # [N, K*B]
    prev = torch.cat([q_ids.view(n, k, b)[:, :, :1], labels.view(n, k, b)[:, :, :-1]], dim=2)
    prev = prev.reshape(n, k * b)
    ctx_ok = torch.arange(length)[None, None, :] < anchors.repeat_interleave(b, 1)[:, :, None]
    blk = torch.arange(k).repeat_interleave(b)
    q_ok = (blk[:, None] == blk[None, :])[None].expand(n, -1, -1)
    mask = torch.cat([ctx_ok, q_ok], dim=-1)
    return BlockBatch(
        aux=tp_aux, ctx_positions=torch.arange(length)[None].expand(n, -1),
        query_ids=q_ids, query_positions=q_pos, mask=mask, labels=labels, prev_ids=prev,
        target_probs=logits.softmax(-1))


def position_weights(block: int, gamma: float) -> torch.Tensor:
    """exp(-(k-1)/gamma) for k = 1..block."""
    return torch.exp(-torch.arange(block, dtype=torch.float32) / gamma)


def drafter_loss(model: DSparkDraftModel, batch: BlockBatch, embed: torch.Tensor,
                 lm_head: torch.Tensor, args: DrafterTrainArgs) -> tuple[torch.Tensor, dict]:
    """The DSpark loss on one batch of blocks; returns (loss, metrics)."""
    cfg = model.config
    b = cfg.block_size
    q_emb = embed[batch.query_ids].float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.backbone(batch.aux, batch.ctx_positions, q_emb, batch.query_positions,
                                batch.mask)
    logits = model.teacher_forced_logits(hidden, batch.prev_ids, lm_head)  # [N, Q, V] fp32
    logp = logits.log_softmax(-1)
    probs = logp.exp()
    ce = F.nll_loss(logp.flatten(0, 1), batch.labels.flatten(), reduction="none").view_as(batch.labels)
    tv = 0.5 * (probs - batch.target_probs).abs().sum(-1)  # [N, Q]
    conf_label = (1.0 - tv).detach().clamp(0, 1)
    if model.confidence_head is not None:
        conf_logit = model.confidence_logits(hidden, batch.prev_ids)
        bce = F.binary_cross_entropy_with_logits(conf_logit, conf_label, reduction="none")
    else:
        conf_logit = None
        bce = torch.zeros_like(tv)
    w = position_weights(b, args.gamma).repeat(batch.labels.shape[1] // b)[None]  # [1, Q]
    per = args.w_ce * ce + args.w_tv * tv + args.w_bce * bce
    loss = (per * w).sum() / (w.sum() * per.shape[0])
    with torch.no_grad():
        hit = (logits.argmax(-1) == batch.labels).float().view(-1, b)  # [N*K, B]
        metrics = {
            "loss": float(loss), "ce": float((ce * w).sum() / (w.sum() * ce.shape[0])),
            "tv": float(tv.mean()), "bce": float(bce.mean()),
            "acc_per_pos": hit.mean(0).tolist(),
            # teacher-forced accepted prefix, the offline proxy of acceptance length
            "tf_accept_len": float(1 + hit.cumprod(1).sum(1).mean()),
        }
        if conf_logit is not None:
            metrics["conf_mae"] = float((conf_logit.sigmoid() - conf_label).abs().mean())
    return loss, metrics


def cosine_lr(progress: float, step: int, base: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine to ``min_ratio`` over ``progress`` in [0, 1]."""
    if step < warmup:
        return base * (step + 1) / warmup
    t = min(1.0, max(0.0, progress))
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def make_batch(data, config: DSparkConfig, idx: list[int], args: DrafterTrainArgs,
               gen: torch.Generator) -> BlockBatch:
    """Blocks at random anchors of the sequences ``idx`` of a :class:`DistillSet`."""
    ids, plens, aux, logits = data.get(idx)
    # Anchors from the end of the prompt on: there the text is the target's own
    # greedy chain, so the labels are exactly what verification would accept.
    low = [p - 1 for p in plens]
    anchors = sample_anchors([ids.shape[1]] * len(idx), low, args.anchors_per_seq,
                             config.block_size, gen)
    return build_blocks(config, aux, logits, ids, anchors)


def train_drafter(model: DSparkDraftModel, target, train_data, eval_data,
                  args: DrafterTrainArgs, log=print) -> list[dict]:
    """Train ``model`` in place on :class:`DistillSet` s; returns the loss curve.

    ``target`` is only used for its embedding and LM head (the features and
    logits were captured beforehand).
    """
    embed, lm_head = target_embed_and_head(target)
    embed, lm_head = embed.detach().float(), lm_head.detach().float()
    gen = torch.Generator().manual_seed(args.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    eval_idx = list(range(min(len(eval_data), 4 * args.batch_size)))
    eval_batches = [make_batch(eval_data, model.config, eval_idx[i:i + args.batch_size], args, eval_gen)
                    for i in range(0, len(eval_idx), args.batch_size)]
    curve: list[dict] = []
    order: list[int] = []
    t0 = time.time()
    model.train()
    budget_s = None if not args.max_minutes else 60.0 * args.max_minutes
    for step in range(args.steps):
        progress = step / args.steps
        if budget_s is not None:
            progress = max(progress, (time.time() - t0) / budget_s)
            if progress >= 1.0:
                log(f"[drafter] time budget of {args.max_minutes} min reached after {step} steps")
                break
        lr = cosine_lr(progress, step, args.lr, args.warmup_steps, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        if len(order) < args.batch_size:
            order += torch.randperm(len(train_data), generator=gen).tolist()
        idx, order = order[:args.batch_size], order[args.batch_size:]
        batch = make_batch(train_data, model.config, idx, args, gen)
        loss, m = drafter_loss(model, batch, embed, lm_head, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip))
        opt.step()
        elapsed = time.time() - t0
        last = step + 1 == args.steps or (
            budget_s is not None and (time.time() - t0) / budget_s >= 1.0)
        if (step + 1) % args.log_every == 0 or last:
            row = {"step": step + 1, "lr": lr, "grad_norm": gnorm, "elapsed_s": round(elapsed, 1),
                   **{k: v for k, v in m.items()}}
            if (step + 1) % args.eval_every == 0 or last:
                row["eval"] = evaluate(model, eval_batches, embed, lm_head, args)
            curve.append(row)
            msg = (f"[drafter] step {step + 1}/{args.steps} loss {m['loss']:.3f} ce {m['ce']:.3f} "
                   f"tv {m['tv']:.3f} bce {m['bce']:.3f} tf_len {m['tf_accept_len']:.2f} "
                   f"lr {lr:.2e} {elapsed / (step + 1):.2f}s/step {elapsed / 60:.1f}m")
            if "eval" in row:
                e = row["eval"]
                msg += (f" | eval tf_len {e['tf_accept_len']:.2f} "
                        f"(no markov {e['tf_accept_len_no_markov']:.2f}) tv {e['tv']:.3f}")
            log(msg)
        if last:
            break
    model.eval()
    return curve


@torch.no_grad()
def evaluate(model: DSparkDraftModel, batches: list[BlockBatch], embed, lm_head,
             args: DrafterTrainArgs) -> dict:
    """Teacher-forced metrics on fixed held-out batches, with and without the Markov bias."""
    was_training = model.training
    model.eval()
    out: dict = {}
    hits: list[torch.Tensor] = []
    hits_nm: list[torch.Tensor] = []
    tvs = []
    b = model.config.block_size
    for batch in batches:
        q_emb = embed[batch.query_ids].float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = model.backbone(batch.aux, batch.ctx_positions, q_emb, batch.query_positions,
                                    batch.mask)
        for use_markov, acc in ((True, hits), (False, hits_nm)):
            logits = model.teacher_forced_logits(hidden, batch.prev_ids, lm_head, use_markov=use_markov)
            acc.append((logits.argmax(-1) == batch.labels).float().view(-1, b))
            if use_markov:
                tvs.append(0.5 * (logits.softmax(-1) - batch.target_probs).abs().sum(-1).mean())
    hit, hit_nm = torch.cat(hits), torch.cat(hits_nm)
    out["acc_per_pos"] = hit.mean(0).tolist()
    out["tf_accept_len"] = float(1 + hit.cumprod(1).sum(1).mean())
    out["tf_accept_len_no_markov"] = float(1 + hit_nm.cumprod(1).sum(1).mean())
    out["tv"] = float(torch.stack(tvs).mean())
    model.train(was_training)
    return out


def init_from_target(model: DSparkDraftModel, target_state: dict, *, num_target_layers: int,
                     aux_scale: torch.Tensor | None = None) -> list[str]:
    """Start the drafter from the target's own last layers (EAGLE-style warm start).

    Draft layer k takes target layer ``num_target_layers - L + k`` (attention and
    MLP projections, both norms; shapes must match), the final norm takes the
    target's, and ``fc`` starts as the identity on the LAST aux layer's features
    (so the context states begin as the target's own hidden states there) and
    zero on the others. ``aux_scale``: the per-dimension scale the trainer
    divides the aux features by (the identity block is scaled back up by it).
    Returns the names of the tensors it set.
    """
    cfg = model.config
    n_l = cfg.num_hidden_layers
    done = []
    with torch.no_grad():
        for k, mod in enumerate(model.layers):
            layer = cast(DraftLayer, mod)
            src = f"model.layers.{num_target_layers - n_l + k}."
            pairs = {
                "self_attn.q_proj.weight": layer.self_attn.q_proj.weight,
                "self_attn.k_proj.weight": layer.self_attn.k_proj.weight,
                "self_attn.v_proj.weight": layer.self_attn.v_proj.weight,
                "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
                "mlp.gate_proj.weight": layer.mlp.gate_proj.weight,
                "mlp.up_proj.weight": layer.mlp.up_proj.weight,
                "mlp.down_proj.weight": layer.mlp.down_proj.weight,
                "input_layernorm.weight": layer.input_layernorm.weight,
                "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
            }
            for name, dst in pairs.items():
                w = target_state.get(src + name)
                if w is not None and tuple(w.shape) == tuple(dst.shape):
                    dst.copy_(w.float())
                    done.append(f"layers.{k}.{name}")
        if "model.norm.weight" in target_state:
            model.norm.weight.copy_(target_state["model.norm.weight"].float())
            done.append("norm.weight")
        h = cfg.hidden_size
        th = cfg.target_hidden_size or h
        if th == h:
            model.fc.weight.zero_()
            block = torch.eye(h)
            if aux_scale is not None:
                block = block * aux_scale[-th:].float()[None, :]
            model.fc.weight[:, -th:] = block
            done.append("fc.weight")
    return done
