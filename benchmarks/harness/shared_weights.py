"""Lockstep engines that read one copy of the target's weights (``lockstep --share-weights``).

Identical engines built in one process ran 0.4-7.7% apart, alike for the
whole life of a build (``lockstep``'s build bias). The same shows in plain
torch: three copies of the same 134 MB of bf16 weights, mat-vec'd in turn for
300 rounds, came out 2-6% apart, the first-allocated copy the slowest in 7 of
7 processes (``THP_MEM_ALLOC_ENABLE=1`` narrowed it to 1-2.5%; vLLM's engine
memory does not take that path: its oneDNN weights stayed on 4 KB pages). So a
good part of the bias is where each engine's weights landed in memory.

Here every engine's target model is pointed at the first engine's weights: each
linear layer's ``cpu_linear`` (the closure over the oneDNN handle that vLLM's
CPU backend packs at load) and every parameter and buffer, after a check that
the parameters' values are equal (the packed handles cannot be compared; the
lockstep record's greedy-identity column checks the outputs). The engines then differ in what they run,
not in which copy of the weights they read. Their KV caches, activations and
drafters stay their own; at batch 1 and these contexts the weights are most of
a step's memory traffic, at batch 32 the KV cache is a comparable part.

Two throwaway A/A runs (no-spec against no-spec-b, HumanEval, batch 1, 3
prompts x 96 tokens, 3 rotated builds x 2 repeats), one after the other:
- own weights: 0.999x [0.987-1.030], by build 1.026, 0.999, 0.991;
- shared weights: 0.998x [0.995-1.006], by build 0.998, 0.999, 1.001.
"""

from __future__ import annotations

import torch


def target_model(llm) -> torch.nn.Module:
    """The target model of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("sharing weights needs in-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    return core.model_executor.driver_worker.worker.model_runner.model


def share_weights(dst: torch.nn.Module, src: torch.nn.Module) -> int:
    """Point ``dst``'s weights (and packed linear handles) at ``src``'s; returns the tensors shared.

    Raises if the two models differ in structure or in any value: they must be the same
    target, loaded the same way.
    """
    mods = dict(src.named_modules())
    shared = 0
    for name, m in dst.named_modules():
        s = mods.get(name)
        if s is None or type(s) is not type(m):
            raise ValueError(f"share_weights: module {name!r} differs between the engines")
        for pname, p in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
            q = getattr(s, pname)
            if q.shape != p.shape or q.dtype != p.dtype or not torch.equal(q, p):
                raise ValueError(f"share_weights: {name}.{pname} differs between the engines")
            if q.data_ptr() != p.data_ptr():
                p.data = q.data
                shared += 1
        if ("cpu_linear" in vars(m)) != ("cpu_linear" in vars(s)):
            raise ValueError(f"share_weights: {name} has a packed linear in one engine only")
        if "cpu_linear" in vars(m):
            m.cpu_linear = s.cpu_linear
            shared += 1
    return shared
