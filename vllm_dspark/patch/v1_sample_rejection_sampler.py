"""Patches of ``vllm.v1.sample.rejection_sampler``: correct per-token sampling params on CPU; no
rejection pass for a batch without drafts, and a greedy verify without float32 copies of the target
logits on CPU (``_make_forward``).

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


def argmax_is_verdict(sampling_metadata) -> bool:
    """Whether upstream's verify of this batch reduces to the target argmax of each draft position.

    That holds when every request is greedy and nothing upstream applies to the
    draft positions' logits before their argmax: no penalties, no bad words,
    no allowed-token mask, no request with ``min_tokens`` still to reach, and no
    thinking budget being tracked (``RejectionSampler.apply_logits_processors``).
    ``apply_sampling_constraints`` returns greedy logits as they are.
    """
    m = sampling_metadata
    if not m.all_greedy or not m.no_penalties or m.bad_words_token_ids or m.allowed_token_ids_mask is not None:
        return False
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    if any(isinstance(p, MinTokensLogitsProcessor) and p.min_toks for p in m.logitsprocs.non_argmax_invariant):
        return False
    holder = getattr(m, "thinking_budget_state_holder", None)
    return holder is None or not holder.has_tracked_requests()


def bonus_is_argmax(sampling_metadata) -> bool:
    """Whether upstream's bonus sample of this batch is the argmax of the bonus rows' raw logits.

    Beyond :func:`argmax_is_verdict`, the sampler applies every non-argmax-invariant
    logits processor to the bonus rows (the rejection sampler applies only min-tokens
    to the draft rows). So each of them must be a built-in one with nothing to do: a
    logit-bias processor without biases, a min-tokens one without a request below its
    minimum. Any other processor, a user's own included, keeps upstream's sampler.
    """
    return argmax_is_verdict(sampling_metadata) and _bonus_processors_idle(sampling_metadata)


def _bonus_processors_idle(sampling_metadata) -> bool:
    """The half of :func:`bonus_is_argmax` beyond :func:`argmax_is_verdict`."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor

    for p in sampling_metadata.logitsprocs.non_argmax_invariant:
        if type(p) is LogitBiasLogitsProcessor and not p.biases:
            continue
        if type(p) is MinTokensLogitsProcessor and not p.min_toks:
            continue
        return False
    return True


def greedy_accept(draft_ids: torch.Tensor, target_argmax: torch.Tensor, num_draft_tokens: list[int],
                  bonus_ids: torch.Tensor, max_spec_len: int) -> torch.Tensor:
    """[batch, max_spec_len + 1] int32, as upstream's greedy rejection kernel fills it.

    Request i gets its target's argmax at each position up to and including its
    first draft that differs from it (that argmax is the correction). If all of
    its drafts match, they are followed by its bonus token. The rest of the row is -1.

    Up to ``_PY_ACCEPT_MAX_BATCH`` requests the rows are filled in Python: a dozen
    small torch ops cost 0.16 ms at batch 1, a Python pass 0.01 ms (0.06 against
    0.20 ms at batch 32; torch wins from about 128 requests on this CPU).
    """
    if len(num_draft_tokens) <= _PY_ACCEPT_MAX_BATCH:
        return _greedy_accept_py(draft_ids, target_argmax, num_draft_tokens, bonus_ids, max_spec_len)
    return _greedy_accept_torch(draft_ids, target_argmax, num_draft_tokens, bonus_ids, max_spec_len)


_PY_ACCEPT_MAX_BATCH = 64


def _greedy_accept_py(draft_ids, target_argmax, num_draft_tokens, bonus_ids, max_spec_len) -> torch.Tensor:
    drafts, argmax, bonus = draft_ids.tolist(), target_argmax.tolist(), bonus_ids.view(-1).tolist()
    rows, start = [], 0
    for i, n in enumerate(num_draft_tokens):
        row = [-1] * (max_spec_len + 1)
        for j in range(n):
            row[j] = argmax[start + j]
            if drafts[start + j] != row[j]:
                break
        else:
            row[n] = bonus[i]
        start += n
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int32)


def _greedy_accept_torch(draft_ids, target_argmax, num_draft_tokens, bonus_ids, max_spec_len) -> torch.Tensor:
    n = torch.tensor(num_draft_tokens, dtype=torch.long)
    start = torch.cumsum(n, 0) - n
    pos = torch.arange(max_spec_len)
    valid = pos < n[:, None]
    idx = (start[:, None] + pos).clamp_(max=max(draft_ids.numel() - 1, 0))
    arg = target_argmax[idx].to(torch.int32)
    match = (draft_ids[idx].to(torch.int32) == arg) & valid
    accepted = match.to(torch.int32).cumprod(1).sum(1)
    out = torch.full((len(num_draft_tokens), max_spec_len + 1), -1, dtype=torch.int32)
    out[:, :max_spec_len] = torch.where(valid & (pos <= accepted[:, None]), arg, out[:, :max_spec_len])
    rows = (accepted == n).nonzero().squeeze(1)
    out[rows, n[rows]] = bonus_ids.view(-1)[rows].to(torch.int32)
    return out


