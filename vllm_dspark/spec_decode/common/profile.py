"""Start-up cost profile of the budget: target verify time by batch tokens, drafter time by requests.

Runs once when the engine is warm (the worker patch calls
``DSparkProposer.on_engine_ready``): the target's forward, and the logits of every
token, on dummy batches of every size up to 16 tokens and powers of two beyond (the drafter
left out: :func:`_verify_fn`) up to the largest verify batch the scheduler can build (at most
:data:`PROFILE_MAX_TOKENS`),
and the drafter's block forward plus its sequential stage for 1, 2, 4, ... requests
(at most :data:`PROFILE_MAX_REQUESTS`). Each point is the fastest of
:data:`PROFILE_REPS` timed runs after one untimed run (the fastest, because
noise on a shared machine only ever adds time); points that take
:data:`PROFILE_LONG_S` or more get two runs. That is 20 verify and 6 draft sizes
at most. Measured on the 2-core CPU machine (float32): 0.24 s for the tiny test pairs (under
other load), 4.8 s for SmolLM2-135M with the default drafter (max_num_seqs 64); loading a cached
profile with its spot check 0.3 s.

The result is cached on disk (``<cache>/budget/<key>.json``, the key covering
the models, dtype, device, thread count and batch limits), so later starts
load it; the ``profile_cache`` setting (``VLLM_DSPARK_PROFILE_CACHE``) moves the
cache to another directory, or turns it ``off`` (profile at every start). A cached profile
is not trusted blindly:

* at load, a **spot check** times the 1-token verify step and the 1-request
  draft step again (8 dummy runs); when either differs from the cache by more
  than :data:`SPOT_TOLERANCE` x, the profile is taken again (the cached one was
  taken while the machine was busy, or on another state of it); otherwise the
  online corrections start from the ratios it measured (:func:`seed_scales`);
* while serving, the online corrections
  (:class:`~vllm_dspark.spec_decode.common.costs.CostModel`) track the machine's load;
  when one stays far from 1 for long (:attr:`CostModel.stale`), the proposer
  drops the cache entry (:func:`drop_cached`), so the next start profiles again.

Under tensor parallelism every dummy run is a collective, so the deciding
rank's cache lookup, its spot-check verdict and its measured cost model are
broadcast (:mod:`.consensus`) before anything runs: all ranks load, or all
ranks profile, and all use the same model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from vllm_dspark.cache import cache_dir
from vllm_dspark.spec_decode.common import costs as C
from vllm_dspark.spec_decode.common.consensus import Consensus

logger = logging.getLogger("vllm_dspark")

PROFILE_MAX_TOKENS = 256
PROFILE_MAX_REQUESTS = 32
PROFILE_REPS = 3
PROFILE_LONG_S = 0.1
SPOT_TOLERANCE = 2.0
PROFILE_VERIFY_POINT = "target forward + every token's logits"


def _time(fn, reps: int = PROFILE_REPS, scale: float = 1.0, long_s: float = PROFILE_LONG_S,
          consensus: Consensus | None = None) -> float:
    """The fastest of ``reps`` timed runs after an untimed one; a point whose first run takes
    ``long_s`` or more gets one more run only (the fastest of those two).

    How many runs follow is a collective decision: every run is a dummy forward
    with collectives under TP, and each rank times its own first run. A rank whose
    first run crossed ``long_s`` while another's did not would run one forward
    fewer, and the others would wait for it in a collective for ever (CI caught
    this as an intermittent start-up hang of the Ray TP=2 test under load). The
    deciding rank's verdict is broadcast.
    """
    def once() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    first = once()
    is_long = first >= long_s
    if consensus is not None:
        is_long = consensus.decide(lambda: is_long)
    if is_long:
        return min(first, once()) * scale
    return min(once() for _ in range(reps)) * scale


def _key(proposer) -> str:
    vc = proposer.vllm_config
    parts = {
        "target": str(vc.model_config.model), "dtype": str(vc.model_config.dtype),
        "draft": proposer.settings.draft, "device": str(proposer.device),
        "threads": torch.get_num_threads(), "max_tokens": vc.scheduler_config.max_num_batched_tokens,
        "max_seqs": vc.scheduler_config.max_num_seqs, "block": proposer.block,
        "vllm": __import__("vllm").__version__, "cpu": os.uname().machine,
        # A draft vocabulary changes the drafter's step (its LM head and Markov stage).
        "draft_vocab": getattr(proposer.settings, "draft_vocab", None),
        # What a verify point times (_verify_fn): profiles cached before the drafter was left out are retaken.
        "verify_point": PROFILE_VERIFY_POINT,
        "verify_sizes": f"every size to {C.DENSE_SIZES}",  # profiles of 1, 2, 4, 8 ... tokens are retaken
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(proposer) -> Path:
    where = proposer.settings.profile_cache
    base = cache_dir() / "budget" if where in ("on", "off") else Path(where).expanduser()
    return base / f"{_key(proposer)}.json"


def _verify_fn(proposer, n: int):
    """The target's part of a verify step of ``n`` tokens: its forward and the logits of every token (a
    verify step scores each token it runs, the drafts' and the anchors'), without the drafter.

    vLLM's ``_dummy_run`` also runs the drafter's dummy forward over the ``n`` tokens and scores only
    each dummy request's last token. Timed as it was, the drafter's few milliseconds made every point up
    to 16 tokens cost the same (bf16 SmolLM2 on the 2-core EPYC: 33.7 ms from 1 to 16 tokens, against
    a 24 ms decode step), so a draft token's verify cost was priced near zero until the online shape
    corrections caught up, at each batch size anew."""
    runner = proposer.runner

    def run():
        with _drafter_dummy_off(runner):
            hidden, _ = runner._dummy_run(n, force_attention=True)
        runner.model.compute_logits(hidden[:n])
    return run


@contextlib.contextmanager
def _drafter_dummy_off(runner):
    """The runner's drafter does nothing in a dummy run (its cost is the draft profile's to measure)."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None:
        yield
        return
    own = vars(drafter).get("dummy_run")  # an instance's own attribute, if it has one
    drafter.dummy_run = lambda *args, **kwargs: None  # shadows the method
    try:
        yield
    finally:
        if own is None:
            del drafter.dummy_run
        else:
            drafter.dummy_run = own


