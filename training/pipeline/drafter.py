"""The DSpark drafter's shape and starting weights, from the target it drafts for.

``build_drafter_config`` sizes a drafter for a target (its hidden size, heads,
vocabulary and the layers whose states it reads); ``init_drafter`` draws its
starting weights; ``init_from_target`` can start it from the target's own last
layers. Training is :mod:`training.pipeline.trainer` (the one trainer: the
default pair's pipeline and the toy fixtures' both use it).
"""

from __future__ import annotations

from typing import cast

import torch

from vllm_dspark.config import DSparkConfig
from vllm_dspark.model.reference import DraftLayer, DSparkDraftModel


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
