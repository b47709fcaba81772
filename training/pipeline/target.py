"""The tiny target language model: a ``Qwen3ForCausalLM`` trained on the corpus.

Sized so that the target plus its drafter stay under 50 MB in bf16 and the
target costs several times the drafter per token (7 decoder layers against
the drafter's one). head_dim is 64, one of the head sizes vLLM's CPU attention
supports. The embedding is tied to the LM head, which the drafter borrows.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from training.pipeline.trainer import cosine_lr


@dataclass
class TargetShape:
    """Shape of the tiny target (a Qwen3 decoder)."""

    vocab_size: int = 5000
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_hidden_layers: int = 7
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0


@dataclass
class TargetTrainArgs:
    """Optimisation settings for the target."""

    steps: int = 240
    batch_size: int = 16
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 40
    eval_batches: int = 4
    log_every: int = 10
    seed: int = 0
    max_minutes: float | None = None  # stop early (cosine schedule kept) past this


def build_target_config(shape: TargetShape, special: dict[str, int]):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=special["eos"],
        eos_token_id=special["eos"],
        pad_token_id=special["pad"],
        max_window_layers=shape.num_hidden_layers,
        use_cache=True,
    )


def build_target(shape: TargetShape, special: dict[str, int], seed: int = 0):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = build_target_config(shape, special)
    model = Qwen3ForCausalLM(cfg)
    return model


def tokenize_documents(tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    """All documents' token ids, each followed by eos, as one int32 stream."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.int32)


def sample_windows(stream: np.ndarray, batch_size: int, seq_len: int,
                   gen: torch.Generator) -> torch.Tensor:
    """``[batch_size, seq_len]`` random windows of a token stream."""
    hi = len(stream) - seq_len
    starts = torch.randint(0, hi, (batch_size,), generator=gen).tolist()
    return torch.from_numpy(np.stack([stream[s:s + seq_len] for s in starts])).long()


@torch.no_grad()
def eval_loss(model, stream: np.ndarray, args: TargetTrainArgs) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(args.eval_batches):
        x = sample_windows(stream, args.batch_size, args.seq_len, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=x, labels=x)
        losses.append(float(out.loss))
    model.train()
    return float(np.mean(losses))


def train_target(model, train_stream: np.ndarray, heldout_stream: np.ndarray,
                 args: TargetTrainArgs, log=print) -> list[dict]:
    """Train ``model`` in place (bf16 autocast, fp32 master weights); return the curve."""
    gen = torch.Generator().manual_seed(args.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    curve: list[dict] = []
    model.train()
    t0 = time.time()
    for step in range(args.steps):
        lr = cosine_lr(step, args.steps, args.lr, args.warmup_steps, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        x = sample_windows(train_stream, args.batch_size, args.seq_len, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=x, labels=x)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip))
        opt.step()
        elapsed = time.time() - t0
        row = {"step": step + 1, "loss": loss.item(), "lr": lr, "grad_norm": gnorm,
               "tokens": (step + 1) * args.batch_size * args.seq_len,
               "elapsed_s": round(elapsed, 2)}
        last = step + 1 == args.steps
        over_time = args.max_minutes is not None and elapsed > args.max_minutes * 60
        if (step + 1) % args.eval_every == 0 or last or over_time:
            row["heldout_loss"] = eval_loss(model, heldout_stream, args)
        if (step + 1) % args.log_every == 0 or "heldout_loss" in row:
            curve.append(row)
            msg = (f"[target] step {step + 1}/{args.steps} loss {row['loss']:.3f} "
                   f"lr {lr:.2e} {elapsed / (step + 1):.2f}s/step elapsed {elapsed / 60:.1f}m")
            if "heldout_loss" in row:
                msg += f" heldout {row['heldout_loss']:.3f}"
            log(msg)
        if over_time:
            log(f"[target] stopping at step {step + 1}: time budget "
                f"{args.max_minutes} min reached")
            break
    return curve


def save_target(model, tokenizer, out_dir: Path, special: dict[str, int]) -> None:
    """Save in the Hugging Face layout vLLM loads: bf16 safetensors + tokenizer.

    Converts ``model`` to bf16 in place (the shipped weights are the bf16 ones).
    """
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(str(out_dir), safe_serialization=True)
    GenerationConfig(bos_token_id=special["eos"], eos_token_id=special["eos"],
                     pad_token_id=special["pad"], do_sample=False).save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update({"add_bos_token": False, "add_eos_token": False})
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def shape_dict(shape: TargetShape) -> dict:
    return asdict(shape)
