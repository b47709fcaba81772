"""The DSpark drafter in plain PyTorch: the golden reference for every other path.

No vLLM imports. Parameter names equal the checkpoint's tensor names, so a
SpecForge export loads with ``load_state_dict`` as is. The drafter has no input
embedding and no LM head of its own: callers pass the target's.

One draft step, anchor-first (FACTS.md):

* context: the target's hidden states at ``target_layer_ids`` for tokens
  ``0..p-1``, concatenated per token -> ``fc`` -> ``hidden_norm``; each layer
  projects them with its own ``k_proj``/``v_proj``, ``k_norm`` and RoPE at the
  context positions;
* queries: ``[anchor, mask x (B-1)]`` at positions ``p..p+B-1``, attending to
  the whole context and, non-causally, to the whole block;
* base logits: target LM head on the final-normed hidden states; query ``i``
  predicts token ``p + i + 1``;
* the Markov stage and the confidence head run left to right from the anchor
  (``vllm_dspark.ops.markov_reference`` holds that loop); a gated or rnn head's
  bias reads each position's final-normed hidden row (:meth:`MarkovHead.block_bias`),
  the confidence head reads ``markov_w1[prev]`` for every head type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dspark.config import DSparkConfig
from vllm_dspark.model.markov_weights import MarkovWeights
from vllm_dspark.model.rope import apply_rope, rope_inv_freq_and_scale


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def context_kv(self, ctx: torch.Tensor, ctx_pos: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the context states ``ctx`` [N, C, H] -> [N, C, kv_heads, hd] each."""
        n, c, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(n, c, self.num_kv_heads, self.head_dim))
        v = self.v_proj(ctx).view(n, c, self.num_kv_heads, self.head_dim)
        return apply_rope(k, ctx_pos, *rope), v

    def forward(self, x: torch.Tensor, q_pos: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor | None, rope) -> torch.Tensor:
        n, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, q_len, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(n, q_len, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, q_len, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, q_pos, *rope)
        k = apply_rope(k, q_pos, *rope)
        k = torch.cat([ctx_k, k], dim=1)  # [N, C + Q, kvh, hd]
        v = torch.cat([ctx_v, v], dim=1)
        rep = self.num_heads // self.num_kv_heads
        q = q.transpose(1, 2)  # [N, heads, Q, hd]
        k = k.transpose(1, 2).repeat_interleave(rep, dim=1)
        v = v.transpose(1, 2).repeat_interleave(rep, dim=1)
        attn_mask = None if mask is None else mask.unsqueeze(1)  # [N, 1, Q, C + Q]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, self.num_heads * self.head_dim))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)


