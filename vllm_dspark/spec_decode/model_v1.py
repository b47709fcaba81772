"""The DSpark draft model for vLLM's V1 runner (registered as ``DFlashDSparkDraftModel``).

On V1, a DSpark draft takes the DFlash path, where vLLM names the draft
architecture ``"DFlash" + <architecture>``; the plugin registers this class
under that name. It is upstream's Qwen3 DSpark draft (DFlash Qwen3 backbone
with Markov and confidence heads) plus what the V1 proposer needs:

* the DSpark keys SpecForge keeps in ``dflash_config`` are exposed where the
  upstream modules read them;
* older exports' ``logit_head.`` tensor names load;
* the confidence projection is split into its parallel part (hidden state and
  bias) and its Markov part, which the Markov draft op applies per drafted token;
* Markov weights trimmed to the real vocabulary (vLLM pads LM-head-like weights).
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Iterable

import torch
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

from vllm_dspark.checkpoint.io import canonical_name

logger = logging.getLogger("vllm_dspark")


@functools.lru_cache(maxsize=1)
def _grouped_rms_norm_broken() -> str | None:
    """Why vLLM's grouped RMSNorm (one weight row per draft layer) can't be used here, or None.

    The DFlash context-KV precompute normalises the keys of all draft layers in
    one ``ops.rms_norm`` call with a [layers, head_dim] weight. vLLM 0.32's CPU
    kernel applies the first row to every layer, so every draft layer after the
    first would read keys normalised with layer 0's weight: no error, lower
    acceptance. A two-layer probe decides.
    """
    from vllm import _custom_ops as ops

    x = torch.linspace(-1.0, 1.0, 2 * 64).view(2, 1, 1, 64)
    w = torch.stack([torch.ones(64), torch.full((64,), 2.0)])
    out = torch.empty_like(x)
    try:
        ops.rms_norm(out, x, w, 1e-6)
    except Exception as exc:  # pragma: no cover - depends on the platform's kernels
        return f"vllm ops.rms_norm rejects a per-layer weight ({exc})"
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[:, None, None, :]
    if not torch.allclose(out, want, atol=1e-4):
        return "vLLM's rms_norm on this platform ignores the per-layer weight rows of the draft's key norms"
    return None


def _normalize_context_k_per_layer(self, all_k: torch.Tensor) -> torch.Tensor:
    """Per-layer RMSNorm of context keys [L, num_ctx, kv_heads, head_dim] with weights [L, head_dim]."""
    xf = all_k.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self._rms_norm_eps)
    return (xf * self._k_norm_weights.float()[:, None, None, :]).to(all_k.dtype)

_DSPARK_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                "mask_token_id")


def expose_dspark_keys(hf_config) -> None:
    """Copy the DSpark keys from ``dflash_config`` to the attributes upstream modules read.

    Refuses a draft without a Markov head: it is a plain DFlash draft.
    """
    dc = getattr(hf_config, "dflash_config", None) or {}
    for key in _DSPARK_KEYS:
        if key in dc and getattr(hf_config, key, None) is None:
            setattr(hf_config, key, dc[key])
    if not getattr(hf_config, "markov_rank", None):
        raise ValueError("vllm_dspark: this DSpark draft has markov_rank 0 (no Markov head); serve it "
                         "with method 'dflash' instead")


class DSparkV1DraftModel(Qwen3DSparkForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        hf_config = vllm_config.speculative_config.draft_model_config.hf_config
        expose_dspark_keys(hf_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self._w2_norms: torch.Tensor | None = None
        reason = _grouped_rms_norm_broken()
        if reason is not None:
            logger.warning("vllm_dspark: %s; normalising the context keys of each draft layer in PyTorch", reason)
            self.model._normalize_context_k = types.MethodType(_normalize_context_k_per_layer, self.model)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        loaded = super().load_weights((canonical_name(name), w) for name, w in weights)
        # Keep the raw tensors the Markov op reads: after loading, vLLM's CPU
        # backend may repack linear weights and leave the modules' .weight empty.
        head = self.model.markov_head
        self.markov_w1 = head.markov_w1.weight.data[: self.vocab_size]  # [V, r]
        self.markov_w2 = head.markov_w2.weight.data[: self.vocab_size]  # [V, r]
        conf = self.model.confidence_head
        if conf is not None:
            self._conf_w = conf.proj.weight.data.float()[0].clone()  # [H (+ r)]
            self._conf_b = float(conf.proj.bias.data.float()[0]) if conf.proj.bias is not None else 0.0
        self._w2_norms = None
        return loaded

    def markov_w2_row_norms(self) -> torch.Tensor:
        """||w2_j|| per token (fp32), computed once after the weights are loaded."""
        if self._w2_norms is None or self._w2_norms.device != self.markov_w2.device:
            from vllm_dspark.ops import markov_row_norms

            self._w2_norms = markov_row_norms(self.markov_w2)
        return self._w2_norms

    def markov_w2_zeros(self) -> torch.Tensor:
        if getattr(self, "_w2_zeros", None) is None:
            self._w2_zeros = torch.zeros_like(self.markov_w2)
        return self._w2_zeros

    def confidence_parts(self, hidden: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(hidden part + bias [..] fp32, Markov weight [r] fp32), or (None, None) without a head."""
        head = self.model.confidence_head
        if head is None:
            return None, None
        w = self._conf_w.to(hidden.device)
        h = hidden.shape[-1]
        base = hidden.float() @ w[:h] + self._conf_b
        return base, (w[h:].contiguous() if head.with_markov else None)
