"""Does a DSpark drafter fit a target model? Checked before serving.

The drafter shares the target's embedding and LM head and reads the target's
hidden states at ``dflash_config.target_layer_ids``, so a drafter that does not
fit its target either fails to load or, worse, loads and proposes garbage that
the target rejects (acceptance collapses without any error). This module checks
the facts that decide it, from the target's ``config.json`` alone:

* hidden size: the drafter's ``hidden_size`` (shared embedding / LM head) and
  the per-layer width its ``fc`` reads (``target_hidden_size``, default
  ``hidden_size``) must both equal the target's ``hidden_size``;
* vocabulary: equal sizes, and ``mask_token_id`` inside the target's vocabulary;
* target layers: DSpark's ``target_layer_ids`` mean "the OUTPUT of layer i"
  (0-based). vLLM's aux-hidden-state index ``j`` is the stream ENTERING decoder
  layer ``j``, so vLLM reads id ``i`` as aux index ``i + 1``, and an aux index
  can be at most ``num_hidden_layers`` (the output of the last layer, before the
  final norm). So every id must satisfy ``i + 1 <= num_hidden_layers``;
* the number of layers of the target the drafter was trained on
  (``num_target_layers``) must equal the target's ``num_hidden_layers``;
* Kimi K3 targets use attention residuals. A GQA drafter trained on SpecForge's
  K3 capture consumes the materialised residual stream, which vLLM captures
  only with ``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1`` (default off: vLLM then hands
  the drafter the block prefix sum, a different feature, and nothing fails).
  :func:`ensure_k3_aux_attn_res_stream` turns it on before any worker starts,
  or refuses when the user explicitly turned it off.

Kimi K3 is recognised the way vLLM 0.32/0.33 names it (see
``vllm/transformers_utils/configs/kimi_k3.py`` and the model registry):
``model_type == "kimi_k3"`` / architecture ``KimiK3ForConditionalGeneration``
(text fields nested in ``text_config``, a ``kimi_linear`` config), or a
``kimi_linear`` text config with ``attn_res_block_size`` set (attention
residuals on; ``KimiLinearForCausalLM`` is served by the same vLLM K3 module).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dspark.config import DSparkConfig

AUX_STREAM_ENV = "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"
K3_MODEL_TYPES = ("kimi_k3",)
K3_ARCHITECTURES = ("KimiK3ForConditionalGeneration", "KimiK3MTPModel")
KIMI_LINEAR_ARCHITECTURES = ("KimiLinearForCausalLM",)
AUX_CONVENTION = ("vLLM's aux index is the stream ENTERING a decoder layer, DSpark's "
                  "target_layer_ids mean a layer's OUTPUT, so vLLM reads id i as aux index i + 1")


class TargetConfigError(ValueError):
    """The target's config.json could not be read."""


class K3CaptureError(RuntimeError):
    """A Kimi K3 target needs the residual-stream capture and it is switched off."""


# --------------------------------------------------------------------- target config
def load_target_config(target: str | Path | Mapping[str, Any] | Any) -> dict[str, Any]:
    """The target's ``config.json`` as a dict.

    ``target`` is a model directory, a ``config.json`` path, a dict, or a
    transformers ``PretrainedConfig`` (anything with ``to_dict()``).
    """
    if isinstance(target, Mapping):
        return dict(target)
    if hasattr(target, "to_dict") and not isinstance(target, (str, Path)):
        return dict(target.to_dict())
    path = Path(target)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise TargetConfigError(
            f"target config: not found at {path}; pass the target model's directory or its "
            "config.json (a Hugging Face repo id is not fetched: download config.json first)")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TargetConfigError(f"target config {path}: not valid JSON ({exc})") from None
    if not isinstance(d, dict):
        raise TargetConfigError(f"target config {path}: expected a JSON object, got {type(d).__name__}")
    return d


