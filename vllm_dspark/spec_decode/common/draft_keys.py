"""Where upstream's draft modules read the DSpark keys: one copy for both runners.

SpecForge's export nests the DSpark keys in ``dflash_config``; vLLM's Qwen3
DSpark modules read them as top-level attributes of the draft's HF config.
"""

from __future__ import annotations

from vllm_dspark.ops.markov_reference import HEAD_TYPES

_DSPARK_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                "mask_token_id")


def expose_dspark_keys(hf_config, *, allow_no_markov: bool) -> None:
    """Copy the DSpark keys SpecForge nests in ``dflash_config`` to where upstream's modules read them.

    A drafter without a Markov head (rank 0, the DFlash-style ablation): on the
    V1 path (``allow_no_markov``) it is built with a rank-1 head that is never
    read (upstream always builds one) and :class:`MarkovWeights` carries zero
    weights; on vLLM 0.33's V2 path upstream's speculator would apply that head,
    so it is refused there.
    """
    dc = getattr(hf_config, "dflash_config", None) or {}
    for key in _DSPARK_KEYS:
        if key in dc and getattr(hf_config, key, None) is None:
            setattr(hf_config, key, dc[key])
    if not getattr(hf_config, "markov_rank", None):
        if not allow_no_markov:
            raise ValueError("vllm_dspark: this DSpark draft has markov_rank 0 (no Markov head); on vLLM 0.33 "
                             "serve it with method 'dflash'")
        hf_config.markov_rank = 1
        hf_config.dspark_no_markov_head = True


def check_v2_head(hf_config) -> None:
    """Refuse, on vLLM 0.33's V2 path, a Markov head this plugin can't serve there (after :func:`expose_dspark_keys`).

    Upstream's DSpark speculator and draft model know the vanilla head only: they neither load
    ``markov_head.gate_proj`` / ``joint_proj`` nor apply them. A gated or rnn head is served by the
    plugin's ``sample_sequential`` hook alone (the Markov draft op with the head's arguments, from
    the block's hidden rows), so wherever upstream would draft instead, it would draft with the
    wrong bias. Refused here, from the config: a head type other than vanilla, gated and rnn, and
    a gated or rnn head with ``dspark_draft_topk`` (top-k gathered drafting: upstream's speculator
    then never calls the hook). What only the loaded weights or the engine's config tell (no
    compiled kernel, quantized Markov weights, a watermarker ...) is refused by the V2 model at
    construction or load (``spec_decode/v2/model.py``), never left to upstream's loop.
    """
    head = getattr(hf_config, "markov_head_type", None) or "vanilla"
    if head not in HEAD_TYPES:
        raise ValueError(f"vllm_dspark: markov_head_type {head!r}: not a Markov head this plugin serves "
                         f"({', '.join(HEAD_TYPES)})")
    if head != "vanilla" and getattr(hf_config, "dspark_draft_topk", None) is not None:
        raise ValueError(f"vllm_dspark: markov_head_type {head!r} with dspark_draft_topk: vLLM 0.33's top-k "
                         "gathered drafting never calls the plugin's Markov stage, and upstream's applies a "
                         f"vanilla head, not a {head} one; unset dspark_draft_topk, or serve this drafter "
                         "with vLLM 0.32's V1 runner")
