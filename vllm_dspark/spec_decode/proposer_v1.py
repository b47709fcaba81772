"""DSpark proposer for vLLM's V1 model runner (CPU backend, and GPU users on V1).

A subclass of vLLM's ``DFlashProposer``: context-KV precompute, the non-causal
block forward, the KV cache and the rejection sampler are upstream's. DSpark
changes three things:

1. Query layout. Anchor-first checkpoints run ``block_size`` queries
   ``[anchor, mask x (B-1)]`` and sample every row (B drafts, the target
   verifies 1 + B tokens); upstream lays out ``1 + N`` and samples the masks.
   ``one_plus_n`` checkpoints keep upstream's layout.
2. The sequential stage. Rows are not argmaxed independently: the Markov draft
   op adds ``markov_w2 @ markov_w1[prev]`` left to right from the anchor and
   computes each position's confidence. Drafts are greedy, or with
   ``draft_sample_method: "probabilistic"`` sampled at each request's
   temperature from the Markov-corrected distribution, whose probabilities go to
   the rejection sampler.
3. What the target verifies. Each request keeps the first
   ``min(num_speculative_tokens, L)`` drafts, where L is the longest prefix whose
   running product of confidences stays at or above the threshold, so the target
   verifies (and ``vllm:spec_decode_num_draft_tokens`` counts) only that prefix.
   A request can keep 0 drafts; its step is then a plain decode step.

The drafter always runs its full trained block, so the kept drafts equal the
first tokens the reference drafter proposes with the same context.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_dspark.config import DSparkConfig
from vllm_dspark.spec_decode.settings import ProposerSettings, TRACE_ENV, markov_enabled, stats_interval

logger = logging.getLogger("vllm_dspark")


class EarlyStopStats:
    """Counters of what the confidence gate and the num_speculative_tokens cut removed."""

    def __init__(self) -> None:
        self.steps = 0
        self.requests = 0  # request-steps that drafted
        self.requests_cut = 0  # request-steps whose kept draft is shorter than the block
        self.tokens_drafted = 0  # draft tokens that would be verified without the gate
        self.tokens_kept = 0  # draft tokens sent to the target for verification
        self.empty_drafts = 0
        self._lock = threading.Lock()

    def add(self, cap: int, kept: list[int]) -> None:
        """One draft step: ``cap`` tokens per request would be verified without the gate."""
        with self._lock:
            self.steps += 1
            self.requests += len(kept)
            self.requests_cut += sum(1 for k in kept if k < cap)
            self.tokens_drafted += cap * len(kept)
            self.tokens_kept += sum(kept)
            self.empty_drafts += sum(1 for k in kept if k == 0)

    def as_dict(self) -> dict:
        return dict(steps=self.steps, requests=self.requests, requests_cut=self.requests_cut,
                    tokens_drafted=self.tokens_drafted, tokens_kept=self.tokens_kept,
                    empty_drafts=self.empty_drafts)

    def line(self) -> str:
        frac = self.requests_cut / self.requests if self.requests else 0.0
        kept = self.tokens_kept / self.requests if self.requests else 0.0
        dropped = self.tokens_drafted - self.tokens_kept
        return (f"DSpark early stop: {self.requests_cut}/{self.requests} drafts cut ({frac:.1%}), "
                f"{dropped}/{self.tokens_drafted} draft tokens not verified, mean kept length {kept:.2f}, "
                f"{self.empty_drafts} empty drafts")


class DSparkProposer(DFlashProposer):
    def __init__(self, vllm_config, device, runner=None):
        spec = vllm_config.speculative_config
        # DFlashProposer insists on method "dflash", which is how the V1 path carries DSpark.
        super().__init__(vllm_config, device, runner)
        self.runner = runner  # for request ids in the trace
        hf = spec.draft_model_config.hf_config
        self.dspark_config = DSparkConfig.from_dict(hf.to_dict())
        cfg = self.dspark_config
        self.block = cfg.block_size
        self.anchor_first = cfg.query_layout == "anchor_first"
        self.settings = ProposerSettings(
            num_draft_tokens=int(getattr(hf, "dspark_num_draft_tokens", cfg.num_draft_tokens)),
            block_size=cfg.num_draft_tokens,
            threshold=float(getattr(hf, "dspark_confidence_threshold", 0.0)),
            threshold_source=str(getattr(hf, "dspark_threshold_source", "default")),
            trace_path=os.environ.get(TRACE_ENV) or None,
            stats_interval_s=stats_interval(),
            use_markov=markov_enabled(),
        )
        if self.settings.cuts_drafts and getattr(runner, "use_async_scheduling", False):
            # With async scheduling the V1 runner reuses a fixed-width draft tensor and
            # cannot verify per-request prefixes.
            raise ValueError(
                "vllm_dspark: cutting drafts (early-stop threshold "
                f"{self.settings.threshold:g}, or num_speculative_tokens {self.settings.num_draft_tokens} < block "
                f"{self.settings.block_size}) needs synchronous scheduling on the V1 runner; start vLLM with "
                "--no-async-scheduling (LLM(..., async_scheduling=False)), or set the threshold to 0 and "
                "num_speculative_tokens to the block size")
        self.stats = EarlyStopStats()
        self._last_log = time.monotonic()
        self._anchor_ids: torch.Tensor | None = None
        self._last_lengths: torch.Tensor | None = None
        self._last_conf: torch.Tensor | None = None
        self._last_path: str | None = None
        logger.info("vllm_dspark: DSpark proposer ready: %s layout, block %d, keeps %d drafts, "
                    "early-stop threshold %g (%s)%s", cfg.query_layout, self.block,
                    self.settings.num_draft_tokens, self.settings.threshold, self.settings.threshold_source,
                    "" if self.settings.use_markov else ", Markov bias DISABLED (ablation)")

    # ------------------------------------------------------------------ layout
    def set_inputs_first_pass(self, target_token_ids, next_token_ids, target_positions, target_hidden_states,
                              token_indices_to_sample, cad, num_rejected_tokens_gpu):
        self._anchor_ids = next_token_ids
        # Upstream lays out 1 + num_speculative_tokens queries: borrow it for a block of B.
        saved = self.num_speculative_tokens
        self.num_speculative_tokens = self.block - 1
        try:
            num_query_total, indices, new_cad = super().set_inputs_first_pass(
                target_token_ids, next_token_ids, target_positions, target_hidden_states,
                token_indices_to_sample, cad, num_rejected_tokens_gpu)
        finally:
            self.num_speculative_tokens = saved
        if self.anchor_first:  # every query row predicts the token after it
            indices = self.arange[:num_query_total].to(torch.int32)
        if self.settings.trace_path:
            self._anchor_pos = self.positions[:num_query_total].view(-1, self.block)[:, 0].clone()
        return num_query_total, indices, new_cad

    # ------------------------------------------------------------------ Markov stage
    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        from vllm_dspark.ops import last_path, markov_draft

        model = self.model
        n_rows = hidden_states.shape[0]
        d = self.num_speculative_tokens
        batch = n_rows // d
        base = model.compute_logits(hidden_states)[:, : model.vocab_size].view(batch, d, -1)
        conf_base, conf_w = model.confidence_parts(hidden_states)
        if conf_base is not None:
            conf_base = conf_base.view(batch, d)
        anchors = self._anchor_ids[:batch].to(torch.int64)
        temperature, seeds, sampled = self._draft_sampling(sampling_metadata, batch, base.device)
        w2, w2_norms = model.markov_w2, model.markov_w2_row_norms()
        if not self.settings.use_markov:  # the ablation: no bias, rows argmaxed independently
            w2, w2_norms = model.markov_w2_zeros(), torch.zeros_like(w2_norms)
        out = markov_draft(
            base, anchors, model.markov_w1, w2, w2_norms,
            conf_base, conf_w, temperature, seeds, self.settings.threshold, return_logits=sampled)
        self._last_lengths, self._last_conf = out.lengths, out.conf
        self._last_path = last_path()
        if not sampled:
            return out.tokens.reshape(-1), None
        # The op drew token i as argmax(logits_i / T + Gumbel), i.e. from softmax(logits_i / T) with
        # logits_i the Markov-corrected logits given the drafted prefix: exactly the q the target's
        # rejection sampler must see. Greedy requests' rows are never read by it.
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        probs = torch.softmax(out.logits / t[:, None, None], dim=-1)
        return out.tokens.reshape(-1), probs.reshape(batch * d, -1)

    def _draft_sampling(self, sampling_metadata, batch: int, device) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(temperature [R], Gumbel seeds [R], sampled?) for this step's drafts.

        Greedy unless ``draft_sample_method`` is 'probabilistic' and some request samples.
        Seeds come from each seeded request's own generator (reproducible) and from
        torch's global generator otherwise, so every step draws fresh noise.
        """
        zeros = torch.zeros(batch, dtype=torch.float32, device=device)
        seeds = torch.zeros(batch, dtype=torch.int64, device=device)
        temps = getattr(sampling_metadata, "temperature", None)
        if (not self._enable_probabilistic_draft_probs or sampling_metadata.all_greedy or temps is None):
            return zeros, seeds, False
        temperature = temps[:batch].to(device=device, dtype=torch.float32).clamp(min=0.0)
        draws = torch.randint(0, 2 ** 62, (batch,), dtype=torch.int64)
        for i, gen in sampling_metadata.generators.items():
            if i < batch:
                draws[i] = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, generator=gen,
                                         device=gen.device).cpu()[0]
        return temperature, draws.to(device), True

    # ------------------------------------------------------------------ cut + account
    def propose(self, num_speculative_tokens, *args, **kwargs):
        requested = int(num_speculative_tokens)
        self._last_lengths = None
        # Always draft the trained block; cut afterwards.
        drafts = super().propose(self.dspark_config.num_draft_tokens, *args, **kwargs)
        if self._last_lengths is None or drafts.numel() == 0:
            return drafts[:, :requested] if torch.is_tensor(drafts) else drafts
        cap = min(requested, self.settings.num_draft_tokens)
        if not self.settings.cuts_drafts and not self.settings.trace_path:
            # Nothing to cut and nothing to record: no device-to-host copy on this path.
            return drafts[:, :cap] if cap < drafts.shape[1] else drafts
        keep = self._last_lengths.clamp(max=cap).tolist()
        self.stats.add(cap, keep)  # a draft counts as cut when the gate kept fewer than `cap`
        if self.settings.trace_path:
            self._trace(drafts, keep)
        self._maybe_log()
        if cap == drafts.shape[1] and self.settings.threshold == 0.0:
            return drafts
        rows = drafts.tolist()
        return [row[:k] for row, k in zip(rows, keep)]

    def _trace(self, drafts: torch.Tensor, keep: list[int]) -> None:
        n = drafts.shape[0]
        anchors = self._anchor_ids[:n].tolist()
        positions = self._anchor_pos[:n].tolist()
        req_ids = list(self.runner.input_batch.req_ids[:n]) if self.runner is not None else [None] * n
        conf = self._last_conf.tolist() if self._last_conf is not None else None
        with open(self.settings.trace_path, "a") as f:
            for i, row in enumerate(drafts.tolist()):
                f.write(json.dumps({"pid": os.getpid(), "req_id": req_ids[i], "pos": positions[i],
                                    "anchor": anchors[i], "draft": row,
                                    "confidence": conf[i] if conf else None, "kept": keep[i],
                                    "threshold": self.settings.threshold, "path": self._last_path}) + "\n")

    def _maybe_log(self) -> None:
        interval = self.settings.stats_interval_s
        if interval <= 0 or not self.settings.cuts_drafts:
            return
        now = time.monotonic()
        if now - self._last_log >= interval:
            self._last_log = now
            logger.info(self.stats.line())
