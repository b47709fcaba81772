"""End-to-end measurements with vLLM: one engine per configuration, several workloads each.

A "concurrency" C means C requests in flight: prompts are submitted in waves
of C to one engine (``max_num_seqs`` >= C), so C = 1 is plain sequential
decoding. Requests generate until the end of the assistant's turn (EOS), with
``max_tokens`` as a cap: tokens a target writes after its own end of turn are
repetitive and easy to draft, and would flatter every acceptance figure.
``ignore_eos=True`` restores fixed-length generation (for step-time work). Every number comes from
the same run; speed is reported as a ratio to the no-speculation engine
measured in that run.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.engine import acceptance_summary, dspark_report, llm_engine, read_trace, spec_metrics


@dataclass
class EngineConfig:
    name: str
    speculative_config: dict | None = None
    env: dict = field(default_factory=dict)


@dataclass
class Pair:
    """A target, its DSpark drafter, the DFlash-style ablation (if trained) and prompt sets."""

    name: str
    target: str
    draft: str
    ablation: str | None
    datasets: dict[str, list]  # name -> prompts (strings, or token-id lists)
    dtype: str = "float32"
    max_model_len: int = 2048


def default_pair(num_prompts: int | None = None) -> Pair:
    """SmolLM2-135M-Instruct + the shipped drafters; chat set and HumanEval, chat-templated."""
    from transformers import AutoTokenizer

    from training.pipeline.chat_prompts import chat_eval_prompts, copy_eval_prompts, humaneval_prompts
    from vllm_dspark.tools import default_pair as dp

    paths = dp.default_paths()
    tok = AutoTokenizer.from_pretrained(paths["target"])

    def chat(prompts):
        return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                        tokenize=False) for p in prompts]

    from training.pipeline import ABLATION_DIR as ablation
    return Pair("smollm2", paths["target"], paths["draft"],
                str(ablation) if (ablation / "config.json").is_file() else None,
                {"chat": chat(chat_eval_prompts(num_prompts)), "humaneval": chat(humaneval_prompts(num_prompts)),
                 "copy": chat(copy_eval_prompts(num_prompts))})


def toy_pair(num_prompts: int | None = None) -> Pair:
    """The earlier bundled toy pair (19M Qwen3 on the standard library), now a test fixture."""
    root = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "toy_pair"
    if not (root / "drafter" / "config.json").is_file():
        raise FileNotFoundError(f"the toy pair is a repository fixture ({root}); run from a clone")
    return Pair("toy", str(root / "target"), str(root / "drafter"), None,
                {"code": load_prompts(root / "prompts_heldout.jsonl", num_prompts)}, dtype="float32")


def dspark_spec(draft: str, block: int = 7, **dspark) -> dict:
    spec = {"method": "dspark", "model": draft, "num_speculative_tokens": block}
    if dspark:
        spec["dspark"] = dict(dspark)
    return spec


def standard_configs(pair: Pair, block: int = 7) -> list[EngineConfig]:
    """No speculation, n-gram, the DFlash-style ablation, DSpark (defaults: the copy source on), DSpark with
    the copy off, and DSpark's drafter verifying every draft."""
    out = [EngineConfig("no-spec"),
           EngineConfig("ngram", {"method": "ngram", "num_speculative_tokens": block, "prompt_lookup_max": 4,
                                  "prompt_lookup_min": 2})]
    if pair.ablation:
        out.append(EngineConfig("dflash-ablation", dspark_spec(pair.ablation, block)))
    out.append(EngineConfig("dspark", dspark_spec(pair.draft, block)))  # the defaults: the copy source on
    out.append(EngineConfig("dspark-copy-off", dspark_spec(pair.draft, block, copy="off")))
    # Every draft verified: the drafter's acceptance, which the budget's selectivity cannot flatter
    # (so the drafter alone, no copy), and the fixed length the budget's speed is held against.
    out.append(EngineConfig("dspark-fixed", dspark_spec(pair.draft, block, verification="fixed", copy="off")))
    return out


def draft_vocab_configs(pair: Pair, block: int = 7, sizes=(4096, 8192, 16384, 32768)) -> list[EngineConfig]:
    """Issue 31's comparison: the serve-time draft vocabulary at each size against the full one, every
    draft verified (the acceptance a smaller vocabulary costs), and the budget's default (``draft_vocab:
    auto``) beside the budget over the full vocabulary; the drafter alone (``copy: off``)."""
    out = [EngineConfig("no-spec"),
           EngineConfig("fixed-full", dspark_spec(pair.draft, block, verification="fixed", draft_vocab="off",
                                                  copy="off"))]
    out += [EngineConfig(f"fixed-v{n}", dspark_spec(pair.draft, block, verification="fixed", draft_vocab=n, copy="off"))
            for n in sizes]
    out += [EngineConfig("dspark-full", dspark_spec(pair.draft, block, draft_vocab="off", copy="off")),
            EngineConfig("dspark", dspark_spec(pair.draft, block, copy="off"))]
    return out


