"""Deployment tools: memory planning, Ray serving and batch jobs (target compatibility is in ``serving``).

``plan``     per-GPU memory for drafter weights, drafter KV, target MLA cache, KDA state
``batch``    resumable JSONL batch generation (used by ``scripts/batch_generate.py``)

The test-only Ray executor for vLLM's CPU platform is ``tests/deploy/ray_cpu.py`` (never for serving).
"""