def _make_forward(original):
    """Two shortcuts through ``RejectionSampler.forward``; anything else takes upstream's path.

    **No drafts.** With speculation on, vLLM's V1 runner sends every decode step
    through the rejection sampler, drafts or not. A step with no draft token in
    the whole batch needs only the bonus sample, so that sample alone is taken:
    the same call with the same arguments (``predict_bonus_token=True`` keeps the
    penalties' view of the spec tokens), the output shaped and typed as the
    rejection sampler's ([batch, 1] int32).

    **Greedy verify on CPU** (:func:`argmax_is_verdict`). Upstream gathers the
    draft positions' logits, casts them to float32, clones them, and only then
    takes their argmax with torch's CPU argmax, which does not vectorise. At
    batch 32 with 7 drafts that is 224 rows of 49,152 logits: 31 ms of a
    375 ms verify step (record ``step-cost-k7``, in git's history). Here the compiled
    ``row_argmax`` reads those rows in place. The answer is the same: bf16 and
    fp16 widen to float32 exactly, and ties go to the first index either way.
    The accept step is :func:`greedy_accept`. Other devices keep upstream's kernels.

    **The bonus sample on CPU.** When :func:`bonus_is_argmax` holds, the bonus
    rows take the same ``row_argmax`` (with the draft rows, in one call) instead
    of upstream's sampler, which widens them to float32 and runs torch's argmax:
    0.2 ms of a batch-1 step for one row. The same goes for a batch without
    drafts. Otherwise the bonus sample is upstream's own call.

    Requests for logprobs and synthetic acceptance keep the full path: their
    logprobs tensors are laid out differently.
    """

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        from vllm_dspark.ops.argmax import row_argmax

        if (sampling_metadata.max_num_logprobs is not None or getattr(self, "synthetic_mode", False)
                or sampling_metadata.logprob_token_ids):
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        from vllm.v1.outputs import SamplerOutput

        if metadata.max_spec_len == 0:
            # Counted on the instance, so the worker extension can report it without importing patches.
            self.dspark_no_draft_steps = getattr(self, "dspark_no_draft_steps", 0) + 1
            # With no drafts the bonus rows are all the rows, in order: the gather would only copy
            # them (6 MB at batch 32 with this vocabulary), so the sampler gets the logits as a plain
            # decode step's sampler does.
            idx = metadata.bonus_logits_indices
            all_rows = idx.numel() == logits.shape[0]
            if logits.device.type == "cpu" and bonus_is_argmax(sampling_metadata):
                self.dspark_argmax_bonus_steps = getattr(self, "dspark_argmax_bonus_steps", 0) + 1
                sampled = row_argmax(logits, None if all_rows else idx)
            else:
                rows = logits if all_rows else logits[idx]
                sampled = self.sampler(logits=rows, sampling_metadata=sampling_metadata,
                                       predict_bonus_token=True).sampled_token_ids
            return SamplerOutput(sampled_token_ids=sampled.view(-1, 1).to(torch.int32), logprobs_tensors=None)
        if logits.device.type != "cpu" or not argmax_is_verdict(sampling_metadata):
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        self.dspark_greedy_verify_steps = getattr(self, "dspark_greedy_verify_steps", 0) + 1
        if _bonus_processors_idle(sampling_metadata):  # argmax_is_verdict held just above
            # One pass of the op for the draft rows and the bonus rows together.
            self.dspark_argmax_bonus_steps = getattr(self, "dspark_argmax_bonus_steps", 0) + 1
            n_target = metadata.target_logits_indices.numel()
            both = row_argmax(logits, torch.cat([metadata.target_logits_indices, metadata.bonus_logits_indices]))
            target_argmax, bonus = both[:n_target], both[n_target:]
        else:
            bonus = self.sampler(logits=logits[metadata.bonus_logits_indices], sampling_metadata=sampling_metadata,
                                 predict_bonus_token=True).sampled_token_ids
            target_argmax = row_argmax(logits, metadata.target_logits_indices)
        out = greedy_accept(metadata.draft_token_ids, target_argmax, metadata.num_draft_tokens, bonus,
                            metadata.max_spec_len)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)

    return forward


FORWARD_PATCH = register_patch(Patch(
    name="rejection-sampler-no-drafts",
    module="vllm.v1.sample.rejection_sampler",
    attribute="RejectionSampler.forward",
    what="a step with no draft token in the batch takes the bonus sample alone, as a plain decode step does; "
         "on CPU a greedy verify takes the argmax of the draft positions' logits without float32 copies, and "
         "a greedy bonus sample with no logits processor at work is the same compiled argmax",
    why="with speculation on, the V1 runner sends every step through the rejection sampler, and its empty "
        "draft path cost 0.45 ms against the plain sampler's 0.17 ms per step at batch 1 (bf16, this CPU): "
        "a step where the budget admitted no drafts paid for verification it never did; a greedy verify "
        "copied the draft rows' logits three times (31 ms of a 375 ms step at batch 32, 7 drafts)",
    versions=("0.32",),
    removable_when="vLLM skips the rejection sampler (or its draft path) when a batch carries no draft tokens, "
                   "and its greedy verify takes the argmax of the draft rows without widening and cloning them",
    make=_make_forward,
))