def text_config(target: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder's fields: ``text_config`` for multimodal wrappers (K3), else the top level."""
    tc: Any = target.get("text_config")
    if isinstance(tc, Mapping) and "hidden_size" in tc:
        return dict(tc)
    if hasattr(tc, "to_dict"):
        return dict(tc.to_dict())
    return dict(target)


def is_kimi_k3(target: Mapping[str, Any]) -> bool:
    """True for a Kimi K3 target as vLLM names it (model_type / architectures / attn residuals)."""
    archs = list(target.get("architectures") or [])
    if target.get("model_type") in K3_MODEL_TYPES or any(a in K3_ARCHITECTURES for a in archs):
        return True
    tc = text_config(target)
    kimi_linear = (tc.get("model_type") == "kimi_linear"
                   or any(a in KIMI_LINEAR_ARCHITECTURES for a in archs))
    return kimi_linear and tc.get("attn_res_block_size") is not None


def needs_aux_attn_res_stream(target: Mapping[str, Any], draft: DSparkConfig) -> bool:
    """A K3 target with a GQA drafter (SpecForge's K3 capture) needs the residual-stream capture."""
    return is_kimi_k3(target) and draft.attention_mode == "gqa"


# --------------------------------------------------------------------- the report
@dataclass
class CompatReport:
    """What :func:`check_target_compat` found; ``problems`` empty means the drafter fits."""

    target: str
    target_model_type: str | None
    target_architectures: list[str]
    target_hidden_size: int | None
    target_vocab_size: int | None
    target_num_hidden_layers: int | None
    draft_hidden_size: int
    draft_vocab_size: int
    target_layer_ids: list[int]
    vllm_aux_layer_ids: list[int]
    kimi_k3: bool
    needs_aux_attn_res_stream: bool
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        kind = "Kimi K3" if self.kimi_k3 else (self.target_model_type or "unknown model_type")
        head = (f"{kind} ({self.target_num_hidden_layers} layers, hidden {self.target_hidden_size}, "
                f"vocab {self.target_vocab_size})")
        if self.problems:
            return f"{head}: DOES NOT FIT, {len(self.problems)} problem(s)"
        extra = f"; needs {AUX_STREAM_ENV}=1" if self.needs_aux_attn_res_stream else ""
        return f"{head}: fits (vLLM aux layers {self.vllm_aux_layer_ids}){extra}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "ok": self.ok,
            "target": self.target,
            "model_type": self.target_model_type,
            "architectures": self.target_architectures,
            "hidden_size": self.target_hidden_size,
            "vocab_size": self.target_vocab_size,
            "num_hidden_layers": self.target_num_hidden_layers,
            "target_layer_ids": self.target_layer_ids,
            "vllm_aux_layer_ids": self.vllm_aux_layer_ids,
            "kimi_k3": self.kimi_k3,
            "needs_aux_attn_res_stream": self.needs_aux_attn_res_stream,
            "aux_attn_res_stream_env": os.environ.get(AUX_STREAM_ENV),
            "problems": list(self.problems),
            "notes": list(self.notes),
        }


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def check_target_compat(draft: DSparkConfig, target: str | Path | Mapping[str, Any] | Any,
                        *, environ: Mapping[str, str] | None = None) -> CompatReport:
    """Check that ``draft`` fits ``target`` (a directory, config.json, dict or PretrainedConfig).

    Never raises for a misfit: every problem is listed in ``report.problems``
    with both numbers and the fix. An unreadable target config is a problem too.
    """
    env = os.environ if environ is None else environ
    label = str(target) if isinstance(target, (str, Path)) else "<config>"
    try:
        tcfg = load_target_config(target)
    except TargetConfigError as exc:
        return CompatReport(target=label, target_model_type=None, target_architectures=[],
                            target_hidden_size=None, target_vocab_size=None,
                            target_num_hidden_layers=None, draft_hidden_size=draft.hidden_size,
                            draft_vocab_size=draft.vocab_size,
                            target_layer_ids=list(draft.target_layer_ids),
                            vllm_aux_layer_ids=list(draft.vllm_aux_layer_ids), kimi_k3=False,
                            needs_aux_attn_res_stream=False, problems=[str(exc)])
    tc = text_config(tcfg)
    hidden = _int_or_none(tc.get("hidden_size"))
    vocab = _int_or_none(tc.get("vocab_size"))
    layers = _int_or_none(tc.get("num_hidden_layers"))
    k3 = is_kimi_k3(tcfg)
    rep = CompatReport(
        target=label, target_model_type=tcfg.get("model_type"),
        target_architectures=list(tcfg.get("architectures") or []),
        target_hidden_size=hidden, target_vocab_size=vocab, target_num_hidden_layers=layers,
        draft_hidden_size=draft.hidden_size, draft_vocab_size=draft.vocab_size,
        target_layer_ids=list(draft.target_layer_ids),
        vllm_aux_layer_ids=list(draft.vllm_aux_layer_ids),
        kimi_k3=k3, needs_aux_attn_res_stream=needs_aux_attn_res_stream(tcfg, draft))
    p = rep.problems

    for name, value in (("hidden_size", hidden), ("vocab_size", vocab), ("num_hidden_layers", layers)):
        if value is None or value <= 0:
            p.append(f"target {name}: missing or invalid in the target config ({tc.get(name)!r}); "
                     "pass the target's own config.json")
    if hidden is not None:
        if draft.hidden_size != hidden:
            p.append(f"hidden size: the drafter's hidden_size is {draft.hidden_size} but the target's is "
                     f"{hidden}; the drafter embeds with the target's embedding and scores with its LM head, "
                     "so they must be equal: use a drafter trained for this target")
        fc_in = draft.target_hidden_size or draft.hidden_size
        if draft.target_hidden_size is not None and fc_in != hidden:
            p.append(f"target_hidden_size: the drafter's fc reads {len(draft.target_layer_ids)} x "
                     f"{fc_in} features but the target's hidden_size is {hidden}; use a drafter trained "
                     "for this target")
    if vocab is not None:
        if draft.vocab_size != vocab:
            p.append(f"vocab size: the drafter's vocab_size is {draft.vocab_size} but the target's is "
                     f"{vocab}; the drafter shares the target's LM head, so they must be equal")
        if not 0 <= draft.mask_token_id < vocab:
            p.append(f"mask_token_id: {draft.mask_token_id} is outside the target's vocabulary "
                     f"(0..{vocab - 1}); the masked query rows are embedded with the target's embedding; "
                     "fix dflash_config.mask_token_id")
    if layers is not None:
        for i in draft.target_layer_ids:
            if i < 0 or i + 1 > layers:
                p.append(f"target_layer_ids: layer {i} needs vLLM aux index {i + 1}, but the target has "
                         f"{layers} layers (aux indices 0..{layers}, ids 0..{layers - 1}); {AUX_CONVENTION}; "
                         "use a drafter trained for this target or fix dflash_config.target_layer_ids")
        if draft.num_target_layers is not None and draft.num_target_layers != layers:
            p.append(f"num_target_layers: the drafter was trained on a target with {draft.num_target_layers} "
                     f"layers but this target has {layers}; its target_layer_ids "
                     f"{list(draft.target_layer_ids)} were chosen for that depth: use a drafter trained "
                     "for this target")
    rep.notes.append(f"aux-index convention: {AUX_CONVENTION}; this drafter reads aux indices "
                     f"{list(draft.vllm_aux_layer_ids)}")
    if rep.needs_aux_attn_res_stream:
        state = env.get(AUX_STREAM_ENV)
        if state is not None and _env_flag(state) is not True:
            p.append(f"{AUX_STREAM_ENV}={state!r}: Kimi K3 with a GQA drafter needs the materialised "
                     f"attention-residual stream ({AUX_STREAM_ENV}=1); with 0 vLLM hands the drafter the "
                     "block prefix sum instead and acceptance collapses silently (and vLLM cannot parse a "
                     "non-integer). Unset it (the plugin then sets 1) or set it to 1")
        else:
            rep.notes.append(f"Kimi K3 target with a GQA drafter: {AUX_STREAM_ENV}=1 is required in every "
                             "vLLM process; the vllm_dspark plugin sets it at start-up unless it is "
                             "explicitly 0")
    return rep


