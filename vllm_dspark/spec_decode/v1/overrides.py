"""Upstream methods the DSpark proposer overrides or calls, with the signatures it was written against.

Subclassing vLLM's ``DFlashProposer`` keeps the KV cache, attention and
rejection sampling upstream's, but every overridden method and every upstream
helper the proposer calls is a coupling: if vLLM renames a parameter or adds a
required one, the proposer must fail at start-up with a message that says
which upstream function changed, not with a ``TypeError`` in the middle of a
decode step (or worse, silently pass the wrong argument). Like the patch
registry, each entry records what it is for and when it can go.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class Coupling:
    target: str  # "module:Qualified.name"
    params: tuple[str, ...]  # parameter names (after self), in order
    kind: str  # "override" (we replace it) or "call" (we call it)
    why: str


COUPLINGS: tuple[Coupling, ...] = (
    Coupling("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.propose",
             ("num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
              "next_token_ids", "token_indices_to_sample", "common_attn_metadata", "sampling_metadata",
              "mm_embed_inputs", "num_rejected_tokens_gpu", "slot_mappings"),
             "override",
             "DSpark drafts the whole block, runs the Markov stage, and then decides per request how many "
             "drafts the target verifies (budget or threshold); steps the budget skips store context KV only"),
    Coupling("vllm.v1.spec_decode.dflash:DFlashProposer.set_inputs_first_pass",
             ("target_token_ids", "next_token_ids", "target_positions", "target_hidden_states",
              "token_indices_to_sample", "cad", "num_rejected_tokens_gpu"),
             "override",
             "anchor-first layout: block_size queries [anchor, mask x (B-1)], every row sampled (upstream "
             "lays out 1 + num_speculative_tokens and samples the masks)"),
    Coupling("vllm.v1.spec_decode.utils:_copy_and_expand_dflash_inputs",
             ("next_token_ids_ptr", "target_positions_ptr", "out_input_ids_ptr", "out_context_positions_ptr",
              "out_query_positions_ptr", "out_context_slot_mapping_ptr", "out_query_slot_mapping_ptr",
              "out_token_indices_ptr", "block_table_ptr", "query_start_loc_ptr", "num_rejected_tokens_ptr",
              "block_table_stride", "parallel_drafting_token_id", "block_size", "num_query_per_req",
              "num_speculative_tokens", "total_input_tokens", "max_tokens_per_req", "triton_block_size",
              "has_num_rejected"),
             "call", "lays out the query block with explicit widths"),
    Coupling("vllm.v1.spec_decode.dflash:DFlashProposer.build_model_inputs_first_pass",
             ("num_tokens", "num_input_tokens", "mm_embed_inputs"), "call",
             "stores the context K/V and returns the block's model inputs"),
    Coupling("vllm.v1.spec_decode.dflash:DFlashProposer.build_per_group_and_layer_attn_metadata",
             ("cad", "draft_index"), "call", "attention metadata of the query block"),
    Coupling("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._determine_batch_execution_and_padding",
             ("num_tokens", "use_cudagraphs"), "call", "padding / CUDA-graph mode of the block forward"),
    Coupling("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._get_slot_mapping",
             ("num_tokens", "slot_mapping"), "call", "slot mapping of the block forward"),
    Coupling("vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model.precompute_and_store_context_kv",
             ("context_states", "context_positions", "context_slot_mapping"), "call",
             "the model class feeds it exact per-batch cos/sin rows"),
)


class UpstreamChanged(RuntimeError):
    """An upstream function the proposer depends on no longer has the signature it was written for."""


def _resolve(target: str):
    mod_name, qual = target.split(":")
    obj = importlib.import_module(mod_name)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _params(obj) -> tuple[str, ...]:
    fn = getattr(obj, "__wrapped__", obj)
    sig = inspect.signature(fn)
    names = [p.name for p in sig.parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return tuple(n for n in names if n != "self")


def check_couplings(couplings: tuple[Coupling, ...] = COUPLINGS) -> None:
    """Raise :class:`UpstreamChanged` naming every coupling whose upstream signature moved."""
    problems = []
    for c in couplings:
        try:
            got = _params(_resolve(c.target))
        except (ImportError, AttributeError) as exc:
            problems.append(f"{c.target}: not found ({exc})")
            continue
        except (TypeError, ValueError):
            continue  # builtins / C functions without a signature: nothing to compare
        if got != c.params:
            problems.append(f"{c.target}: expected parameters {list(c.params)}, upstream now has {list(got)}")
    if problems:
        raise UpstreamChanged(
            "vllm_dspark's DSpark proposer was written against other upstream signatures; this vLLM "
            "changed:\n  - " + "\n  - ".join(problems)
            + "\nInstall a supported vLLM (see vllm_dspark.versions) or update vllm_dspark.")


def describe() -> list[dict]:
    return [dict(target=c.target, kind=c.kind, params=list(c.params), why=c.why) for c in COUPLINGS]
