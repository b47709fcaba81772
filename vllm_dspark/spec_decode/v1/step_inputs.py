"""What V1's proposer reads per request from vLLM's runner and metadata, and writes to its trace.

Kept apart from the proposer so that it stays the adapter between the runner and the step
planner: request ids, which requests draft by sampling, which are past ``max_draft_context``,
the Gumbel seeds of sampled drafts, and the trace's draft records.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

import torch

from vllm_dspark.spec_decode.common.sources import COPY_SOURCE


def req_ids(runner, batch: int) -> list[str]:
    if runner is not None:
        return list(runner.input_batch.req_ids[:batch])
    return [str(i) for i in range(batch)]


def past_context_gate(max_draft_context: int | None, cad, batch: int) -> list[bool]:
    """Per request: whether its sequence is past ``max_draft_context`` (it then drafts nothing)."""
    if max_draft_context is None:
        return [False] * batch
    lens = cad.seq_lens_cpu_upper_bound if cad.seq_lens_cpu_upper_bound is not None else cad.seq_lens
    return [int(x) > max_draft_context for x in lens[:batch].tolist()]


def sampled_requests(draft_sampling: str, probabilistic: bool, sampling_metadata, batch: int) -> torch.Tensor:
    """[batch] bool: the requests that draft by sampling (temperature > 0, when drafts may be sampled)."""
    temps = getattr(sampling_metadata, "temperature", None)
    if draft_sampling == "greedy" or sampling_metadata.all_greedy or temps is None or not probabilistic:
        return torch.zeros(batch, dtype=torch.bool)
    return (temps[:batch] > 0).cpu()


def draft_seeds(runner, rows: list[int], cad, seed_base: int) -> torch.Tensor:
    """Gumbel seeds, a function of data every TP rank holds alike (never drawn from a generator):
    a seeded request's own seed mixed with its anchor position (reproducible alone or in any batch,
    and independent of the target's sampling stream); an unseeded one's id, position and the
    engine's seed."""
    positions = cad.seq_lens[: cad.batch_size()].to(torch.int64).tolist()
    out = []
    for r in rows:
        rid = runner.input_batch.req_ids[r] if runner is not None else str(r)
        state = runner.requests.get(rid) if runner is not None else None
        seed = getattr(getattr(state, "sampling_params", None), "seed", None)
        if seed is not None:
            out.append((int(seed) & 0xFFFFFFFF) ^ (int(positions[r]) << 32))
        else:
            out.append(unseeded_draft_seed(seed_base, str(rid), int(positions[r])))
    return torch.tensor(out, dtype=torch.int64)


def unseeded_draft_seed(base: int, req_id: str, position: int) -> int:
    """A 62-bit draft seed from the engine's seed, the request id and the anchor position (the same
    on every rank and in every process: no Python ``hash``, whose salt differs per process)."""
    digest = hashlib.blake2b(f"{base}:{req_id}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2 ** 62 - 1)


def draft_records(step: int, plan: str, req_ids: Sequence[str], positions: Sequence[int], anchors: Sequence[int],
                  tokens, conf, kept: Sequence[int], sampled, picks: Sequence[str], settings,
                  greedy_path: str | None) -> list[dict]:
    """The trace's record of each request's drafts this step."""
    return [{"step": step, "plan": plan, "pid": os.getpid(), "req_id": rid, "pos": positions[i],
             "anchor": anchors[i], "draft": tokens[i], "confidence": conf[i], "kept": kept[i],
             "sampled": bool(sampled[i]), "verification": settings.verification, "threshold": settings.threshold,
             # Sampled drafts are drawn by draft_sampling (dense, per position), greedy ones by the op.
             "source": picks[i],
             "path": "copy" if picks[i] == COPY_SOURCE else "sampled" if sampled[i] else greedy_path}
            for i, rid in enumerate(req_ids)]


def write_trace(path: str, records: Sequence[dict]) -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