def never_lose_configs(pair: Pair, never_accepted: str, block: int = 7) -> list[EngineConfig]:
    """Issue 18's comparison: where DSpark cannot help it must not lose (a confidently wrong drafter
    under the default settings), and where speculation pays (n-gram) it must be kept."""
    return [EngineConfig("no-spec"),
            EngineConfig("ngram", {"method": "ngram", "num_speculative_tokens": block, "prompt_lookup_max": 4,
                                   "prompt_lookup_min": 2}),
            EngineConfig("never-accepted", dspark_spec(never_accepted, block)),
            EngineConfig("dspark", dspark_spec(pair.draft, block))]


def verification_configs(pair: Pair, block: int = 7, product: float = 0.3, threshold: float = 0.5
                         ) -> list[EngineConfig]:
    """Issue 10's comparison: fixed lengths, the two threshold rules, budgeted verification, on the drafter's
    drafts alone (``copy: off``)."""
    out = [EngineConfig("no-spec")]
    for k in (1, 3, block):
        out.append(EngineConfig(f"fixed-{k}", dspark_spec(pair.draft, k, verification="fixed", copy="off")))
    out += [EngineConfig(f"product-{product:g}", dspark_spec(pair.draft, block, verification="product",
                                                             threshold=product, copy="off")),
            EngineConfig(f"threshold-{threshold:g}", dspark_spec(pair.draft, block, verification="threshold",
                                                                 threshold=threshold, copy="off")),
            EngineConfig("budget", dspark_spec(pair.draft, block, verification="budget", copy="off"))]
    return out


def pair_block(report: dict) -> int:
    return int(report["settings"]["num_draft_tokens"])


def calibration(records: list[dict], positions: int, bins: int = 10) -> dict:
    """The confidence head on this workload: predicted vs measured conditional acceptance.

    From the proposer's acceptance records: position j of a verified draft was
    reached when every earlier draft was accepted, and is a hit when it was
    accepted too. Per position and per confidence bin, with the expected
    calibration error (bin-count-weighted mean |predicted - measured|).
    """
    import numpy as np

    pc, ph, ps = np.zeros(positions), np.zeros(positions), np.zeros(positions)
    bc, bh, bs = np.zeros(bins), np.zeros(bins), np.zeros(bins)
    for r in records:
        conf, k, a = r["confidence"], r["verified"], r["accepted"]
        for j in range(min(a, k - 1) + 1):
            c = float(conf[j])
            hit = 1.0 if j < a else 0.0
            b = min(bins - 1, int(c * bins))
            pc[j] += 1
            ph[j] += hit
            ps[j] += c
            bc[b] += 1
            bh[b] += hit
            bs[b] += c
    total = bc.sum()
    ece = float((np.abs(bs - bh)).sum() / total) if total else float("nan")
    return {"positions": {"count": pc.tolist(), "predicted": (ps / np.maximum(pc, 1)).tolist(),
                          "measured": (ph / np.maximum(pc, 1)).tolist()},
            "bins": {"count": bc.tolist(), "predicted": (bs / np.maximum(bc, 1)).tolist(),
                     "measured": (bh / np.maximum(bc, 1)).tolist()},
            "ece": ece}


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] if isinstance(r, dict) else str(r) for r in rows]
    return prompts[:limit] if limit else prompts


def _delta(after: dict, before: dict) -> dict:
    out: dict = {}
    for k, v in after.items():
        b = before.get(k, 0)
        if isinstance(v, dict):
            out[k] = _delta(v, b or {})
        elif isinstance(v, list):
            b = list(b or [])
            out[k] = [x - y for x, y in zip(v, b + [0] * (len(v) - len(b)))]
        elif isinstance(v, (int, float)):
            out[k] = v - (b or 0)
        else:
            out[k] = v
    return out


def _inputs(prompts: list) -> list:
    return [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]


