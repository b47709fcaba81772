"""Patch of ``vllm.config.speculative``: serve ``method: "dspark"`` on the V1 runner.

vLLM 0.32 implements DSpark only in its V2 GPU model runner and refuses it on V1
(the CPU backend, and GPU users on V1). On V1 the DFlash proposer path already
does what DSpark's parallel backbone needs (aux hidden states, context-KV
precompute, non-causal block attention), so for a DSpark draft this patch:

1. validates the draft against the target and resolves every DSpark setting
   (``vllm_dspark.serving``): one message listing every problem, before
   anything is built. Drafts of every checkpoint family are taken: those the
   V1 path does not serve (other backbones) are refused there by name, with
   what serves them, instead of by vLLM's "V1 does not support"; a DeepSpec
   or speculators draft is presented to vLLM as a SpecForge export
   (:func:`present_as_specforge_export`: its HF config, never its files);
2. lets vLLM resolve the draft as a DFlash draft whose block is the drafter's
   full block (``num_speculative_tokens`` = block: lookahead slots and
   per-position metrics are sized for it; the proposer verifies fewer);
3. attaches the resolved :class:`~vllm_dspark.serving.settings.DSparkSettings`
   to the draft's HF config as ONE attribute, which the proposer and the model
   read back;
4. applies what must be decided before the draft model is built: the draft
   attention window (vLLM's DFlash sliding-window keys ``use_swa`` /
   ``swa_window_size``, which make vLLM's KV-cache manager keep only the
   window's blocks for the draft layers), sampled drafts at temperature > 0
   (``draft_sample_method``), and the draft's ``max_model_len`` raised to the
   target's (vLLM otherwise stops drafting for the WHOLE batch once any request
   passes the drafter's trained context; the model class computes exact rotary
   angles at any position).

``worker_gpu_model_runner`` then swaps in the DSpark proposer and the model
registry supplies the DSpark draft model (``DFlashDSparkDraftModel``).
"""

from __future__ import annotations

import logging

from vllm_dspark.config import DSparkConfig
from vllm_dspark.patch import handoff
from vllm_dspark.patch.registry import Patch, register_patch
from vllm_dspark.serving.settings import attach
from vllm_dspark.serving.validate import read_dspark_draft, validate_draft_for_serving

logger = logging.getLogger("vllm_dspark")


def _uses_v1_runner() -> bool:
    import vllm.envs as envs
    from vllm.platforms import current_platform

    if envs.VLLM_USE_V2_MODEL_RUNNER is False:
        return True
    return bool(current_platform.is_cpu())


def _make_post_init(original):
    def __post_init__(self):
        draft = read_dspark_draft(self.model) if self.method == "dspark" else None
        if draft is None or not _uses_v1_runner():
            return original(self)
        target = self.target_model_config
        target_hf = getattr(target, "hf_config", None)
        served = int(getattr(target, "max_model_len", 0) or 0) or int(draft.raw.get("max_position_embeddings", 0))
        cfg, settings = validate_draft_for_serving(
            draft, target_hf, num_speculative_tokens=self.num_speculative_tokens, served_context=served,
            spec_options=handoff.current())
        self.method = "dflash"
        self.num_speculative_tokens = cfg.num_draft_tokens
        if settings.draft_sampling == "auto":
            # The runner keeps per-request draft probabilities only in this mode; greedy requests
            # still draft greedily (the proposer decides per request).
            self.draft_sample_method = "probabilistic"
        original(self)
        if cfg.family != "specforge":
            present_as_specforge_export(self, cfg)
        hf = self.draft_model_config.hf_config
        dc = dict(getattr(hf, "dflash_config", None) or {})
        if settings.window:
            dc["use_swa"], dc["swa_window_size"] = True, int(settings.window)
        else:
            dc["use_swa"] = False
            dc.pop("swa_window_size", None)
        hf.dflash_config = dc
        attach(hf, settings)
        if served and self.draft_model_config.max_model_len < served:
            self.draft_model_config.max_model_len = served
        logger.info("vllm_dspark: serving DSpark draft %s on the V1 runner: %s", self.model, settings.describe())
        note = settings.context_note()
        if note:
            logger.info("vllm_dspark: %s", note)
    return __post_init__


def specforge_hf_config(cfg: DSparkConfig):
    """The draft's HF config as vLLM builds it for a SpecForge export of the same drafter.

    A Qwen3 config of ``cfg.to_hf_dict()`` (the DSpark keys in ``dflash_config``, the layer ids as
    layer outputs, the layout in ``sample_from_anchor``, ``draft_vocab_size`` at the top level) in
    vLLM's DFlash wrapper, whose architecture is then ``DFlashDSparkDraftModel``: this plugin's V1
    model. Everything downstream (the runner's aux layer ids, the DFlash proposer's mask id, the
    model) reads one shape whatever the family's config.json looked like.
    """
    from transformers import Qwen3Config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    return EAGLEConfig(Qwen3Config(**cfg.to_hf_dict()), method="dflash")


def present_as_specforge_export(spec, cfg: DSparkConfig) -> None:
    """Give vLLM a DeepSpec or speculators draft in the shape of a SpecForge export, files untouched.

    vLLM read the draft's config.json its own way: DeepSpec's flat keys land where no DFlash reader
    looks (the runner would tap default layers), and a speculators config becomes vLLM's
    ``SpeculatorsConfig`` routed to upstream's Qwen3 DSpark model. The draft's validated
    :class:`DSparkConfig` already holds every key as this plugin reads it per family (speculators'
    aux ids minus 1, each family's layout default), so its SpecForge form replaces the HF config
    here, before any model or worker reads it; the weights are still read from the draft's own
    directory, and ``DSparkV1DraftModel.load_weights`` takes every family's tensor names.
    """
    before = type(spec.draft_model_config.hf_config).__name__
    spec.draft_model_config.hf_config = specforge_hf_config(cfg)
    spec.update_arch_()
    vocab = f"a draft vocabulary of {cfg.draft_vocab_size}" if cfg.draft_vocab_size else "the full vocabulary"
    logger.info("vllm_dspark: %s draft %s (%s, %d drafts, %s) presented to vLLM as a SpecForge export: vLLM's "
                "%s replaced, the files untouched", cfg.family, cfg.architecture, cfg.query_layout,
                cfg.num_draft_tokens, vocab, before)


PATCH = register_patch(Patch(
    name="speculative-config-dspark-v1",
    module="vllm.config.speculative",
    attribute="SpeculativeConfig.__post_init__",
    what="method 'dspark' with a DSpark draft of any served family resolves as a DFlash-path draft (DeepSpec "
         "and speculators configs presented as a SpecForge export) carrying one DSparkSettings object, after "
         "validating the draft against the target; window, sampled drafts and the draft's max_model_len are "
         "set before the draft model is built",
    why="vLLM 0.32 refuses 'dspark' on the V1 model runner (its only DSpark path is the V2 GPU runner)",
    versions=("0.32",),
    removable_when="vLLM's V1 runner accepts method 'dspark', or the CPU backend runs the V2 runner",
    make=_make_post_init,
))