# --------------------------------------------------------------------- the K3 env switch
def _env_flag(value: str) -> bool | None:
    """vLLM parses this switch with ``bool(int(value))``; None when it would not parse."""
    try:
        return bool(int(value.strip()))
    except ValueError:
        return None


def ensure_k3_aux_attn_res_stream(target: str | Path | Mapping[str, Any] | Any, draft: DSparkConfig,
                                  *, environ: MutableMapping[str, str] | None = None,
                                  set_env: bool = True) -> str:
    """Make sure a K3 target's residual-stream capture is on before any vLLM worker starts.

    Call it in the process that builds the vLLM config, before the executor
    spawns workers: multiprocessing workers inherit ``os.environ`` and vLLM's
    Ray executor copies every registered ``VLLM_*`` variable to its actors.

    Parameters
    ----------
    target : the target's config (directory, config.json, dict or PretrainedConfig)
    draft : the drafter's config
    environ : the environment to read and write (default ``os.environ``)
    set_env : False only checks (for worker processes): a required but unset
        switch then raises instead of being set

    Returns
    -------
    ``"not-needed"`` (not a K3 target, or not a GQA drafter), ``"already-on"``
    or ``"set"`` (this call set it to 1).

    Raises
    ------
    K3CaptureError
        The switch is required and was explicitly set to 0 (or to something
        vLLM cannot parse), or ``set_env=False`` and it is not on.
    """
    env = os.environ if environ is None else environ
    tcfg = load_target_config(target)
    if not needs_aux_attn_res_stream(tcfg, draft):
        return "not-needed"
    value = env.get(AUX_STREAM_ENV)
    if value is None:
        if not set_env:
            raise K3CaptureError(
                f"{AUX_STREAM_ENV} is not set in this process, but the Kimi K3 target with a GQA DSpark "
                "drafter needs the attention-residual stream capture; the driver sets it before workers "
                f"start, so this worker did not inherit it: export {AUX_STREAM_ENV}=1 on every node")
        env[AUX_STREAM_ENV] = "1"
        return "set"
    flag = _env_flag(value)
    if flag is True:
        return "already-on"
    reason = "explicitly off" if flag is False else "not an integer (vLLM parses it with int())"
    raise K3CaptureError(
        f"{AUX_STREAM_ENV}={value!r} is {reason}, but the Kimi K3 target with a GQA DSpark drafter "
        "(SpecForge's K3 capture) consumes the materialised attention-residual stream, which vLLM "
        f"captures only with {AUX_STREAM_ENV}=1. With it off vLLM feeds the drafter a different "
        "feature (the block prefix sum) and acceptance collapses without an error, so vllm_dspark "
        f"refuses to serve. Fix: unset {AUX_STREAM_ENV} (vllm_dspark then sets it) or export "
        f"{AUX_STREAM_ENV}=1 on every node.")


def ensure_for_vllm_config(vllm_config: Any, *, environ: MutableMapping[str, str] | None = None,
                           set_env: bool = True) -> str:
    """:func:`ensure_k3_aux_attn_res_stream` for a vLLM ``VllmConfig`` with a DSpark/DFlash draft.

    Returns ``"not-needed"`` when there is no speculative config or no draft
    model config (nothing to decide).
    """
    spec = getattr(vllm_config, "speculative_config", None)
    draft_mc = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft_mc is None:
        return "not-needed"
    draft = DSparkConfig.from_dict(draft_mc.hf_config.to_dict(), source=str(getattr(draft_mc, "model", "")))
    return ensure_k3_aux_attn_res_stream(vllm_config.model_config.hf_config, draft,
                                         environ=environ, set_env=set_env)