def _draft_fn(proposer, r: int):
    stage = proposer.markov_stage
    block, n = proposer.block, proposer.n_draft
    nq = r * block

    def run():
        proposer.dummy_run(nq, use_cudagraphs=False)
        # The rows a step drafts from, as the layout samples them: every query of a block
        # (anchor-first) or the N masks after its anchor (1 + N: block - 1 rows of block).
        hidden = proposer.hidden_states[:nq].view(r, block, -1)[:, block - n:]
        base, _ = stage.inputs(hidden.reshape(r * n, -1), r, n, with_confidence=False)
        stage.greedy(base, torch.zeros(r, dtype=torch.int64, device=base.device), None,
                     hidden=hidden)  # read by gated / rnn heads only
    return run


def profile(proposer, draft_scale: float = 1.0, consensus: Consensus | None = None) -> C.CostModel:
    vc = proposer.vllm_config
    max_seqs = int(vc.scheduler_config.max_num_seqs)
    max_verify = min(int(vc.scheduler_config.max_num_batched_tokens), max_seqs * (proposer.block + 1))
    # Dummy batches past 512 tokens / 64 requests crashed vLLM 0.32's CPU attention kernel (a
    # segfault in cpu_attn's GEMM during warm-up; seen with max_num_seqs 256, 8K batched tokens),
    # and the points past 256 / 32 took most of the profile's time. Beyond the last profiled point
    # the cost model extrapolates linearly (compute-bound) and the online EMA corrects it.
    max_verify = min(max_verify, PROFILE_MAX_TOKENS)
    max_seqs = min(max_seqs, PROFILE_MAX_REQUESTS)
    verify = [(n, _time(_verify_fn(proposer, n), consensus=consensus))
              for n in C.profile_sizes(max_verify, C.DENSE_SIZES)]
    draft = [(r, _time(_draft_fn(proposer, r), scale=draft_scale, consensus=consensus))
             for r in C.profile_sizes(max_seqs)]
    return C.CostModel(verify=verify, draft=draft, source="start-up profile")


def spot_check(proposer, draft_scale: float = 1.0, consensus: Consensus | None = None) -> dict[str, float]:
    """The 1-token verify step and the 1-request draft step, timed now (every rank runs both)."""
    return {"verify_1": _time(_verify_fn(proposer, 1), consensus=consensus),
            "draft_1": _time(_draft_fn(proposer, 1), scale=draft_scale, consensus=consensus)}


