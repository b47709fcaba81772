#!/usr/bin/env python
"""Bounded load and fault test of ``vllm serve`` with DSpark, against the same server without speculation.

    .venv/bin/python benchmarks/load_test.py                       # the default pair (vllm-dspark default)
    .venv/bin/python benchmarks/load_test.py --tiny --requests 48  # a tiny random pair built in seconds

For each configuration (DSpark first, then no speculation) the script starts ``vllm serve`` on
127.0.0.1 (a free port), in float32 (greedy decoding is then exactly lossless on a CPU), and
drives it with ``--clients`` concurrent streaming clients (httpx, asyncio) over the same request
mix (``--seed``):

* chat prompts (``chat_eval_prompts()``) and HumanEval problems (``humaneval_prompts()``),
  greedy or seeded sampled (temperature 0.8, top-p 0.95), ``max_tokens`` from 16 to 192, some
  with stop strings, some long seeded prompts split over several prefill steps (the CPU
  generator crash the plugin patches);
* a share of clients that disconnect after a few chunks;
* bad requests: malformed JSON, negative ``max_tokens``, temperature out of range, top-p out of
  range, an unknown model, a prompt longer than ``max_model_len``.

Afterwards: the server must still answer a request, ``/metrics`` must be readable, and the
process must be alive. Every loop is bounded in count and time (``--phase-timeout`` per
configuration, ``--request-timeout`` per request, ``--start-timeout`` per server start).

Written to ``--out`` (default ``reports/load_test``): ``results.json`` (every request, without its
tokens and chunk timings), ``report.md`` and ``latency.png``. Exit status 0 only if there were no
server errors (5xx, client exceptions, server deaths), every greedy request that completed on both
servers gave the same tokens, every bad request got a 4xx, and each server still served at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout: the training pipeline's prompt sets and the tests' tiny pair
SERVED_NAME = "target"


# ------------------------------------------------------------------ the request mix
@dataclass
class Job:
    idx: int
    kind: str  # "greedy" | "sampled" | "bad"
    source: str  # "chat" | "humaneval" | "long" | bad-case name
    body: dict | None = None  # JSON body (None for a raw body)
    raw: bytes | None = None
    disconnect_after: int | None = None  # chunks to read before closing the connection


def _long_prompt(texts: list[str], rng: random.Random, chars: int) -> str:
    out = []
    while sum(len(t) for t in out) < chars:
        out.append(rng.choice(texts))
    return "Summarise the following notes in one sentence.\n\n" + "\n\n".join(out)[:chars]


def build_mix(n: int, seed: int, api: str, max_model_len: int, disconnect_share: float,
              long_chars: int = 5000) -> list[Job]:
    from training.pipeline.chat_prompts import chat_eval_prompts, humaneval_prompts

    rng = random.Random(seed)
    chat, code = chat_eval_prompts(), humaneval_prompts()
    jobs: list[Job] = []

    def body(prompt: str, **sampling) -> dict:
        common = {"model": SERVED_NAME, "stream": True, "stream_options": {"include_usage": True},
                  "return_token_ids": True, **sampling}
        if api == "chat":
            return {"messages": [{"role": "user", "content": prompt}], **common}
        return {"prompt": prompt, **common}

    for i in range(n):
        r = rng.random()
        if r < 0.6:
            source, prompt, stops = "chat", rng.choice(chat), ["\n\n"]
        elif r < 0.9:
            source, prompt, stops = "humaneval", rng.choice(code), ["\ndef ", "\n```"]
        else:  # long (about 1,500 tokens): split over several prefill steps
            source, prompt, stops = "long", _long_prompt(chat + code, rng, long_chars), ["\n\n"]
        sampled = source == "long" or rng.random() < 0.4
        sampling = {"max_tokens": rng.choice([16, 32, 64, 96, 128, 192])}
        if sampled:
            sampling.update(temperature=0.8, top_p=0.95, seed=1000 + i)
        else:
            sampling.update(temperature=0.0)
        if rng.random() < 0.35:
            sampling["stop"] = stops
        disconnect = rng.randint(1, 4) if rng.random() < disconnect_share else None
        jobs.append(Job(i, "sampled" if sampled else "greedy", source, body(prompt, **sampling),
                        disconnect_after=disconnect))

    too_long = "hello " * (max_model_len * 2)
    ok = body("Say hi.", max_tokens=8, temperature=0.0)
    bad = [
        ("malformed_json", None, b'{"model": "target", "messages": [{"role": "user", "content": "hi"'),
        ("negative_max_tokens", {**ok, "max_tokens": -5}, None),
        ("temperature_out_of_range", {**ok, "temperature": -1.0}, None),
        ("top_p_out_of_range", {**ok, "top_p": 1.5}, None),
        ("unknown_model", {**ok, "model": "no-such-model"}, None),
        ("prompt_longer_than_max_model_len", body(too_long, max_tokens=8, temperature=0.0), None),
    ]
    # Spread the bad requests through the load so that they meet a busy server.
    for k, (name, b, raw) in enumerate(bad):
        jobs.insert(min(len(jobs), (k + 1) * len(jobs) // (len(bad) + 1)),
                    Job(-1, "bad", name, b, raw))
    for i, j in enumerate(jobs):
        j.idx = i
    return jobs


# ------------------------------------------------------------------ the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, target: str, draft: str | None, args, log_path: Path):
        self.name, self.log_path = name, log_path
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        vllm = str(Path(sys.executable).with_name("vllm"))
        self.cmd = [vllm, "serve", target, "--host", "127.0.0.1", "--port", str(self.port),
                    "--served-model-name", SERVED_NAME, "--dtype", "float32",
                    "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
                    "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--enforce-eager",
                    "--seed", "0", "--disable-uvicorn-access-log"]
        if draft:
            spec = {"method": "dspark", "model": draft, "num_speculative_tokens": args.num_speculative_tokens}
            self.cmd += ["--speculative-config", json.dumps(spec)]
        self.env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib), TOKENIZERS_PARALLELISM="false")
        self.proc: subprocess.Popen | None = None
        self.died: int | None = None

    def start(self, timeout: float) -> float:
        import httpx

        t0 = time.monotonic()
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: vllm serve exited with {self.proc.returncode} while starting; "
                                   f"see {self.log_path}:\n{self.tail()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise RuntimeError(f"{self.name}: vllm serve not healthy after {timeout:.0f} s; see {self.log_path}")
            time.sleep(1)

    def alive(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None and self.died is None:
            self.died = self.proc.returncode
        return self.died is None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.alive()
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self._log.close()

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


# ------------------------------------------------------------------ the clients
@dataclass
class Result:
    idx: int
    kind: str
    source: str
    status: int | None = None
    error: str | None = None  # client-side exception
    message: str | None = None  # the server's error message (non-200)
    disconnected: bool = False
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    ttft_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # seconds since send, token-bearing chunks
    chunk_tokens: list[int] = field(default_factory=list)
    latency_s: float | None = None
    skipped: bool = False  # not sent before the phase deadline


# A record keeps what its summaries are made of; tokens, texts and chunk timings of every request
# made the results 370 KB (the greedy comparison is made before they are dropped).
HEAVY_FIELDS = ("token_ids", "text", "chunk_times", "chunk_tokens")


def slim_result(r: Result) -> dict:
    d = {k: v for k, v in asdict(r).items() if k not in HEAVY_FIELDS}
    d["tokens"] = len(r.token_ids)
    return d


def _endpoint(api: str) -> str:
    return "/v1/chat/completions" if api == "chat" else "/v1/completions"


def _parse_error(body: bytes) -> str:
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return body[:300].decode(errors="replace")
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:500]
    return str(err)[:500]


async def run_job(client, base: str, api: str, job: Job, timeout: float) -> Result:
    res = Result(job.idx, job.kind, job.source)
    url = base + _endpoint(api)
    t0 = time.perf_counter()
    content = job.raw if job.raw is not None else json.dumps(job.body).encode()
    try:
        async with client.stream("POST", url, content=content, headers={"Content-Type": "application/json"},
                                 timeout=timeout) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.message = _parse_error(await resp.aread())
                return res
            chunks = 0
            async for line in resp.aiter_lines():
                if time.perf_counter() - t0 > timeout:
                    raise TimeoutError(f"stream still open after {timeout:.0f} s")
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:  # an error inside the stream (the server hit a problem mid-request)
                    res.message = _parse_error(data.encode())
                    res.error = f"error event in stream: {res.message}"
                    break
                for ch in obj.get("choices") or []:
                    ids = ch.get("token_ids") or []
                    if api == "chat":
                        res.text += (ch.get("delta") or {}).get("content") or ""
                    else:
                        res.text += ch.get("text") or ""
                    if ids:
                        now = time.perf_counter() - t0
                        if res.ttft_s is None:
                            res.ttft_s = now
                        res.chunk_times.append(now)
                        res.chunk_tokens.append(len(ids))
                        res.token_ids += ids
                        chunks += 1
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
                if job.disconnect_after is not None and chunks >= job.disconnect_after:
                    res.disconnected = True
                    break  # leaving the block closes the connection mid-stream
        res.latency_s = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - every client-side failure is reported
        res.error = f"{type(exc).__name__}: {exc}"[:500]
    return res


async def run_phase(base: str, api: str, jobs: list[Job], clients: int, phase_timeout: float,
                    request_timeout: float) -> tuple[list[Result], float]:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        queue.put_nowait(j)
    results: list[Result] = []
    deadline = time.monotonic() + phase_timeout
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients)

    async def worker(client) -> None:
        while True:
            try:
                job = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            left = deadline - time.monotonic()
            if left <= 5:
                results.append(Result(job.idx, job.kind, job.source, skipped=True))
                continue
            results.append(await run_job(client, base, api, job, min(request_timeout, left)))

    t0 = time.monotonic()
    async with httpx.AsyncClient(limits=limits, timeout=request_timeout) as client:
        await asyncio.wait_for(asyncio.gather(*(worker(client) for _ in range(clients))),
                               timeout=phase_timeout + request_timeout + 30)
    return sorted(results, key=lambda r: r.idx), time.monotonic() - t0


def final_checks(base: str, api: str) -> dict:
    import httpx

    out: dict = {}
    body = {"model": SERVED_NAME, "max_tokens": 16, "temperature": 0.0}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": "What is 2 + 2?"}]
    else:
        body["prompt"] = "2 + 2 ="
    try:
        r = httpx.post(base + _endpoint(api), json=body, timeout=120)
        out["final_request_status"] = r.status_code
        choice = r.json()["choices"][0] if r.status_code == 200 else {}
        text = (choice.get("message") or {}).get("content") if api == "chat" else choice.get("text")
        out["final_request_text"] = text
        out["final_request_ok"] = r.status_code == 200 and bool(out["final_request_text"] is not None)
    except Exception as exc:  # noqa: BLE001
        out["final_request_ok"], out["final_request_error"] = False, f"{type(exc).__name__}: {exc}"
    try:
        r = httpx.get(base + "/metrics", timeout=30)
        text = r.text
        metrics: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                key = name.split("{")[0]
                try:
                    metrics[key] = metrics.get(key, 0.0) + float(value)
                except ValueError:
                    continue
        out["metrics_ok"] = r.status_code == 200 and any(k.startswith("vllm:") for k in metrics)
        keep = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                "vllm:spec_decode_num_accepted_tokens_total", "vllm:num_requests_running",
                "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
        out["metrics"] = {k: metrics[k] for k in keep if k in metrics}
        d = metrics.get("vllm:spec_decode_num_drafts_total", 0.0)
        if d:
            out["mean_acceptance_length"] = 1 + metrics.get("vllm:spec_decode_num_accepted_tokens_total", 0.0) / d
    except Exception as exc:  # noqa: BLE001
        out["metrics_ok"], out["metrics_error"] = False, f"{type(exc).__name__}: {exc}"
    return out


# ------------------------------------------------------------------ analysis
def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def latency_stats(results: list[Result]) -> dict:
    ttft, itl, tpot, per_chunk = [], [], [], []
    for r in results:
        if r.kind == "bad" or r.error or r.status != 200 or r.ttft_s is None:
            continue
        ttft.append(r.ttft_s)
        itl += [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
        per_chunk += r.chunk_tokens
        if not r.disconnected and len(r.token_ids) > 1:
            tpot.append((r.chunk_times[-1] - r.chunk_times[0]) / (len(r.token_ids) - 1))
    s = lambda xs: {"p50": pct(xs, 50), "p99": pct(xs, 99), "n": len(xs)}  # noqa: E731
    return {"ttft_s": s(ttft), "itl_s": s(itl), "tpot_s": s(tpot),
            "tokens_per_chunk": sum(per_chunk) / len(per_chunk) if per_chunk else None}


def summarise(name: str, results: list[Result], server: Server, checks: dict, seconds: float,
              start_s: float) -> dict:
    normal = [r for r in results if r.kind != "bad"]
    bad = [r for r in results if r.kind == "bad"]
    five_xx = [r for r in results if r.status is not None and r.status >= 500]
    exceptions = [r for r in normal if r.error] + [r for r in bad if r.error and r.status is None]
    completed = [r for r in normal if not r.error and not r.disconnected and not r.skipped and r.status == 200
                 and r.finish_reason]
    rejected = [r for r in normal if r.status is not None and 400 <= r.status < 500]
    tokens = sum(len(r.token_ids) for r in normal if r.status == 200)
    return {
        "name": name, "command": shlex.join(server.cmd), "start_s": round(start_s, 1), "phase_s": round(seconds, 1),
        "requests": len(normal), "completed": len(completed),
        "disconnected": sum(r.disconnected for r in normal), "skipped": sum(r.skipped for r in results),
        "rejected_4xx": len(rejected),  # well-formed requests the server refused (a setup problem)
        "output_tokens": tokens, "output_tokens_per_s": tokens / seconds if seconds else None,
        "server_errors_5xx": len(five_xx), "client_exceptions": len(exceptions),
        "server_died": server.died is not None, "server_exit_code": server.died,
        "errors": [{"idx": r.idx, "status": r.status, "error": r.error, "message": r.message}
                   for r in five_xx + exceptions][:20],
        "bad_requests": [{"case": r.source, "status": r.status, "message": r.message, "error": r.error} for r in bad],
        "latency": latency_stats(results), **checks,
    }


def compare_greedy(a: list[Result], b: list[Result]) -> dict:
    by_b = {r.idx: r for r in b}
    compared, mismatches = 0, []
    for r in a:
        o = by_b.get(r.idx)
        if r.kind != "greedy" or o is None:
            continue
        done = lambda x: (x.status == 200 and not x.error and not x.disconnected and not x.skipped  # noqa: E731
                          and x.finish_reason is not None)
        if not (done(r) and done(o)):
            continue
        compared += 1
        if r.token_ids != o.token_ids:
            first = next((i for i, (x, y) in enumerate(zip(r.token_ids, o.token_ids, strict=False)) if x != y),
                         min(len(r.token_ids), len(o.token_ids)))
            mismatches.append({"idx": r.idx, "source": r.source, "first_difference_at": first,
                               "dspark_len": len(r.token_ids), "nospec_len": len(o.token_ids)})
    return {"compared": compared, "mismatches": len(mismatches), "details": mismatches[:20]}


# ------------------------------------------------------------------ outputs
def fmt(x: float | None, scale: float = 1000.0, unit: str = "ms") -> str:
    return "-" if x is None else f"{x * scale:.0f} {unit}" if scale == 1000.0 else f"{x:.2f}"


def plot(summaries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    panels = (("ttft_s", "time to first token"), ("itl_s", "inter-token latency (per chunk)"),
              ("tpot_s", "time per output token"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        labels = ["p50", "p99"]
        width = 0.38
        for k, s in enumerate(summaries):
            vals = [(s["latency"][key][q] or 0) * 1000 for q in labels]
            xs = [i + (k - 0.5) * width for i in range(len(labels))]
            bars = ax.bar(xs, vals, width, label=s["name"])
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(title)
        ax.set_ylabel("ms")
    axes[0].legend()
    fig.suptitle("vllm serve under load: with and without DSpark (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path, meta: dict, summaries: list[dict], greedy: dict, verdict: dict) -> None:
    L = ["# vllm serve load and fault test: DSpark vs no speculation", "",
         f"Command: `{meta['command']}`", "",
         (f"Date (UTC): {meta['date']}; machine: {meta['machine']}; pair: target `{meta['target']}`, "
          f"drafter `{meta['draft']}`; dtype float32; {meta['clients']} concurrent streaming clients, "
          f"{meta['requests']} requests + {meta['bad_requests']} bad requests per server; API `{meta['api']}`."), "",
         f"**Verdict: {'PASS' if verdict['pass'] else 'FAIL'}**" + ("" if verdict["pass"] else
                                                                  f" ({'; '.join(verdict['failures'])})"), "",
         "| | " + " | ".join(s["name"] for s in summaries) + " |",
         "|---|" + "---|" * len(summaries)]

    def row(label, f):
        L.append(f"| {label} | " + " | ".join(f(s) for s in summaries) + " |")

    row("server start (s)", lambda s: f"{s['start_s']}")
    row("load phase (s)", lambda s: f"{s['phase_s']}")
    row("requests completed / disconnected / skipped / refused",
        lambda s: f"{s['completed']} / {s['disconnected']} / {s['skipped']} / {s['rejected_4xx']}")
    row("output tokens, tok/s", lambda s: f"{s['output_tokens']}, {s['output_tokens_per_s']:.1f}")
    row("5xx / client exceptions / server died", lambda s: f"{s['server_errors_5xx']} / {s['client_exceptions']} / "
                                                          f"{'yes' if s['server_died'] else 'no'}")
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL (per chunk)"), ("tpot_s", "TPOT (per token)")):
        row(f"{label} p50 / p99", lambda s, k=key: f"{fmt(s['latency'][k]['p50'])} / {fmt(s['latency'][k]['p99'])}")
    row("tokens per streamed chunk", lambda s: f"{s['latency']['tokens_per_chunk']:.2f}"
        if s["latency"]["tokens_per_chunk"] else "-")
    row("mean acceptance length",
        lambda s: f"{s['mean_acceptance_length']:.2f}" if s.get("mean_acceptance_length") else "-")
    row("final request after the load", lambda s: "ok" if s.get("final_request_ok") else "FAILED")
    row("/metrics readable", lambda s: "yes" if s.get("metrics_ok") else "NO")
    L += ["", (f"Greedy outputs, requests that ran to completion on both servers: {greedy['compared']} compared, "
               f"**{greedy['mismatches']} different**."), "", "## Bad requests", "",
          "| case | " + " | ".join(s["name"] for s in summaries) + " |", "|---|" + "---|" * len(summaries)]
    cases = [b["case"] for b in summaries[0]["bad_requests"]]
    for c in cases:
        cells = []
        for s in summaries:
            b = next((x for x in s["bad_requests"] if x["case"] == c), None)
            msg = (b["message"] or b["error"] or "").replace("|", "\\|").replace("\n", " ")[:160] if b else ""
            cells.append(f"{b['status'] if b else '-'}: {msg}")
        L.append(f"| {c} | " + " | ".join(cells) + " |")
    errs = [e for s in summaries for e in s["errors"]]
    if errs:
        L += ["", "## Errors", ""] + [f"- {e}" for e in errs[:20]]
    L += ["", f"Plot (not kept in git): `python benchmarks/plot_record.py {out}` draws latency.png.", "",
          ("TTFT: from sending the request to the first chunk carrying tokens. ITL: gaps between chunks that "
           "carry tokens (DSpark streams several tokens per chunk when drafts are accepted). TPOT: (last chunk - "
           "first chunk) / (tokens - 1) per request. Disconnecting clients close the connection after 1-4 chunks; "
           "the server aborts those requests. Seeded sampled requests are not compared (speculative sampling draws "
           "from the same distribution, not the same random stream).")]
    (out / "report.md").write_text("\n".join(L) + "\n")


# ------------------------------------------------------------------ main
def tiny_pair(root: Path) -> tuple[str, str]:
    from tests.tiny_pair import drafter_config_for, make_drafter, make_target, random_bigram

    bigram = random_bigram(384, seed=21)
    target = make_target(root / "target", vocab_size=384, bigram=bigram, num_layers=3, max_position_embeddings=4096)
    cfg = drafter_config_for(target, block_size=7, markov_rank=64, target_layer_ids=(0, 1))
    draft = make_drafter(root / "draft", cfg, mode="oracle", bigram=bigram, backbone_scale=0.05)
    return str(target), str(draft)


def has_chat_template(target: str) -> bool:
    t = Path(target)
    if (t / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((t / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, json.JSONDecodeError):
        return False


def main(argv: list[str] | None = None) -> int:
    from vllm_dspark.tools import cpu_setup

    p = argparse.ArgumentParser(description="Bounded load and fault test of vllm serve with DSpark vs without.")
    p.add_argument("--target", help="target model directory (default: the default pair's)")
    p.add_argument("--draft", help="DSpark drafter directory (default: the default pair's)")
    p.add_argument("--tiny", action="store_true", help="build and use a tiny random pair instead")
    p.add_argument("--out", default="reports/load_test")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=96, help="normal requests per server (bad ones are extra)")
    p.add_argument("--disconnect-share", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="prefill budget per step (small: long prompts are split over steps)")
    p.add_argument("--num-speculative-tokens", type=int, default=7)
    p.add_argument("--kv-cache-gib", type=int, default=3, help="VLLM_CPU_KVCACHE_SPACE (GiB, whole)")
    p.add_argument("--phase-timeout", type=float, default=200, help="seconds of load per server")
    p.add_argument("--request-timeout", type=float, default=150)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--only", choices=("dspark", "nospec"), help="run one configuration (no comparison)")
    cpu_setup.add_flag(p)
    args = p.parse_args(argv)
    if argv is None:  # run as a script: the servers it starts inherit the preloads
        cpu_setup.reexec_with(not args.no_cpu_setup)

    t_start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        target, draft = tiny_pair(Path(tempfile.mkdtemp(prefix="load_test_pair_")))
    elif args.target:
        target, draft = args.target, args.draft
    else:
        from vllm_dspark.tools.default_pair import default_paths

        paths = default_paths()
        target, draft = args.target or paths["target"], args.draft or paths["draft"]
    api = "chat" if has_chat_template(target) else "completions"
    # About 1,500 tokens of the default pair's tokenizer; a tiny pair's tokenizer has one token per byte.
    long_chars = min(5000, args.max_model_len // 2) if args.tiny else 5000
    jobs = build_mix(args.requests, args.seed, api, args.max_model_len, args.disconnect_share, long_chars)
    configs = [("DSpark", draft), ("no speculation", None)]
    if args.only:
        configs = [c for c in configs if (c[1] is not None) == (args.only == "dspark")]
    print(f"load_test: {len(jobs)} requests ({sum(j.kind == 'bad' for j in jobs)} bad), {args.clients} clients, "
          f"API {api}, target {target}, drafter {draft}", flush=True)

    summaries, raw = [], {}
    for name, d in configs:
        server = Server(name, target, d, args, out / f"serve_{'dspark' if d else 'nospec'}.log")
        print(f"load_test: [{name}] starting vllm serve on {server.base}", flush=True)
        try:
            start_s = server.start(args.start_timeout)
        except RuntimeError as exc:
            print(f"load_test: {exc}", file=sys.stderr)
            return 2
        try:
            print(f"load_test: [{name}] healthy after {start_s:.0f} s; running the load", flush=True)
            results, seconds = asyncio.run(run_phase(server.base, api, jobs, args.clients, args.phase_timeout,
                                                     args.request_timeout))
            alive_after_load = server.alive()
            checks = final_checks(server.base, api) if alive_after_load else {"final_request_ok": False,
                                                                             "metrics_ok": False}
            server.alive()
        finally:
            server.stop()
        s = summarise(name, results, server, checks, seconds, start_s)
        summaries.append(s)
        raw[name] = results
        print(f"load_test: [{name}] {s['completed']} completed, {s['server_errors_5xx']} 5xx, "
              f"{s['client_exceptions']} exceptions, died={s['server_died']}, {seconds:.0f} s", flush=True)

    greedy = (compare_greedy(raw["DSpark"], raw["no speculation"]) if len(raw) == 2
              else {"compared": 0, "mismatches": 0, "details": []})
    failures = []
    for s in summaries:
        if s["server_errors_5xx"] or s["client_exceptions"] or s["server_died"]:
            failures.append(f"{s['name']}: server errors")
        if any(not (b["status"] and 400 <= b["status"] < 500) for b in s["bad_requests"]):
            failures.append(f"{s['name']}: a bad request did not get a 4xx")
        if s["rejected_4xx"]:
            failures.append(f"{s['name']}: {s['rejected_4xx']} well-formed requests refused (see results.json)")
        if not s.get("final_request_ok"):
            failures.append(f"{s['name']}: no answer after the load")
        if not s.get("metrics_ok"):
            failures.append(f"{s['name']}: /metrics not readable")
    if greedy["mismatches"]:
        failures.append(f"{greedy['mismatches']} greedy mismatches")
    verdict = {"pass": not failures, "failures": failures}
    meta = {"command": shlex.join([Path(sys.executable).name, "benchmarks/load_test.py", *(argv if argv is not None
                                                                                       else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "machine": f"{os.cpu_count()} CPUs",
            "target": target, "draft": draft, "clients": args.clients, "requests": args.requests,
            "bad_requests": sum(j.kind == "bad" for j in jobs), "api": api, "args": vars(args),
            "total_s": None}
    meta["total_s"] = round(time.monotonic() - t_start, 1)
    (out / "results.json").write_text(json.dumps(
        {"meta": meta, "verdict": verdict, "greedy": greedy, "summaries": summaries,
         "jobs": [{"idx": j.idx, "kind": j.kind, "source": j.source, "disconnect_after": j.disconnect_after,
                   "body": {k: v for k, v in (j.body or {}).items() if k not in ("messages", "prompt")}}
                  for j in jobs],
         "results": {k: [slim_result(r) for r in v] for k, v in raw.items()}}, indent=1) + "\n")
    plot(summaries, out / "latency.png")
    write_report(out, meta, summaries, greedy, verdict)
    print(f"load_test: {'PASS' if verdict['pass'] else 'FAIL: ' + '; '.join(failures)} "
          f"(greedy: {greedy['compared']} compared, {greedy['mismatches']} different); {meta['total_s']:.0f} s; "
          f"report in {out / 'report.md'}", flush=True)
    return 0 if verdict["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