def _cells(datasets: dict[str, list], temperatures, concurrencies, prompts_per_cell):
    """(dataset, temperature, concurrency, prompts) of every cell, in the order both runners measure. A set
    smaller than its cell repeats (a queue of 4 x 32 requests from the 16 copy-heavy prompts), alike for
    every configuration."""
    for ds, prompts in datasets.items():
        for temp in temperatures:
            for c in concurrencies:
                n = prompts_per_cell(c) if prompts_per_cell else len(prompts)
                yield ds, temp, c, (prompts * -(-n // max(1, len(prompts))))[:n]


def _params(max_tokens: int, temp: float, ignore_eos: bool = False):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temp, seed=1234 if temp > 0 else None,
                          ignore_eos=ignore_eos)


def _generate(llm, cell: list, c: int, params) -> tuple[list[list[int]], float]:
    """The cell's prompts ``c`` at a time: (output token ids per prompt, seconds).

    The prefix cache is emptied first. Repeats send the same prompts again, and without a
    speculator vLLM reuses their cached blocks; with a hidden-state drafter (EAGLE, DFlash,
    DSpark) it drops the last cached block of every hit (``use_eagle_block_drop``): on CPU a
    block holds 128 tokens, so a prompt under 256 tokens never hits. Kept, the repeats would
    time prefix-cache hits on one side and prefill on the other (at C = 32 on HumanEval that
    was the whole gap between no speculation and a DSpark step that drafts nothing), not the
    decoding the benchmark compares.
    """
    outputs: list[list[int]] = []
    llm.reset_prefix_cache()
    start = time.perf_counter()
    for i in range(0, len(cell), c):
        outs = llm.generate(_inputs(cell[i:i + c]), params, use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in outs]
    return outputs, time.perf_counter() - start


def run_engine(pair: Pair, cfg: EngineConfig, datasets: dict[str, list], *, concurrencies=(1,),
               temperatures=(0.0,), max_tokens: int = 256, prompts_per_cell=None, log=print,
               max_num_seqs: int | None = None, ignore_eos: bool = False) -> list[dict]:
    """Start one engine for ``cfg`` and measure every (dataset, concurrency, temperature) cell.

    ``prompts_per_cell(c)`` bounds the prompts of a cell (default: all); outputs of
    the same cell are comparable across configurations because every
    configuration sees the same prompts and sampling parameters.
    """
    results = []
    trace_dir = tempfile.mkdtemp(prefix="dspark-bench-")
    trace = os.path.join(trace_dir, "trace.jsonl")
    env = dict(cfg.env)
    spec = cfg.speculative_config
    if spec and spec.get("method") == "dspark":
        spec = {**spec, "dspark": {**spec.get("dspark", {}), "trace": trace}}
    t0 = time.monotonic()
    with llm_engine(pair.target, speculative_config=spec, env=env, dtype=pair.dtype,
                    max_model_len=pair.max_model_len, max_num_seqs=max_num_seqs or max(concurrencies)) as llm:
        log(f"[{cfg.name}] engine up in {time.monotonic() - t0:.0f} s")
        warm = next(iter(datasets.values()))[:2]
        llm.generate(_inputs(warm), _params(8, 0.0), use_tqdm=False)
        for ds, temp, c, cell in _cells(datasets, temperatures, concurrencies, prompts_per_cell):
            if os.path.exists(trace):
                os.remove(trace)
            before = spec_metrics(llm)
            rep0 = dspark_report(llm) if spec and spec.get("method") == "dspark" else None
            outputs, seconds = _generate(llm, cell, c, _params(max_tokens, temp, ignore_eos))
            tokens = sum(len(t) for t in outputs)
            row = {"pair": pair.name, "config": cfg.name, "dataset": ds, "concurrency": c,
                   "temperature": temp, "requests": len(cell), "output_tokens": tokens,
                   "seconds": seconds, "tokens_per_s": tokens / seconds, "outputs": outputs}
            if spec:
                row.update(acceptance_summary(_delta(spec_metrics(llm), before)))
            if rep0 is not None:
                rep = dspark_report(llm)
                assert rep is not None  # the same engine answered for rep0
                row["dspark"] = {k: _delta(rep[k], rep0[k]) for k in ("stats", "timings_s")}
                row["dspark"]["calibration"] = calibration(read_trace(trace, "acceptance"),
                                                           pair_block(rep))
            results.append(row)
            log(f"[{cfg.name}] {ds} C={c} T={temp:g}: {row['tokens_per_s']:.1f} tok/s"
                + (f", acceptance length {row['mean_acceptance_length']:.2f}"
                   if "mean_acceptance_length" in row else ""))
    return results


def proposer_acceptance(stats: dict) -> dict:
    """Acceptance from the DSpark proposer's counters (the same definitions as vLLM's spec-decode metrics)."""
    drafts = stats.get("drafts_observed", 0)
    per_pos = stats.get("accepted_per_position", [])
    return {"num_drafts": drafts, "num_draft_tokens": stats.get("tokens_verified_observed", 0),
            "num_accepted_tokens": stats.get("tokens_accepted", 0),
            "mean_acceptance_length": 1.0 + stats.get("tokens_accepted", 0) / drafts if drafts else float("nan"),
            "per_position_acceptance": [a / drafts for a in per_pos] if drafts else []}


def _is_dspark(configs: list[EngineConfig], name: str) -> bool:
    spec = next(c for c in configs if c.name == name).speculative_config
    return spec is not None and spec.get("method") == "dspark"


def repeats_row(pair: Pair, name: str, ds: str, c: int, temp: float, requests: int, rates: list[float]) -> dict:
    """The fields of a cell's row that every repeated runner gives: what ran, each repeat's tokens/s,
    their median and spread."""
    import statistics

    return {"pair": pair.name, "config": name, "dataset": ds, "concurrency": c, "temperature": temp,
            "requests": requests, "repeats": [round(x, 2) for x in rates], "tokens_per_s": statistics.median(rates),
            "spread": [min(rates), max(rates)]}


def run_interleaved(pair: Pair, configs: list[EngineConfig], datasets: dict[str, list], *, concurrencies=(1,),
                    temperatures=(0.0,), max_tokens: int = 256, repeats: int = 3, prompts_per_cell=None,
                    log=print, kv_cache_gib: int = 2, ignore_eos: bool = False) -> list[dict]:
    """Every configuration's engine alive at once; each cell measured ``repeats`` times, interleaved.

    Per cell the engines run in turn (A B C, then B C A, ...), so drift of this
    shared machine hits every configuration alike. A row holds each repeat's
    tokens/s, their median (``tokens_per_s``) and spread, and, against the
    no-spec engine, the median of the per-repeat speed-ups with their spread.
    Acceptance counts cover all repeats; ``outputs`` are the first repeat's.
    """
    import contextlib
    import statistics

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    with contextlib.ExitStack() as stack:
        engines = {}
        for cfg in configs:
            t0 = time.monotonic()
            # A served name of its own: the engines share this process's metrics registry.
            engines[cfg.name] = stack.enter_context(llm_engine(
                pair.target, speculative_config=cfg.speculative_config, env=dict(cfg.env), dtype=pair.dtype,
                max_model_len=pair.max_model_len, max_num_seqs=max(concurrencies), served_model_name=cfg.name))
            log(f"[{cfg.name}] engine up in {time.monotonic() - t0:.0f} s")
        warm = next(iter(datasets.values()))[:2]
        for llm in engines.values():
            llm.generate(_inputs(warm), _params(8, 0.0), use_tqdm=False)
        rows = []
        for ds, temp, c, cell in _cells(datasets, temperatures, concurrencies, prompts_per_cell):
            params = _params(max_tokens, temp, ignore_eos)
            reports0 = {n: dspark_report(engines[n]) for n in engines if _is_dspark(configs, n)}
            rates: dict[str, list[float]] = {n: [] for n in engines}
            outputs: dict[str, list] = {}
            tokens: dict[str, int] = {}
            names = list(engines)
            for rep in range(repeats):
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    outs, seconds = _generate(engines[name], cell, c, params)
                    n_tok = sum(len(t) for t in outs)
                    rates[name].append(n_tok / seconds)
                    outputs.setdefault(name, outs)
                    tokens[name] = tokens.get(name, 0) + n_tok
            base = rates.get("no-spec")
            for name, cfg in ((n, next(c_ for c_ in configs if c_.name == n)) for n in names):
                r = rates[name]
                row = {**repeats_row(pair, name, ds, c, temp, len(cell), r),
                       "output_tokens": tokens[name], "outputs": outputs[name]}
                if base is not None:
                    ratios = [a / b for a, b in zip(r, base, strict=True)]
                    row["speedup_median"] = statistics.median(ratios)
                    row["speedup_spread"] = [min(ratios), max(ratios)]
                if name in reports0:
                    # vLLM's metrics registry is one per process and holds the last engine
                    # built: acceptance comes from the proposer's own counters.
                    now, was = dspark_report(engines[name]), reports0[name]
                    assert now is not None and was is not None
                    row["dspark"] = {k: _delta(now[k], was[k]) for k in ("stats", "timings_s")}
                    row.update(proposer_acceptance(row["dspark"]["stats"]))
                elif cfg.speculative_config:
                    row["acceptance_note"] = "not measured: several engines share this process's metrics"
                rows.append(row)
                log(f"[{name}] {ds} C={c} T={temp:g}: {row['tokens_per_s']:.1f} tok/s "
                    f"(repeats {', '.join(f'{x:.1f}' for x in r)})"
                    + (f", speed-up {row['speedup_median']:.2f}x" if "speedup_median" in row else "")
                    + (f", acceptance length {row['mean_acceptance_length']:.2f}"
                       if "mean_acceptance_length" in row else ""))
    return rows
