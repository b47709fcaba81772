"""The step-cost floor: the target as a minimal Llama in plain PyTorch, and the cells that time it.

The worker process (:mod:`.step_worker`) builds it beside the two engines, on their OpenMP
threads; :mod:`.step_cost` says what the floor is for and how it is checked against vLLM.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.step_common import EngineSpec, classify_op, random_prompts, run_until, typical_mean


class FloorLlama:
    """A Llama checkpoint (HF layout) as a minimal PyTorch forward with a preallocated KV cache.

    Fused QKV and gate/up projections (the same GEMM shapes vLLM runs), RMSNorm in float32 as
    Hugging Face computes it, neox-style RoPE from float32 angles, SDPA with the query heads of a
    KV head folded into the query length (grouped-query attention without copying K/V).

    GEMMs: ``gemm="packed"`` (the default) runs PyTorch's own oneDNN linear on weights packed
    once (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what inductor's
    CPU freezing uses; vLLM's CPU backend packs its weights for oneDNN too), ``"linear"`` plain
    ``F.linear`` (a few tens of microseconds more per small-M call). Switchable per call.
    """

    def __init__(self, target: str, dtype, gemm: str = "packed"):
        import torch
        from safetensors.torch import load_file

        cfg = json.loads((Path(target) / "config.json").read_text())
        if cfg.get("model_type") != "llama" or cfg.get("rope_scaling"):
            raise ValueError("the floor implements plain Llama (no rope scaling)")
        self.cfg = cfg
        self.dtype = dtype
        w = load_file(str(Path(target) / "model.safetensors"))
        c = lambda t: t.to(dtype).contiguous()  # noqa: E731
        self.h = int(cfg["hidden_size"])
        self.nh = int(cfg["num_attention_heads"])
        self.nkv = int(cfg["num_key_value_heads"])
        self.hd = int(cfg.get("head_dim") or self.h // self.nh)
        self.eps = float(cfg["rms_norm_eps"])
        self.nl = int(cfg["num_hidden_layers"])
        self.embed = c(w["model.embed_tokens.weight"])
        self.lm_head = c(w["lm_head.weight"]) if "lm_head.weight" in w else self.embed
        self.norm = c(w["model.norm.weight"])
        self.layers = []
        for i in range(self.nl):
            p = f"model.layers.{i}."
            self.layers.append({
                "ln1": c(w[p + "input_layernorm.weight"]), "ln2": c(w[p + "post_attention_layernorm.weight"]),
                "qkv": c(torch.cat([w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"],
                                    w[p + "self_attn.v_proj.weight"]])),
                "o": c(w[p + "self_attn.o_proj.weight"]),
                "gu": c(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])),
                "down": c(w[p + "mlp.down_proj.weight"]),
            })
        theta = float(cfg.get("rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        pos = torch.arange(int(cfg.get("max_position_embeddings", 8192)), dtype=torch.float32)
        ang = torch.outer(pos, inv)
        emb = torch.cat([ang, ang], dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.vocab = int(cfg["vocab_size"])
        self.gemm = "linear"
        self.packed: dict[int, Any] = {}
        if gemm == "packed":
            try:
                for lw in self.layers:
                    for name in ("qkv", "o", "gu", "down"):
                        self.packed[id(lw[name])] = torch.ops.mkldnn._reorder_linear_weight(lw[name], None)
                self.packed[id(self.lm_head)] = torch.ops.mkldnn._reorder_linear_weight(self.lm_head, None)
                self.gemm = "packed"
            except (RuntimeError, AttributeError):
                self.packed.clear()  # no oneDNN in this torch: plain F.linear

    def linear(self, x, w):
        import torch
        import torch.nn.functional as F

        pk = self.packed.get(id(w)) if self.gemm == "packed" else None
        if pk is None:
            return F.linear(x, w)
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), pk, None, "none", [], "")
        return y.view(*shape[:-1], y.shape[-1])

    def new_cache(self, batch: int, max_len: int):
        import torch

        shape = (self.nl, batch, self.nkv, max_len, self.hd)
        return torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)

    def _rms(self, x, w):
        import torch

        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def _rope(self, x, cos, sin):
        import torch

        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    def forward(self, ids, start: int, cache, all_logits: bool = True):
        """Logits [B, q, V] of ``ids`` [B, q] at positions ``start..start+q-1``; writes their K/V."""
        import torch
        import torch.nn.functional as F

        kc, vc = cache
        b, q = ids.shape
        end = start + q
        g = self.nh // self.nkv
        x = F.embedding(ids, self.embed)
        cos = self.cos[start:end][None, None]  # [1, 1, q, hd]
        sin = self.sin[start:end][None, None]
        if q > 1:
            causal = torch.ones(q, end, dtype=torch.bool).tril(diagonal=start)
            mask = causal.repeat(g, 1)  # [g*q, end]: rows are (query head in group, token)
        else:
            mask = None
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        for i, lw in enumerate(self.layers):
            hdn = self._rms(x, lw["ln1"])
            qkv = self.linear(hdn, lw["qkv"])
            qh = qkv[..., :nq].view(b, q, self.nh, self.hd).transpose(1, 2)
            kh = qkv[..., nq:nq + nk].view(b, q, self.nkv, self.hd).transpose(1, 2)
            vh = qkv[..., nq + nk:].view(b, q, self.nkv, self.hd).transpose(1, 2)
            qh = self._rope(qh, cos, sin)
            kh = self._rope(kh, cos, sin)
            kc[i, :, :, start:end] = kh
            vc[i, :, :, start:end] = vh
            # [B, nkv, g*q, hd]: the g query heads of each KV head one after the other
            qg = qh.reshape(b, self.nkv, g * q, self.hd)
            att = F.scaled_dot_product_attention(qg, kc[i, :, :, :end], vc[i, :, :, :end], attn_mask=mask)
            att = att.view(b, self.nh, q, self.hd).transpose(1, 2).reshape(b, q, nq)
            x = x + self.linear(att, lw["o"])
            hdn = self._rms(x, lw["ln2"])
            gu = self.linear(hdn, lw["gu"])
            inter = gu.shape[-1] // 2
            x = x + self.linear(F.silu(gu[..., :inter]) * gu[..., inter:], lw["down"])
        x = self._rms(x, self.norm)
        if not all_logits:
            x = x[:, -1:]
        return self.linear(x, self.lm_head)


class FloorServer:
    """The floor in the worker process: per-batch caches of ``context`` tokens, timed forwards of ``q`` tokens."""

    def __init__(self, spec: EngineSpec):
        import torch

        self.spec = spec
        self.dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[spec.dtype]
        self.model = FloorLlama(spec.target, self.dtype)
        self.caches: dict[tuple[int, int], Any] = {}
        self.threads = torch.get_num_threads()

    def info(self) -> dict:
        import torch

        return {"kind": "floor", "dtype": self.spec.dtype, "threads": self.threads, "pid": os.getpid(),
                "torch": torch.__version__, "gemm": self.model.gemm}

    def _cache(self, batch: int, context: int):
        import torch

        key = (batch, context)
        if key not in self.caches:
            cache = self.model.new_cache(batch, context + 16)
            ids = torch.tensor(random_prompts(batch, context, self.model.vocab, seed=2000 + batch))
            with torch.inference_mode():
                for s in range(0, context, 256):  # prefill in chunks (bounded memory)
                    self.model.forward(ids[:, s:s + 256], s, cache, all_logits=False)
            self.caches[key] = cache
        return self.caches[key]

    def cell(self, batch: int, q: int, context: int = 288, min_seconds: float = 0.5, min_steps: int = 5,
             warmup: int = 2, max_steps: int = 400, gemm: str | None = None) -> dict:
        self.open_cell(batch, q, context, warmup, gemm)
        try:
            run_until(self.step_cell, min_seconds, min_steps, max_steps)
        finally:
            out = self.close_cell()
        return out

    def open_cell(self, batch: int, q: int, context: int = 288, warmup: int = 2, gemm: str | None = None) -> None:
        import torch

        cache = self._cache(batch, context)
        default = self.model.gemm
        if gemm is not None and self.model.packed:
            self.model.gemm = gemm
        ids = torch.randint(100, self.model.vocab - 100, (batch, q))
        self._run: dict = {"batch": batch, "q": q, "context": context, "cache": cache, "ids": ids,
                           "default_gemm": default, "step_s": []}
        try:
            with torch.inference_mode():
                for _ in range(warmup):
                    self.model.forward(ids, context, cache)
        except BaseException:
            self.model.gemm = default
            raise

    def step_cell(self) -> float:
        """One forward of the open cell, always at the same context (the cache is written in place)."""
        import torch

        run = self._run
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.model.forward(run["ids"], run["context"], run["cache"])
            dt = time.perf_counter() - t0
        run["step_s"].append(dt)
        return dt

    def close_cell(self) -> dict:
        run, self._run = self._run, {}
        used = self.model.gemm
        self.model.gemm = run["default_gemm"]
        times = run["step_s"]
        return {"batch": run["batch"], "tokens_per_request": run["q"], "steps": len(times), "step_s": times,
                "median_s": statistics.median(times) if times else float("nan"), "context": run["context"],
                "gemm": used}

    def profile(self, batch: int, q: int, context: int = 288, steps: int = 4) -> dict:
        import torch
        from torch.profiler import ProfilerActivity, profile

        cache = self._cache(batch, context)
        ids = torch.randint(100, self.model.vocab - 100, (batch, q))
        per_step: list[dict] = []
        walls: list[float] = []
        with torch.inference_mode():
            self.model.forward(ids, context, cache)
            for _ in range(steps):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    t0 = time.perf_counter()
                    self.model.forward(ids, context, cache)
                    walls.append(time.perf_counter() - t0)
                ops: dict[str, float] = {}
                for ev in prof.events():
                    key = classify_op(ev.name)
                    ops[key] = ops.get(key, 0.0) + ev.self_cpu_time_total * 1e-6
                per_step.append(ops)
        out = typical_mean(per_step, walls)
        wall = statistics.median(walls)
        # The LM head is one GEMM of [B*q, H] x [H, V]; time it alone to split GEMM into layers / logits.
        x = torch.randn(batch * q, self.model.h, dtype=self.dtype)
        with torch.inference_mode():
            self.model.linear(x, self.model.lm_head)
            t0 = time.perf_counter()
            for _ in range(steps):
                self.model.linear(x, self.model.lm_head)
            out["logits (lm head alone)"] = (time.perf_counter() - t0) / steps
        return {"batch": batch, "q": q, "profiled_step_s": wall,
                "ops": dict(sorted(out.items(), key=lambda kv: -kv[1]))}

    def logits(self, context_ids: list[int], ids: list[int], one_at_a_time: bool = False) -> list[list[float]]:
        """Logits of ``ids`` after ``context_ids`` (batch 1): one forward of len(ids) tokens, or one per token."""
        import torch

        cache = self.model.new_cache(1, len(context_ids) + len(ids) + 1)
        with torch.inference_mode():
            ctx = torch.tensor([context_ids])
            for s in range(0, len(context_ids), 256):
                self.model.forward(ctx[:, s:s + 256], s, cache, all_logits=False)
            t = torch.tensor([ids])
            if one_at_a_time:
                rows = [self.model.forward(t[:, j:j + 1], len(context_ids) + j, cache)[0, 0]
                        for j in range(len(ids))]
                out = torch.stack(rows)
            else:
                out = self.model.forward(t, len(context_ids), cache)[0]
        return out.float().tolist()
