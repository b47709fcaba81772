"""Where upstream's draft modules read the DSpark keys: one copy for both runners.

SpecForge's export nests the DSpark keys in ``dflash_config``; vLLM's Qwen3
DSpark modules read them as top-level attributes of the draft's HF config.
"""

from __future__ import annotations

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
    """Refuse a gated or rnn Markov head on vLLM 0.33's V2 path (after :func:`expose_dspark_keys`).

    Upstream's DSpark speculator builds and applies a vanilla head whatever
    ``markov_head_type`` says, and the one-op path this plugin puts in its
    sequential stage (``MarkovStage.draft_into``) has no hidden rows to hand
    the op a gated or rnn head: such a drafter would load and draft with the
    wrong bias. The V1 runner serves these heads.
    """
    head = getattr(hf_config, "markov_head_type", None) or "vanilla"
    if head != "vanilla":
        raise ValueError(f"vllm_dspark: markov_head_type {head!r}: a {head} Markov head is not served on vLLM "
                         "0.33's V2 path (upstream's DSpark speculator and the Markov op apply vanilla heads "
                         "only); serve this drafter with vLLM 0.32's V1 runner, which drafts gated and rnn "
                         "heads")
