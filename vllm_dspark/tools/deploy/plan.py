"""``vllm-dspark plan``: per-GPU memory a DSpark deployment needs beyond the target's weights.

For a context length, batch, tensor- and pipeline-parallel sizes and KV dtype
it adds up, per GPU:

* the drafter's weights, split the way vLLM's DFlash/DSpark draft model splits
  them (attention, MLP and ``markov_w2`` over TP; ``fc``, ``markov_w1``, the
  norms and the confidence head replicated on every TP rank), on the last
  pipeline stage, where vLLM runs the proposer;
* the drafter's KV cache: ``layers x kv_heads x head_dim x (K, V) x bytes`` per
  context token, with KV heads split over TP (an MLA drafter, ``K3DSparkModel``:
  ``layers x (kv_lora_rank + qk_rope_head_dim) x bytes``, the same on every TP
  rank, like the target's MLA cache); with and without a window on the
  drafter's attention (default window: the drafter's trained context,
  ``max_position_embeddings``, 65,536 for the K3 drafter);
* the target's attention cache: for a Kimi K3 / Kimi-Linear target, the MLA
  latent cache of its full-attention layers (one ``kv_lora_rank +
  qk_rope_head_dim`` vector per token and layer, the same on every TP rank) and
  the KDA linear-attention state of the others (a fixed size per sequence:
  convolution + recurrent state, split over TP); for a plain dense target, the
  ordinary per-head K/V cache.

Not included: the target's weights, activations, CUDA graphs, NCCL buffers,
vLLM's block rounding and page padding. The per-token figures match vLLM's own
``FullAttentionSpec`` / ``MLAAttentionSpec`` / ``MambaSpec`` page sizes
(``tests/deploy/test_plan.py`` checks them against vLLM).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from vllm_dspark.config import DTYPE_BYTES, DSparkConfig, DSparkConfigError
from vllm_dspark.serving.compat import (
    TargetConfigError,
    check_target_compat,
    is_kimi_k3,
    load_target_config,
    text_config,
)

GiB = 1024 ** 3
MiB = 1024 ** 2
# --kv-dtype name -> bytes per element ("auto" = the model dtype, bf16 for these models).
KV_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
                  "float32": 4}
KDA_RECURRENT_BYTES = 4  # vLLM's default KDA recurrent state dtype is fp32 (kda_state_dtype, "auto")
TP_SHARDED_SUFFIXES = ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
                       "mlp.up_proj.weight", "mlp.down_proj.weight",
                       # MLA: the up-projections and the output gate are split over heads; the down-projections
                       # (q_a_proj, kv_a_proj_with_mqa) and their norms are replicated.
                       "self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight", "self_attn.g_proj.weight")
KV_PROJ_SUFFIXES = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")
# Vocabulary-parallel: split over TP like an LM head (a draft vocabulary's lm_head is the drafter's own).
VOCAB_SHARDED = ("markov_head.markov_w2.weight", "lm_head.weight")


def bundled_k3_paths() -> tuple[Path, Path]:
    """(drafter config.json, target config.json) of the bundled Kimi K3 fixtures."""
    base = Path(str(resources.files("vllm_dspark") / "assets" / "k3"))
    return base / "drafter" / "config.json", base / "target" / "config.json"


def pp_partition(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[start, end) decoder layers per pipeline stage, as vLLM splits them by default.

    Equal shares; the remainder goes one layer each to the stages just before
    the last (vLLM keeps the last stage light because it also holds the final
    norm and LM head). ``VLLM_PP_LAYER_PARTITION`` overrides this in vLLM.
    """
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


@dataclass(frozen=True)
class PlanInputs:
    context: int
    batch: int
    tp: int
    pp: int
    kv_dtype: str
    window: int | None  # None: the drafter attends to the whole context
    num_speculative_tokens: int
    block_size: int = 16  # KV-cache block size (vLLM's GPU default)
    max_num_batched_tokens: int = 8192  # scheduler token budget (vLLM's default for serving)


