"""Start-up cost profile of the budget: target verify time by batch tokens, drafter time by requests.

Runs once when the engine is warm (the worker patch calls
``DSparkProposer.on_engine_ready``), a few seconds on a small model: the
target's forward on dummy batches of 1, 2, 4, ... tokens up to the largest
verify batch the scheduler can build, and the drafter's block forward plus
its sequential stage for 1, 2, 4, ... requests. The result is cached on disk
(``<cache>/budget/<key>.json``, the key covering the models, dtype, device,
thread count and batch limits), so later starts load it;
``VLLM_DSPARK_PROFILE_CACHE=0`` always re-profiles. Online corrections
(:class:`~vllm_dspark.spec_decode.budget.CostModel`) track the machine's load
afterwards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time

import torch

from vllm_dspark.cache import cache_dir
from vllm_dspark.spec_decode import budget as B

logger = logging.getLogger("vllm_dspark")


def _time(fn, reps: int = 3) -> float:
    fn()  # warm
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _key(proposer) -> str:
    vc = proposer.vllm_config
    parts = {
        "target": str(vc.model_config.model), "dtype": str(vc.model_config.dtype),
        "draft": proposer.settings.draft, "device": str(proposer.device),
        "threads": torch.get_num_threads(), "max_tokens": vc.scheduler_config.max_num_batched_tokens,
        "max_seqs": vc.scheduler_config.max_num_seqs, "block": proposer.block,
        "vllm": __import__("vllm").__version__, "cpu": os.uname().machine,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


PROFILE_MAX_TOKENS = 512
PROFILE_MAX_REQUESTS = 64


def profile(proposer) -> B.CostModel:
    runner = proposer.runner
    vc = proposer.vllm_config
    max_seqs = int(vc.scheduler_config.max_num_seqs)
    max_verify = min(int(vc.scheduler_config.max_num_batched_tokens), max_seqs * (proposer.block + 1))
    # Dummy batches past these sizes crashed vLLM 0.32's CPU attention kernel (a segfault in
    # cpu_attn's GEMM during warm-up; seen with max_num_seqs 256, 8K batched tokens). Beyond the
    # last profiled point the cost model extrapolates linearly and the online EMA corrects it.
    max_verify = min(max_verify, PROFILE_MAX_TOKENS)
    max_seqs = min(max_seqs, PROFILE_MAX_REQUESTS)
    verify = []
    for n in B.profile_sizes(max_verify):
        verify.append((n, _time(lambda n=n: runner._dummy_run(n, force_attention=True))))
    draft = []
    mw = proposer.model.markov
    from vllm_dspark.ops import markov_draft

    for r in B.profile_sizes(max_seqs):
        nq = r * proposer.block

        def run(nq=nq, r=r):
            proposer.dummy_run(nq, use_cudagraphs=False)
            h = proposer.hidden_states[:nq]
            base = proposer.model.compute_logits(h)[:, : mw.vocab].reshape(r, proposer.n_draft, mw.vocab)
            markov_draft(base, torch.zeros(r, dtype=torch.int64, device=base.device), mw.markov_w1,
                         mw.markov_w2, mw.w2_row_norms)
        draft.append((r, _time(run)))
    return B.CostModel(verify=verify, draft=draft, source="start-up profile")


def profile_or_load(proposer) -> B.CostModel:
    path = cache_dir() / "budget" / f"{_key(proposer)}.json"
    use_cache = os.environ.get("VLLM_DSPARK_PROFILE_CACHE", "1") != "0"
    if use_cache and path.is_file():
        cached = B.load_cached(path)
        if cached is not None:
            return cached
    t0 = time.perf_counter()
    model = profile(proposer)
    logger.info("vllm_dspark: profiled the budget's costs in %.1f s", time.perf_counter() - t0)
    if use_cache:
        try:
            B.save_cached(path, model)
            model.source = f"start-up profile, cached at {path}"
        except OSError as exc:
            logger.warning("vllm_dspark: could not cache the cost profile at %s (%s)", path, exc)
    return model
