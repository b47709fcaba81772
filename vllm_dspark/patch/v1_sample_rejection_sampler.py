"""Patches of ``vllm.v1.sample.rejection_sampler``: correct per-token sampling params on CPU, and no
rejection pass for a batch without drafts (``_make_forward``).

``apply_sampling_constraints`` spreads each request's temperature, top-k and
top-p over its draft positions with ``expand_batch_to_tokens``. That function
allocates an uninitialised output (``x.new_empty``) and fills it with the
``_expand`` kernel. On the CPU backend, vLLM 0.32 routes that kernel to
``vllm.utils.cpu_triton_utils._expand_kernel_impl``. That function passes
``_ensure_int64(output)`` to the C++ op ``_C::expand_kernel_impl``, so a
float32 (temperature, top_p) or int32 (top_k) output is first copied to a
temporary int64 tensor. The op writes into that copy, which is then thrown
away. The real output keeps whatever bytes were in memory before. (The input
is also cast to int64, so a temperature of 0.7 would have become 0 anyway.)

As a result, on CPU every draft position of a non-greedy request divided its
target logits by uninitialised memory (we saw 0, ~1e-38 and ~-1.5e18), and
top-k/top-p ran with junk values. The recovered tokens and the accept/reject
decisions followed from those junk probabilities. The output was therefore
not the target distribution. It also varied with the allocator state, so
seeded requests did not repeat. Greedy requests never reach this path
(``all_greedy`` returns first).

This patch replaces ``expand_batch_to_tokens`` for CPU tensors with a torch
``repeat_interleave`` that does the same job: each request's value, with
``replace_from`` changed to ``replace_to``, is repeated over that request's
tokens, and the dtype is kept. Other devices still call the original.
"""

from __future__ import annotations

import torch

from vllm_dspark.patch.registry import Patch, register_patch


def expand_batch_to_tokens_cpu(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                               replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """[batch_size] -> [num_tokens]: request i's value over its tokens (cu_num_tokens is cumulative)."""
    assert cu_num_tokens.shape[0] == x.shape[0]
    counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return values.repeat_interleave(counts, output_size=num_tokens)


def _make_expand(original):
    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        if x.device.type != "cpu":
            return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        return expand_batch_to_tokens_cpu(x, cu_num_tokens, num_tokens, replace_from, replace_to)
    return expand_batch_to_tokens


PATCH = register_patch(Patch(
    name="rejection-sampler-cpu-expand",
    module="vllm.v1.sample.rejection_sampler",
    attribute="expand_batch_to_tokens",
    what="on CPU, per-request temperature/top-k/top-p are expanded to draft positions with torch "
         "(repeat_interleave) instead of the CPU '_expand' kernel override",
    why="vLLM 0.32's CPU override (cpu_triton_utils._expand_kernel_impl) casts the output to a temporary "
        "int64 copy, so float32/int32 outputs stay uninitialised; spec-decode sampling at temperature > 0 "
        "then used junk temperatures (wrong distribution, seeded requests not reproducible)",
    versions=("0.32",),
    removable_when="vLLM's CPU _expand_kernel_impl writes back non-int64 outputs (and keeps float inputs), "
                   "e.g. by copying the int64 result into the output or handling float dtypes natively",
    make=_make_expand,
))


def _make_forward(original):
    """A verify step with no draft token in the whole batch samples like a plain decode step.

    With speculation on, vLLM's V1 runner sends every decode step through the
    rejection sampler, drafts or not. With none, its work (the bonus sample, an
    empty target-logits pass, the sampling constraints, the rejection kernel)
    reduces to the bonus sample, so that sample alone is taken: the same call
    with the same arguments (``predict_bonus_token=True`` keeps the penalties'
    view of the spec tokens), the output shaped and typed as the rejection
    sampler's ([batch, 1] int32). Requests for logprobs and synthetic acceptance
    keep the full path, whose logprobs tensors are laid out differently.
    """

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if (metadata.max_spec_len != 0 or sampling_metadata.max_num_logprobs is not None
                or getattr(self, "synthetic_mode", False) or sampling_metadata.logprob_token_ids):
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        from vllm.v1.outputs import SamplerOutput

        # Counted on the instance, so the worker extension can report it without importing patches.
        self.dspark_no_draft_steps = getattr(self, "dspark_no_draft_steps", 0) + 1
        # With no drafts the bonus rows are all the rows, in order: the gather would only copy
        # them (6 MB at batch 32 with this vocabulary), so the sampler gets the logits as a plain
        # decode step's sampler does.
        idx = metadata.bonus_logits_indices
        rows = logits if idx.numel() == logits.shape[0] else logits[idx]
        out = self.sampler(logits=rows, sampling_metadata=sampling_metadata, predict_bonus_token=True)
        return SamplerOutput(sampled_token_ids=out.sampled_token_ids.view(-1, 1).to(torch.int32),
                             logprobs_tensors=None)

    return forward


FORWARD_PATCH = register_patch(Patch(
    name="rejection-sampler-no-drafts",
    module="vllm.v1.sample.rejection_sampler",
    attribute="RejectionSampler.forward",
    what="a step with no draft token in the batch takes the bonus sample alone, as a plain decode step does",
    why="with speculation on, the V1 runner sends every step through the rejection sampler, and its empty "
        "draft path cost 0.45 ms against the plain sampler's 0.17 ms per step at batch 1 (bf16, this CPU): "
        "a step where the budget admitted no drafts paid for verification it never did",
    versions=("0.32",),
    removable_when="vLLM skips the rejection sampler (or its draft path) when a batch carries no draft tokens",
    make=_make_forward,
))