class MarkovHead(nn.Module):
    """W1 (previous token -> [r]) and W2 ([r] -> vocabulary bias), plus the gated head's
    ``gate_proj`` ([h ; e] -> r) or the rnn head's ``joint_proj`` ([s ; e ; h] -> 3r)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        r, h = cfg.markov_rank, cfg.hidden_size
        self.head_type = cfg.markov_head_type
        self.markov_w1 = nn.Embedding(cfg.vocab_size, r)  # [V, r]
        self.markov_w2 = nn.Linear(r, cfg.vocab_size, bias=False)  # weight [V, r]
        if self.head_type == "gated":
            self.gate_proj = nn.Linear(h + r, r)  # weight [r, H + r]
        elif self.head_type == "rnn":
            self.joint_proj = nn.Linear(2 * r + h, 3 * r)  # weight [3r, 2r + H]

    def block_bias(self, hidden: torch.Tensor) -> Callable[[int, torch.Tensor], torch.Tensor] | None:
        """A gated or rnn head's bias for one block per row, ``(k, e_k [R, r]) -> [R, V]`` fp32, called for
        k = 0, 1, ... in order (the rnn state starts at zero here); ``hidden`` [R, N, H] final-normed
        rows. None for the vanilla head (``markov_draft_reference`` computes ``W2 e`` itself).

        Written out in fp64 from the modules, one position at a time (the serving heads precompute
        the hidden part; ``spec_decode/common/heads.py``)."""
        if self.head_type == "vanilla":
            return None
        w2 = self.markov_w2.weight.double()  # [V, r]

        def lin(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            return x @ m.weight.double().t() + m.bias.double()

        if self.head_type == "gated":
            def gated(k: int, e: torch.Tensor) -> torch.Tensor:
                g = torch.sigmoid(lin(self.gate_proj, torch.cat([hidden[:, k].double(), e.double()], dim=-1)))
                return ((g * e.double()) @ w2.t()).float()
            return gated

        r = w2.shape[1]
        s = [torch.zeros(hidden.shape[0], r, dtype=torch.float64, device=hidden.device)]

        def rnn(k: int, e: torch.Tensor) -> torch.Tensor:
            z = lin(self.joint_proj, torch.cat([s[0], e.double(), hidden[:, k].double()], dim=-1))
            a, c, o = z[:, :r], z[:, r:2 * r], z[:, 2 * r:]
            s[0] = torch.sigmoid(a) * s[0] + (1 - torch.sigmoid(a)) * torch.tanh(c)
            return (torch.tanh(o) @ w2.t()).float()
        return rnn


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        extra = cfg.markov_rank if cfg.confidence_head_with_markov else 0
        self.proj = nn.Linear(cfg.hidden_size + extra, 1)


@dataclass
class DraftOutput:
    tokens: torch.Tensor  # [N, D] int64 draft tokens
    confidence: torch.Tensor  # [N, D] fp32 per-position acceptance estimate
    lengths: torch.Tensor  # [N] int32 kept prefix after the confidence-gated early stop
    base_logits: torch.Tensor  # [N, D, V] fp32, before the Markov bias
    hidden: torch.Tensor  # [N, D, H] final-normed hidden states of the sampled rows


class DSparkDraftModel(nn.Module):
    """DFlash-style parallel backbone + Markov bias head + confidence head."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.config = cfg = config
        self.fc = nn.Linear(cfg.aux_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg) if cfg.has_markov_head else None
        self.confidence_head = ConfidenceHead(cfg) if cfg.enable_confidence_head else None
        inv_freq, mscale = rope_inv_freq_and_scale(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        self.rope_mscale = mscale

    # ---------------------------------------------------------------- backbone
    def context_states(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[N, C, n_aux * H_target] concatenated aux hidden states -> [N, C, H]."""
        return self.hidden_norm(self.fc(aux_hidden))

    def backbone(self, aux_hidden: torch.Tensor, ctx_positions: torch.Tensor, query_embeds: torch.Tensor,
                 query_positions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the draft layers for a query block over a context.

        Parameters
        ----------
        aux_hidden : [N, C, n_aux * H_target] target hidden states of the context tokens.
        ctx_positions : [N, C] int64 positions of the context tokens.
        query_embeds : [N, Q, H] input embeddings of the query tokens (target embedding).
        query_positions : [N, Q] int64 positions of the query tokens.
        mask : [N, Q, C + Q] bool, True where a query may attend (context columns
            first, then query columns); None lets every query see everything.

        Returns
        -------
        [N, Q, H] final-normed hidden states.
        """
        rope = (self.rope_inv_freq, self.rope_mscale)
        ctx = self.context_states(aux_hidden)
        x = query_embeds
        for mod in self.layers:
            layer = cast(DraftLayer, mod)
            ctx_k, ctx_v = layer.self_attn.context_kv(ctx, ctx_positions, rope)
            x = x + layer.self_attn(layer.input_layernorm(x), query_positions, ctx_k, ctx_v, mask, rope)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    @staticmethod
    def block_mask(ctx_lengths: torch.Tensor, num_ctx: int, block: int, window: int | None = None) -> torch.Tensor:
        """[N, B, C + B] mask: each block sees its context tokens and the whole block.

        ``window`` (the serving path's draft attention window, vLLM's sliding-window
        rule): query ``i`` at position ``p + i`` sees context positions ``k`` with
        ``p + i - k < window``.
        """
        dev = ctx_lengths.device
        cols = torch.arange(num_ctx, device=dev)[None, None, :]  # [1, 1, C]
        p = ctx_lengths[:, None, None]  # [N, 1, 1]
        ctx_ok = (cols < p).expand(-1, block, -1)  # [N, B, C]
        if window is not None:
            q = p + torch.arange(block, device=dev)[None, :, None]  # [N, B, 1]
            ctx_ok = ctx_ok & (q - cols < window)
        blk = torch.ones(ctx_lengths.shape[0], block, block, dtype=torch.bool, device=dev)
        return torch.cat([ctx_ok, blk], dim=-1)

    # ---------------------------------------------------------------- heads
    def markov_embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """[...] previous-token ids -> [..., r] Markov embeddings."""
        assert self.markov_head is not None
        return self.markov_head.markov_w1(prev_ids)

    def teacher_forced_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor,
                              lm_head_weight: torch.Tensor, use_markov: bool = True) -> torch.Tensor:
        """Corrected logits [..., V] (fp32) given the true previous tokens (training, checks)."""
        logits = hidden.float() @ lm_head_weight.float().t()
        if use_markov and self.markov_head is not None:
            if self.markov_head.head_type != "vanilla":
                raise NotImplementedError(f"teacher-forced logits of a {self.markov_head.head_type} head: draft() "
                                          "computes that head; training here covers vanilla heads")
            e = self.markov_embed(prev_ids).float()
            logits = logits + e @ self.markov_head.markov_w2.weight.float().t()
        return logits

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid confidence [...] of each position given its previous token."""
        assert self.confidence_head is not None
        x = hidden.float()
        if self.config.confidence_head_with_markov:
            x = torch.cat([x, self.markov_embed(prev_ids).float()], dim=-1)
        w, b = self.confidence_head.proj.weight.float(), self.confidence_head.proj.bias.float()
        return (x @ w.t() + b).squeeze(-1)

    def markov_weights(self) -> MarkovWeights:
        """The sequential stage's weights in the op's form (shared with the vLLM model classes)."""
        cfg = self.config
        head, conf = self.markov_head, self.confidence_head
        gate = joint = None
        if head is not None:
            gate, joint = getattr(head, "gate_proj", None), getattr(head, "joint_proj", None)
        return MarkovWeights.build(
            vocab=cfg.vocab_size,
            markov_w1=head.markov_w1.weight if head is not None else None,
            markov_w2=head.markov_w2.weight if head is not None else None,
            conf_weight=conf.proj.weight if conf is not None else None,
            conf_bias=conf.proj.bias if conf is not None else None,
            hidden_size=cfg.hidden_size, conf_with_markov=cfg.confidence_head_with_markov,
            device=self.fc.weight.device,
            markov_head_type=head.head_type if head is not None else None,
            gate_weight=None if gate is None else gate.weight, gate_bias=None if gate is None else gate.bias,
            joint_weight=None if joint is None else joint.weight, joint_bias=None if joint is None else joint.bias)

    # ---------------------------------------------------------------- drafting
    @torch.no_grad()
    def draft(self, aux_hidden: torch.Tensor, ctx_lengths: torch.Tensor, anchor_ids: torch.Tensor,
              embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, *,
              temperature: torch.Tensor | float = 0.0, seeds: torch.Tensor | None = None,
              threshold: float = 0.0, use_markov: bool = True, window: int | None = None) -> DraftOutput:
        """Draft one block per request.

        Parameters
        ----------
        aux_hidden : [N, C, n_aux * H_target] context features (rows past ctx_lengths[n] are ignored).
        ctx_lengths : [N] number of context tokens p; the anchor sits at position p.
        anchor_ids : [N] the last accepted token of each request.
        embed_weight : [V, H] the target's input embedding.
        lm_head_weight : [V, H] the target's LM head.
        temperature : float or [N]; <= 0 drafts greedily.
        seeds : [N] int64 seeds of the Gumbel draws (sampled drafting only).
        threshold : confidence early stop: keep drafts before the first position whose
            confidence is below it (0 keeps all).
        use_markov : False drafts without the Markov bias (the DFlash-style ablation).
        window : draft attention window (context tokens older than it are not seen).
        """
        from vllm_dspark.ops.markov_reference import markov_draft_reference

        cfg = self.config
        n, c, _ = aux_hidden.shape
        b = cfg.block_size
        device = aux_hidden.device
        q_ids = torch.full((n, b), cfg.mask_token_id, dtype=torch.long, device=device)
        q_ids[:, 0] = anchor_ids
        q_pos = ctx_lengths[:, None].long() + torch.arange(b, device=device)[None, :]
        ctx_pos = torch.arange(c, device=device)[None, :].expand(n, -1)
        hidden = self.backbone(aux_hidden, ctx_pos, embed_weight[q_ids].to(aux_hidden.dtype), q_pos,
                               self.block_mask(ctx_lengths, c, b, window))
        if cfg.query_layout == "one_plus_n":
            hidden = hidden[:, 1:]  # the masks sit at the predicted positions
        base = hidden.float() @ lm_head_weight.float().t()  # [N, D, V]
        if isinstance(temperature, (int, float)):
            temperature = torch.full((n,), float(temperature), device=device)
        if seeds is None:
            seeds = torch.zeros(n, dtype=torch.long, device=device)
        mw = self.markov_weights()
        head_bias = None
        if not use_markov:
            mw = mw.without_bias()
        elif self.markov_head is not None:
            head_bias = self.markov_head.block_bias(hidden)  # gated / rnn; None: vanilla
        tokens, conf = markov_draft_reference(
            base, anchor_ids, mw.markov_w1, mw.markov_w2, mw.confidence_base(hidden), mw.conf_w_markov,
            temperature, seeds, head_bias=head_bias)
        lengths = confident_prefix_length(conf, threshold)
        return DraftOutput(tokens=tokens, confidence=conf, lengths=lengths, base_logits=base, hidden=hidden)


def confident_prefix_length(conf: torch.Tensor, threshold: float) -> torch.Tensor:
    """DSpark's draft length (DeepSpec ``_confident_prefix_length``), [R, B] fp32 -> [R] int32.

    The positions before the FIRST one whose own confidence is below ``threshold``
    (fp32 confidences compared in fp64; NaN compares false and never stops a draft);
    ``threshold <= 0`` keeps the block. [.95, .9, .9, .85, .8, .8, .7] at 0.8 gives 6.
    Serving applies the same rule in ``spec_decode/common/verify.py``; this copy is the
    golden reference's own, so the tests check one against the other.
    """
    below = conf.to(torch.float64) < threshold  # [R, B]
    alive = torch.cumprod((~below).to(torch.int32), dim=1)
    return alive.sum(dim=1).to(torch.int32)


def count_parameters(config: DSparkConfig) -> int:
    """Parameter count of the drafter, from instantiating it on the meta device."""
    with torch.device("meta"):
        model = DSparkDraftModel(config)
    return sum(p.numel() for p in model.parameters())


def expected_tensor_shapes(config: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, from instantiating the drafter on the meta device."""
    with torch.device("meta"):
        model = DSparkDraftModel(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}
