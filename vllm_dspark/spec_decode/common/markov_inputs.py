"""The Markov stage's inputs, assembled the same way for the V1 proposer and the V2 hook."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_dspark.model.markov_weights import MarkovWeights


def markov_stage_inputs(weights: MarkovWeights, hidden: torch.Tensor,
                        compute_logits: Callable[[torch.Tensor], torch.Tensor], num_rows: int, n: int,
                        *, with_confidence: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From the backbone's sampled rows ``hidden`` [num_rows * n, H]: the base logits [num_rows, n, V]
    (the LM head's, trimmed to the Markov head's vocabulary: vLLM may pad its LM head) and, when asked,
    the confidence head's hidden-state term [num_rows, n] fp32."""
    base = compute_logits(hidden)  # [R * N, V']
    vocab = weights.vocab
    if base.shape[-1] < vocab:
        raise RuntimeError(f"vllm_dspark: draft logits have {base.shape[-1]} columns but the Markov head "
                           f"has {vocab} rows")
    base = base[:, :vocab].reshape(num_rows, n, vocab)
    if not with_confidence:
        return base, None
    conf = weights.confidence_base(hidden)
    if conf is None:
        raise RuntimeError("vllm_dspark: confidences were asked for, but the draft has no confidence head")
    return base, conf.view(num_rows, n)
