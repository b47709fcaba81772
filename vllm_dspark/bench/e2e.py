"""End-to-end measurements with vLLM: one engine per configuration, several workloads each.

A "batch size" B means B requests in flight: prompts are submitted in waves of
B to one engine (``max_num_seqs`` >= B), so batch 1 is plain sequential decode.
Every number comes from the same run; speed is reported as a ratio to the
no-speculation engine measured in that run.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dspark.testing.engine import acceptance_summary, llm_engine, read_trace, spec_metrics


@dataclass
class EngineConfig:
    name: str
    speculative_config: dict | None = None
    env: dict = field(default_factory=dict)


def standard_configs(draft: str, block: int, threshold: float = 0.3) -> list[EngineConfig]:
    """The configurations of the side-by-side benchmark."""
    dspark = {"method": "dspark", "model": draft, "num_speculative_tokens": block}
    return [
        EngineConfig("no-spec"),
        EngineConfig("ngram", {"method": "ngram", "num_speculative_tokens": block,
                               "prompt_lookup_max": 4, "prompt_lookup_min": 2}),
        EngineConfig("dspark-no-markov", dspark, {"VLLM_DSPARK_DISABLE_MARKOV": "1"}),
        EngineConfig("dspark", dspark),
        EngineConfig(f"dspark-early-stop-{threshold:g}", dspark,
                     {"VLLM_DSPARK_CONFIDENCE_THRESHOLD": str(threshold)}),
        # Drafts sampled at the request's temperature (greedy requests still draft greedily).
        EngineConfig("dspark-probabilistic", {**dspark, "draft_sample_method": "probabilistic"}),
    ]


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] if isinstance(r, dict) else str(r) for r in rows]
    return prompts[:limit] if limit else prompts


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k, 0)
        out[k] = [x - y for x, y in zip(v, b or [0] * len(v))] if isinstance(v, list) else v - (b or 0)
    return out


def early_stop_stats(trace: list[dict], block: int) -> dict:
    if not trace:
        return {}
    kept = [r["kept"] for r in trace]
    return {
        "draft_steps": len(kept),
        "cut_fraction": sum(k < block for k in kept) / len(kept),
        "mean_kept": sum(kept) / len(kept),
        "empty_fraction": sum(k == 0 for k in kept) / len(kept),
    }


def run_engine(target: str, cfg: EngineConfig, prompts: list[str], *, batch_sizes=(1,), temperatures=(0.0,),
               max_tokens: int = 64, max_model_len: int = 2048, dtype: str = "bfloat16", block: int = 7,
               log=print) -> list[dict]:
    """Start one engine for ``cfg`` and measure every (batch size, temperature) workload on it."""
    from vllm import SamplingParams

    results = []
    trace_dir = tempfile.mkdtemp(prefix="dspark-bench-")
    trace = os.path.join(trace_dir, "trace.jsonl")
    env = dict(cfg.env)
    if cfg.speculative_config and cfg.speculative_config.get("method") == "dspark":
        env["VLLM_DSPARK_TRACE"] = trace
    t0 = time.monotonic()
    with llm_engine(target, speculative_config=cfg.speculative_config, env=env, dtype=dtype,
                    max_model_len=max_model_len, max_num_seqs=max(batch_sizes)) as llm:
        log(f"[{cfg.name}] engine up in {time.monotonic() - t0:.0f} s")
        # Warm-up: the first steps pay for lazy initialisation.
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        for temp in temperatures:
            for bs in batch_sizes:
                if os.path.exists(trace):
                    os.remove(trace)
                before = spec_metrics(llm)
                params = SamplingParams(max_tokens=max_tokens, temperature=temp, seed=1234 if temp > 0 else None,
                                        ignore_eos=True)
                outputs = []
                start = time.perf_counter()
                for i in range(0, len(prompts), bs):
                    outs = llm.generate(prompts[i:i + bs], params, use_tqdm=False)
                    outputs += [list(o.outputs[0].token_ids) for o in outs]
                seconds = time.perf_counter() - start
                tokens = sum(len(t) for t in outputs)
                row = {"config": cfg.name, "batch_size": bs, "temperature": temp, "requests": len(prompts),
                       "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                       "outputs": outputs}
                if cfg.speculative_config:
                    row.update(acceptance_summary(_delta(spec_metrics(llm), before)))
                    row.update(early_stop_stats(read_trace(trace), block))
                results.append(row)
                log(f"[{cfg.name}] batch {bs} T={temp}: {row['tokens_per_s']:.1f} tok/s"
                    + (f", acceptance length {row['mean_acceptance_length']:.2f}"
                       if "mean_acceptance_length" in row else ""))
    return results