def judge_spot_check(cached: C.CostModel, spot: dict[str, float], tolerance: float | None = None) -> str | None:
    """Why the cached profile is stale (None: it still describes this machine)."""
    tolerance = SPOT_TOLERANCE if tolerance is None else tolerance
    for name, want in (("verify_1", float(cached.verify_time(1))), ("draft_1", cached.draft_time(1))):
        got = spot[name]
        ratio = got / max(want, 1e-12)
        if not 1.0 / tolerance <= ratio <= tolerance:
            return f"{name} took {got * 1e3:.2f} ms now and {want * 1e3:.2f} ms in the cached profile"
    return None


def seed_scales(model: C.CostModel, spot: dict[str, float]) -> None:
    """Start the online corrections at what the spot check measured now (the deciding rank's numbers).

    A cached profile within the spot check's tolerance was otherwise loaded as it was, and only steps
    correct it, the drafter's cost only on steps it drafts in full. A draft point cached 1.5-2x too slow (a
    profile taken beside other work) could then price the drafter out of its probes, and nothing ever
    measured it again."""
    for name, current, attr in (("verify_1", model.verify_time(1), "scale_verify"),
                                ("draft_1", model.draft_time(1), "scale_draft")):
        scale = getattr(model, attr) * spot[name] / max(float(current), 1e-12)
        setattr(model, attr, min(max(scale, 1.0 / SPOT_TOLERANCE), SPOT_TOLERANCE))


def _lookup(path: Path, use_cache: bool, hook: dict) -> dict | None:
    if hook.get("cached_costs") is not None:
        return dict(hook["cached_costs"])
    if not (use_cache and path.is_file()):
        return None
    m = C.load_cached(path)
    return None if m is None else m.to_dict()


def drop_cached(path: str | Path | None) -> bool:
    """Remove a cached profile (the next start profiles again); True if one was removed."""
    if not path:
        return False
    try:
        Path(path).unlink()
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        logger.warning("vllm_dspark: could not drop the cached cost profile %s (%s)", path, exc)
        return False


def profile_or_load(proposer, consensus: Consensus | None = None, hook: dict | None = None) -> C.CostModel:
    """The budget's cost model, the same on every rank (see the module docstring).

    ``proposer.profile_info`` records what happened here: this rank's own cache
    lookup, the agreed decision, the spot check and the seconds it all took.
    """
    cons = consensus or Consensus()
    hook = hook or {}
    scale = float(hook.get("draft_time_scale", 1.0))
    t0 = time.perf_counter()
    path = cache_path(proposer)
    use_cache = proposer.settings.profile_cache != "off"
    local = _lookup(path, use_cache, hook)
    info: dict = {"local_cache_hit": local is not None, "rank": cons.rank}
    # 1. Is there a cached profile? The deciding rank's answer, before any dummy run.
    cached = cons.decide(lambda: local)
    model: C.CostModel | None = None
    if cached is not None:
        candidate = C.CostModel.from_dict(cached, source=f"cache {path}")
        # 2. Does it still describe this machine? Every rank runs the spot check; the decider judges.
        spot = spot_check(proposer, scale, cons)
        why, seen = cons.decide(lambda: (judge_spot_check(candidate, spot), spot))
        info.update(spot_check={k: round(v, 6) for k, v in spot.items()}, stale_at_load=why)
        if why is None:
            model = candidate
            seed_scales(model, seen)
            model.cache_path = str(path) if use_cache else None
            info["decision"] = "loaded"
        else:
            logger.warning("vllm_dspark: the cached cost profile %s is stale (%s); profiling again", path, why)
    if model is None:
        # 3. Profile: every rank together (dummy runs are collectives); the decider's numbers win.
        measured = profile(proposer, scale, cons)
        agreed = cons.decide(lambda: measured.to_dict())
        model = C.CostModel.from_dict(agreed, source="start-up profile")
        info["decision"] = "profiled"
        info["local_verify_1"], info["local_draft_1"] = measured.verify[0][1], measured.draft[0][1]
        if use_cache and cons.is_decider:
            try:
                C.save_cached(path, model)
                model.source = f"start-up profile, cached at {path}"
                model.cache_path = str(path)
            except OSError as exc:
                logger.warning("vllm_dspark: could not cache the cost profile at %s (%s)", path, exc)
        elif use_cache:
            model.source = "start-up profile (cached by TP rank 0)"
    info["seconds"] = round(time.perf_counter() - t0, 3)
    logger.info("vllm_dspark: budget cost model %s in %.1f s (%s)", info["decision"], info["seconds"], model.source)
    proposer.profile_info = info
    return model
