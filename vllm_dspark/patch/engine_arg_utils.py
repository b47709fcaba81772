"""Patch of ``vllm.engine.arg_utils``: accept a ``"dspark"`` block in the speculative config.

``--speculative-config '{"method": "dspark", "model": DIR, "dspark": {"window": 4096}}'``
(and ``LLM(speculative_config={...})``) carry DSpark's own settings in one
nested block. vLLM's ``SpeculativeConfig`` forbids unknown fields, so this
patch takes the block out before the config is built and hands it to the
config patch through ``vllm_dspark.patch.handoff``, which validates it with the
draft. The block is refused for any other method.
"""

from __future__ import annotations

from vllm_dspark.patch import handoff
from vllm_dspark.patch.registry import Patch, register_patch
from vllm_dspark.serving.settings import SPEC_KEY, DSparkSettingsError


def _make(original):
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if not isinstance(spec, dict) or SPEC_KEY not in spec:
            return original(self, target_model_config, target_parallel_config)
        spec = dict(spec)
        options = spec.pop(SPEC_KEY)
        if spec.get("method") != "dspark":
            raise DSparkSettingsError(
                f"speculative_config['{SPEC_KEY}'] configures DSpark drafts, but method is "
                f"{spec.get('method')!r}; use method 'dspark' or drop the '{SPEC_KEY}' block")
        if options is not None and not isinstance(options, dict):
            raise DSparkSettingsError(f"speculative_config['{SPEC_KEY}']: expected an object of settings, "
                                      f"got {type(options).__name__}")
        self.speculative_config = spec
        with handoff.carrying(options or {}):
            return original(self, target_model_config, target_parallel_config)
    return create_speculative_config


PATCH = register_patch(Patch(
    name="engine-args-dspark-block",
    module="vllm.engine.arg_utils",
    attribute="EngineArgs.create_speculative_config",
    what="the speculative config's 'dspark' block is taken out and validated with the draft",
    why="vLLM's SpeculativeConfig forbids unknown keys, and DSpark has settings of its own (window, "
        "verification, context gate, draft sampling)",
    versions=("0.32",),
    removable_when="vLLM's speculative config grows a passthrough for method-specific options",
    make=_make,
))