def draft_kv_blocks_per_sequence(*, block_size: int, window: int | None, decode_tokens: int, context: int,
                                 num_kv_heads: int = 1, head_size: int = 64) -> int:
    """Blocks ONE draft layer holds for one sequence, from vLLM's own KV-cache spec classes.

    With a window, vLLM's ``SlidingWindowSpec.max_admission_blocks_per_request``:
    the window plus the tokens in flight in a step (``decode_tokens``: 1 + the
    drafts verified; pass the scheduler's token budget for the prefill peak), plus
    one block for a window that does not start on a block boundary. Without one,
    ``FullAttentionSpec``: the whole context. This is the figure the engine's
    KV-cache manager admits against and holds.
    """
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if window is None:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                                 dtype=torch.bfloat16)
        return -(-context // spec.block_size)
    spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=torch.bfloat16, sliding_window=window)
    return spec.max_admission_blocks_per_request(max_in_flight_tokens=decode_tokens, max_model_len=context)


def _kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    # vLLM splits KV heads over TP and replicates them when tp > kv_heads.
    return max(1, kv_heads // tp)


def drafter_weights(draft: DSparkConfig, tp: int) -> dict[str, int]:
    """Parameter count and bytes of the drafter's own parameters, total and on one TP rank."""
    from vllm_dspark.checkpoint.shapes import drafter_tensors

    nbytes = DTYPE_BYTES[draft.dtype]
    kv_share = _kv_heads_per_rank(draft.num_key_value_heads, tp) / draft.num_key_value_heads
    total = per_rank = 0.0
    for name, spec in drafter_tensors(draft).items():
        if not spec.parameter:
            continue  # copies of the target's tensors, id maps and buffers
        n = math.prod(spec.shape)
        total += n
        if name.endswith(TP_SHARDED_SUFFIXES) or name in VOCAB_SHARDED:
            per_rank += n / tp
        elif name.endswith(KV_PROJ_SUFFIXES):
            per_rank += n * kv_share
        else:
            per_rank += n  # fc, markov_w1, norms, confidence head: replicated
    return {"parameters": int(total), "parameters_per_gpu": int(math.ceil(per_rank)),
            "bytes": int(total * nbytes), "bytes_per_gpu": int(math.ceil(per_rank * nbytes))}


def drafter_kv_bytes_per_token(draft: DSparkConfig, kv_bytes: int, tp: int) -> tuple[int, int]:
    """(bytes per context token over all draft layers, the same on one TP rank).

    GQA: layers x kv_heads x head_dim x (K and V) x bytes, KV heads split over
    TP (replicated when tp > kv_heads). MLA: one latent per token and layer,
    ``layers x (kv_lora_rank + qk_rope_head_dim) x bytes``, which every head
    reads, so every TP rank keeps all of it (K3DSparkModel: 5 x (512 + 64) x 2
    = 5,760 B, against 5 x 16 x 64 x 2 x 2 = 20,480 B for the K3 GQA drafter).
    """
    layers = draft.num_hidden_layers
    if draft.mla is not None:
        per_token = layers * (draft.mla.kv_lora_rank + draft.mla.qk_rope_head_dim) * kv_bytes
        return per_token, per_token
    per_token = layers * draft.num_key_value_heads * draft.head_dim * 2 * kv_bytes
    per_gpu = layers * _kv_heads_per_rank(draft.num_key_value_heads, tp) * draft.head_dim * 2 * kv_bytes
    return per_token, per_gpu


def _target_attention(tc: dict[str, Any], kv_bytes: int, tp: int, num_spec: int,
                      model_bytes: int) -> dict[str, Any]:
    """Per-layer cache figures of the target, by layer kind."""
    layers = int(tc["num_hidden_layers"])
    lin: Any = tc.get("linear_attn_config")
    mla_dim = None
    if tc.get("kv_lora_rank") is not None:
        mla_dim = int(tc["kv_lora_rank"]) + int(tc.get("qk_rope_head_dim") or 0)
    if isinstance(lin, dict) and lin.get("kda_layers"):
        kda_1based = set(int(i) for i in lin["kda_layers"])
        kinds = ["kda" if (i + 1) in kda_1based else ("mla" if mla_dim else "gqa") for i in range(layers)]
    else:
        kinds = ["mla" if mla_dim else "gqa"] * layers
    out: dict[str, Any] = {"kinds": kinds}
    if mla_dim:
        out["mla_values_per_token"] = mla_dim
        # One latent per token and layer, replicated on every TP rank (max_tp_shards=1).
        out["mla_bytes_per_token_per_layer"] = mla_dim * kv_bytes
    if "gqa" in kinds:
        heads = int(tc["num_attention_heads"])
        kvh = int(tc.get("num_key_value_heads") or heads)
        hd = int(tc.get("head_dim") or int(tc["hidden_size"]) // heads)
        out["gqa_bytes_per_token_per_layer"] = kvh * hd * 2 * kv_bytes
        out["gqa_bytes_per_token_per_layer_per_gpu"] = _kv_heads_per_rank(kvh, tp) * hd * 2 * kv_bytes
    if "kda" in kinds:
        h, d = int(lin["num_heads"]), int(lin["head_dim"])
        k = int(lin.get("short_conv_kernel_size", 4))
        if h % tp:
            raise ValueError(f"--tp {tp}: the target's {h} KDA heads do not split over {tp} GPUs; "
                             "vLLM needs linear_attn_config.num_heads % tp == 0")
        conv = (3 * h * d // tp) * (k - 1 + num_spec) * model_bytes  # q, k, v conv channels
        rec = (h // tp) * d * d * KDA_RECURRENT_BYTES
        out.update(kda_heads=h, kda_head_dim=d, kda_conv_kernel=k,
                   kda_conv_state_bytes_per_layer_per_gpu=conv,
                   kda_recurrent_state_bytes_per_layer_per_gpu=rec,
                   kda_state_bytes_per_layer_per_gpu=conv + rec)
    return out


def make_plan(draft: DSparkConfig, target: dict[str, Any], inp: PlanInputs) -> dict[str, Any]:
    """The plan as a JSON-ready dict (all sizes in bytes)."""
    if inp.kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"--kv-dtype: got {inp.kv_dtype!r}, expected one of {sorted(KV_DTYPE_BYTES)}")
    for name in ("context", "batch", "tp", "pp", "block_size", "max_num_batched_tokens"):
        if getattr(inp, name) <= 0:
            raise ValueError(f"--{name}: got {getattr(inp, name)}, expected a positive integer")
    if inp.num_speculative_tokens < 0:
        raise ValueError(f"--num-speculative-tokens: got {inp.num_speculative_tokens}, expected >= 0")
    kv_bytes = KV_DTYPE_BYTES[inp.kv_dtype]
    model_bytes = 2
    tc = text_config(target)
    t_layers = int(tc["num_hidden_layers"])
    if inp.pp > t_layers:
        raise ValueError(f"--pp {inp.pp}: the target has only {t_layers} layers")
    if draft.num_attention_heads % inp.tp:
        raise ValueError(f"--tp {inp.tp}: the drafter's {draft.num_attention_heads} attention heads do not "
                         f"split over {inp.tp} GPUs; vLLM needs num_attention_heads % tp == 0")

    # ---------------- drafter
    w = drafter_weights(draft, inp.tp)
    d_tok, d_tok_gpu = drafter_kv_bytes_per_token(draft, kv_bytes, inp.tp)
    if inp.window is not None and inp.window <= 0:
        raise ValueError(f"--window: got {inp.window}, expected a positive token count (or 'off')")
    win_tokens = min(inp.context, inp.window) if inp.window else inp.context
    decode_tokens = inp.num_speculative_tokens + 1
    blocks_decode = draft_kv_blocks_per_sequence(block_size=inp.block_size, window=inp.window,
                                                 decode_tokens=decode_tokens, context=inp.context)
    blocks_peak = draft_kv_blocks_per_sequence(block_size=inp.block_size, window=inp.window,
                                               decode_tokens=inp.max_num_batched_tokens, context=inp.context)
    drafter = {
        "parameters": w["parameters"],
        "weights_bytes": w["bytes"],
        "weights_bytes_per_gpu": w["bytes_per_gpu"],
        "kv_bytes_per_token": d_tok,
        "kv_bytes_per_token_per_gpu": d_tok_gpu,
        "kv_bytes_per_sequence": d_tok * inp.context,
        "kv_bytes_per_sequence_windowed": d_tok * win_tokens,
        "kv_bytes_per_gpu": d_tok_gpu * inp.context * inp.batch,
        "kv_bytes_per_gpu_windowed": d_tok_gpu * win_tokens * inp.batch,
        "window": inp.window,
        # What vLLM's KV-cache manager holds per sequence (its spec classes, block-rounded): in decode
        # steps, and at the prefill peak the admission check reserves for.
        "engine_blocks_per_sequence_decode": blocks_decode,
        "engine_blocks_per_sequence_peak": blocks_peak,
        "engine_kv_bytes_per_sequence_decode": blocks_decode * inp.block_size * d_tok,
        "engine_kv_bytes_per_sequence_peak": blocks_peak * inp.block_size * d_tok,
        "trained_context": draft.max_position_embeddings,
        "layers": draft.num_hidden_layers, "kv_heads": draft.num_key_value_heads,
        "head_dim": draft.head_dim,
        "architecture": draft.architecture, "backbone": draft.backbone,
        "mla_values_per_token_per_layer": (draft.mla.kv_lora_rank + draft.mla.qk_rope_head_dim
                                           if draft.mla is not None else None),
    }

    # ---------------- target caches, per pipeline stage
    att = _target_attention(tc, kv_bytes, inp.tp, inp.num_speculative_tokens, model_bytes)
    kinds = att.pop("kinds")
    stages = []
    for s, (a, b) in enumerate(pp_partition(t_layers, inp.pp)):
        ks = kinds[a:b]
        per_tok = (ks.count("mla") * att.get("mla_bytes_per_token_per_layer", 0)
                   + ks.count("gqa") * att.get("gqa_bytes_per_token_per_layer_per_gpu", 0))
        kda = ks.count("kda") * att.get("kda_state_bytes_per_layer_per_gpu", 0)
        last = s == inp.pp - 1
        row = {
            "stage": s, "target_layers": [a, b],
            "mla_layers": ks.count("mla"), "kda_layers": ks.count("kda"), "gqa_layers": ks.count("gqa"),
            "target_cache_bytes_per_token": per_tok,
            "target_cache_bytes": per_tok * inp.context * inp.batch,
            "target_kda_state_bytes": kda * inp.batch,
            "drafter_weights_bytes": w["bytes_per_gpu"] if last else 0,
            "drafter_kv_bytes": drafter["kv_bytes_per_gpu"] if last else 0,
            "drafter_kv_bytes_windowed": drafter["kv_bytes_per_gpu_windowed"] if last else 0,
        }
        base = row["target_cache_bytes"] + row["target_kda_state_bytes"] + row["drafter_weights_bytes"]
        row["total_bytes"] = base + row["drafter_kv_bytes"]
        row["total_bytes_windowed"] = base + row["drafter_kv_bytes_windowed"]
        stages.append(row)

    n_mla, n_kda, n_gqa = kinds.count("mla"), kinds.count("kda"), kinds.count("gqa")
    mla_tok = n_mla * att.get("mla_bytes_per_token_per_layer", 0)
    tgt = {
        "model": "Kimi K3" if is_kimi_k3(target) else (target.get("model_type") or "unknown"),
        "num_hidden_layers": t_layers, "mla_layers": n_mla, "kda_layers": n_kda, "gqa_layers": n_gqa,
        **att,
        "mla_bytes_per_token": mla_tok,
        "mla_bytes_per_sequence": mla_tok * inp.context,
        "kda_state_bytes_per_sequence": n_kda * att.get("kda_state_bytes_per_layer_per_gpu", 0) * inp.tp,
        "gqa_bytes_per_token": n_gqa * att.get("gqa_bytes_per_token_per_layer", 0),
    }
    tgt["gqa_bytes_per_sequence"] = tgt["gqa_bytes_per_token"] * inp.context
    compat = check_target_compat(draft, target)
    problems = list(compat.problems)
    if compat.needs_aux_attn_res_stream:
        # vLLM's K3 model refuses an aux layer that ends a non-final PP stage with the stream capture on.
        for r in stages[:-1]:
            if r["target_layers"][1] in draft.vllm_aux_layer_ids:
                problems.append(
                    f"--pp {inp.pp}: pipeline stage {r['stage']} ends at layer {r['target_layers'][1]}, which "
                    f"is one of the drafter's vLLM aux indices {list(draft.vllm_aux_layer_ids)}; vLLM's K3 "
                    "model refuses that with VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1. Move the boundary with "
                    "VLLM_PP_LAYER_PARTITION (comma-separated layers per stage)")
    return {
        "inputs": {"context": inp.context, "batch": inp.batch, "tp": inp.tp, "pp": inp.pp,
                   "kv_dtype": inp.kv_dtype, "kv_bytes_per_element": kv_bytes, "window": inp.window,
                   "block_size": inp.block_size, "max_num_batched_tokens": inp.max_num_batched_tokens,
                   "num_speculative_tokens": inp.num_speculative_tokens, "gpus": inp.tp * inp.pp},
        "drafter": drafter,
        "target": tgt,
        "per_gpu": stages,
        "max_per_gpu_bytes": max(r["total_bytes"] for r in stages),
        "max_per_gpu_bytes_windowed": max(r["total_bytes_windowed"] for r in stages),
        "compat": compat.to_dict(),
        "problems": problems,
        "explanation": _explain(draft, tgt, inp, win_tokens),
        "not_included": ["target weights (K3's MoE experts dominate)", "activations and CUDA graphs",
                         "NCCL / all-reduce buffers", "vLLM block rounding and page padding",
                         "extra state copies vLLM keeps for prefix caching of KDA layers"],
    }


def _explain(draft: DSparkConfig, t: dict[str, Any], inp: PlanInputs, win: int) -> list[str]:
    window = (f"With the {inp.window:,}-token window (vllm_dspark's default: the drafter's trained context, "
              f"{draft.max_position_embeddings:,}, whenever the target serves longer) it holds {win:,} tokens; "
              "vLLM's KV-cache manager frees the blocks behind the window (sliding-window cache group)."
              if inp.window else "The window is off: the drafter's cache grows with the context.")
    if draft.mla is not None:
        kv = (f"drafter KV ({draft.architecture}, MLA): {draft.num_hidden_layers} layers x one latent of "
              f"{draft.mla.kv_lora_rank} + {draft.mla.qk_rope_head_dim} values (kv_lora_rank + qk_rope_head_dim) "
              f"x {KV_DTYPE_BYTES[inp.kv_dtype]} bytes per context token. {window} Every TP rank keeps the "
              "whole latent.")
    else:
        kv = (f"drafter KV: {draft.num_hidden_layers} layers x {draft.num_key_value_heads} KV heads x "
              f"{draft.head_dim} x (K and V) x {KV_DTYPE_BYTES[inp.kv_dtype]} bytes per context token. {window} "
              f"KV heads split over TP ({_kv_heads_per_rank(draft.num_key_value_heads, inp.tp)} per GPU).")
    lines = [f"{kv} It lives on the last pipeline stage, where vLLM runs the proposer."]
    if t["mla_layers"]:
        lines.append(
            f"target MLA cache: each of the {t['mla_layers']} MLA (full-attention) layers stores one "
            f"compressed latent of {t['mla_values_per_token']} values per token (kv_lora_rank + "
            "qk_rope_head_dim) instead of per-head K and V. vLLM keeps the whole latent on every TP "
            "rank (num_kv_heads=1, max_tp_shards=1), so TP does not shrink it; pipeline stages split "
            "it by layer.")
    if t["kda_layers"]:
        lines.append(
            f"target KDA state: the {t['kda_layers']} KDA (linear-attention) layers keep a fixed state per "
            f"sequence whatever the context: a recurrent state of {t['kda_heads']} heads x "
            f"{t['kda_head_dim']} x {t['kda_head_dim']} fp32 and a short-convolution state of "
            f"3 x {t['kda_heads']} x {t['kda_head_dim']} channels x (kernel {t['kda_conv_kernel']} - 1 + "
            f"{inp.num_speculative_tokens} speculative tokens) columns in bf16; TP splits it by head.")
    if t["gqa_layers"]:
        lines.append(f"target KV cache: {t['gqa_layers']} full-attention layers with per-head K and V; "
                     "KV heads split over TP.")
    return lines


def _fmt(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:,.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:,.1f} MiB"
    return f"{n:,.0f} B"


def print_plan(p: dict[str, Any]) -> None:
    i, d, t = p["inputs"], p["drafter"], p["target"]
    print(f"DSpark deployment plan: context {i['context']:,} tokens, batch {i['batch']}, TP {i['tp']} x "
          f"PP {i['pp']} ({i['gpus']} GPUs), KV dtype {i['kv_dtype']}")
    print(f"target: {p['compat']['summary']}")
    print("drafter")
    print(f"  weights        {d['parameters']:,} parameters, {_fmt(d['weights_bytes'])} "
          f"({_fmt(d['weights_bytes_per_gpu'])} per GPU on the last stage)")
    print(f"  KV per token   {d['kv_bytes_per_token']:,} B ({d['kv_bytes_per_token_per_gpu']:,} B per GPU)")
    if d["window"]:
        print(f"  KV per seq     {_fmt(d['kv_bytes_per_sequence'])} without a window, "
              f"{_fmt(d['kv_bytes_per_sequence_windowed'])} with the {d['window']:,}-token window")
    else:
        print(f"  KV per seq     {_fmt(d['kv_bytes_per_sequence'])} (window off)")
    print(f"  vLLM holds     {d['engine_blocks_per_sequence_decode']:,} blocks of {i['block_size']} per layer and "
          f"sequence in decode steps ({_fmt(d['engine_kv_bytes_per_sequence_decode'])}), "
          f"{d['engine_blocks_per_sequence_peak']:,} at the prefill peak "
          f"({_fmt(d['engine_kv_bytes_per_sequence_peak'])}; {i['max_num_batched_tokens']:,}-token budget)")
    print("target")
    if t["mla_layers"]:
        print(f"  MLA cache      {t['mla_layers']} layers x {t['mla_bytes_per_token_per_layer']:,} B = "
              f"{t['mla_bytes_per_token']:,} B per token, {_fmt(t['mla_bytes_per_sequence'])} per sequence "
              "(same on every TP rank)")
    if t["kda_layers"]:
        print(f"  KDA state      {t['kda_layers']} layers, {_fmt(t['kda_state_bytes_per_sequence'])} per "
              "sequence in all (fixed, independent of context)")
    if t["gqa_layers"]:
        print(f"  KV cache       {t['gqa_layers']} layers, {t['gqa_bytes_per_token']:,} B per token, "
              f"{_fmt(t['gqa_bytes_per_sequence'])} per sequence")
    print("per GPU (whole batch)")
    print(f"  {'stage':>5} {'layers':>9} {'target cache':>13} {'KDA state':>11} {'draft w':>10} "
          f"{'draft KV':>11} {'total':>11} {'windowed':>11}")
    for r in p["per_gpu"]:
        print(f"  {r['stage']:>5} {r['target_layers'][0]:>4}-{r['target_layers'][1] - 1:<4} "
              f"{_fmt(r['target_cache_bytes']):>13} {_fmt(r['target_kda_state_bytes']):>11} "
              f"{_fmt(r['drafter_weights_bytes']):>10} {_fmt(r['drafter_kv_bytes']):>11} "
              f"{_fmt(r['total_bytes']):>11} {_fmt(r['total_bytes_windowed']):>11}")
    print("how these figures are made")
    for line in p["explanation"]:
        print(f"  - {line}")
    print(f"  - not included: {'; '.join(p['not_included'])}")
    if p["problems"]:
        print(f"PROBLEMS ({len(p['problems'])}):")
        for q in p["problems"]:
            print(f"  - {q}")


def _cmd_plan(args: argparse.Namespace) -> int:
    default_draft, default_target = bundled_k3_paths()
    try:
        draft = DSparkConfig.from_json(args.draft or default_draft)
        target = load_target_config(args.target or default_target)
    except (DSparkConfigError, TargetConfigError) as exc:
        print(f"vllm-dspark plan: {exc}", file=sys.stderr)
        return 2
    tc = text_config(target)
    context = args.context or int(tc.get("max_position_embeddings") or draft.max_position_embeddings)
    from vllm_dspark.serving.settings import DSparkSettingsError, resolve_settings

    try:  # the window the engine would use, resolved by the same code
        window = resolve_settings(draft, draft="plan", dflash_config=None,
                                  spec_options={"window": args.window} if args.window is not None else None,
                                  num_speculative_tokens=None, served_context=context, environ={}).window
    except DSparkSettingsError as exc:
        print(f"vllm-dspark plan: {exc}", file=sys.stderr)
        return 2
    inp = PlanInputs(context=context, batch=args.batch, tp=args.tp, pp=args.pp, kv_dtype=args.kv_dtype,
                     window=window, block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                     num_speculative_tokens=(args.num_speculative_tokens
                                             if args.num_speculative_tokens is not None
                                             else draft.num_draft_tokens))
    try:
        p = make_plan(draft, target, inp)
    except (ValueError, KeyError) as exc:
        msg = f"missing field {exc} in the target config" if isinstance(exc, KeyError) else str(exc)
        print(f"vllm-dspark plan: {msg}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(p, indent=2))
    else:
        print_plan(p)
    return 0 if not p["problems"] else 1


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``plan`` to the ``vllm-dspark`` sub-commands."""
    p = subparsers.add_parser(
        "plan", help="per-GPU memory for the drafter and the target's caches",
        description="Per-GPU memory a DSpark deployment needs for the drafter (weights, KV cache) and "
                    "the target's MLA cache and KDA state. Defaults: the bundled Kimi K3 drafter and "
                    "target fixtures (vllm_dspark/assets/k3).")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per sequence (default: the target's max_position_embeddings)")
    p.add_argument("--batch", type=int, default=1, help="concurrent sequences (default 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--kv-dtype", default="auto", choices=sorted(KV_DTYPE_BYTES),
                   help="KV cache dtype, as vLLM's --kv-cache-dtype (default auto = bf16)")
    p.add_argument("--window", default=None,
                   help="window on the drafter's attention in tokens, or 'off' (default: as served: the "
                        "drafter's trained context when the target serves longer)")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size (default 16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="the scheduler's token budget, for the prefill peak (default 8192)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft tokens per step (sizes the KDA convolution state; default: the drafter's)")
    p.add_argument("--draft", default=None,
                   help="drafter checkpoint directory or config.json (default: the bundled K3 drafter config)")
    p.add_argument("--target", default=None,
                   help="target config.json or model directory (default: the bundled K3 text-config fixture)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_plan)
    return p
