"""``vllm serve`` with DSpark under faults (CPU, float32, one server for the module).

The tiny target is (almost) a bigram model, so every greedy answer is known in advance:
``bigram_chain(bigram, last prompt token, n)``. Checked:

* bad requests (malformed JSON, negative ``max_tokens``, temperature / top-p out of range, an
  unknown model, a prompt longer than ``max_model_len``, a token id outside the vocabulary) each
  get a 4xx with a message naming the problem, while good streams sent at the same time are
  answered correctly;
* streams cancelled by their clients free their slots: afterwards no request runs or waits, the
  KV cache is empty again (``vllm:kv_cache_usage_perc`` 0), the model runner and the DSpark
  proposer hold nothing of those requests (``dspark_state`` through ``/collective_rpc``), and
  ``max_num_seqs`` new requests are all answered correctly;
* seeded sampled requests with long prompts, split over several prefill steps (the CPU
  generator crash the plugin patches), keep the server alive and reproduce with their seed;
* the server's listeners are on 127.0.0.1 only, and ``/metrics`` is readable.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from tests.helpers import free_port, serve_command, serving, tiny_pair
from tests.tiny_pair import bigram_chain

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
VOCAB = 384
MAX_MODEL_LEN = 512
MAX_SEQS = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("serve_reliability_pair"), vocab=VOCAB, seed=21,
                     target={"num_layers": 3},
                     drafter={"block_size": 6, "markov_rank": 64, "target_layer_ids": (0, 1)},
                     backbone_scale=0.05).as_dict()


@pytest.fixture(scope="module")
def server(pair):
    port = free_port()
    cmd = serve_command(pair["target"], pair["draft"], port, max_model_len=MAX_MODEL_LEN, extra=(
        "--max-num-seqs", str(MAX_SEQS), "--max-num-batched-tokens", "64", "--served-model-name", "tiny",
        "--worker-extension-cls", "vllm_dspark.spec_decode.v1.worker_ext.DSparkWorkerExtension"))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1")  # dev mode: /collective_rpc
    with serving(cmd, pair["root"] / "serve.log", env) as srv:
        yield {"base": srv.base, "proc": srv.proc, "port": srv.port, "log": srv.log}


def _body(prompt, n: int, **kw) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **kw}


async def _stream(client, base: str, body: dict, *, read_chunks: int | None = None, request_id: str | None = None):
    """Stream one completion; stop after ``read_chunks`` token chunks (closing the connection)."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    ids: list[int] = []
    async with client.stream("POST", base + "/v1/completions", json={**body, "stream": True}, headers=headers,
                             timeout=180) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(await r.aread()), ids
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            got = (json.loads(line[6:]).get("choices") or [{}])[0].get("token_ids") or []
            ids += got
            chunks += bool(got)
            if read_chunks is not None and chunks >= read_chunks:
                break
        return 200, None, ids


async def _post(client, base: str, content: bytes) -> tuple[int, dict]:
    r = await client.post(base + "/v1/completions", content=content, headers={"Content-Type": "application/json"},
                          timeout=60)
    try:
        return r.status_code, r.json()
    except json.JSONDecodeError:
        return r.status_code, {"raw": r.text}


def _metrics(base: str) -> dict[str, float]:
    import httpx

    r = httpx.get(base + "/metrics", timeout=30)
    assert r.status_code == 200
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith("vllm:"):
            name, _, value = line.rpartition(" ")
            key = name.split("{")[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _state(base: str) -> dict:
    import httpx

    r = httpx.post(base + "/collective_rpc", json={"method": "dspark_state"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["results"][0]


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length + i,), generator=g).tolist() for i in range(n)]


BAD = {  # case: (body, words the error message must contain)
    "malformed_json": (b'{"model": "tiny", "prompt": "hi", "max_tokens": 4', ("json",)),
    "negative_max_tokens": (_body("hi", -3), ("max_tokens",)),
    "temperature_out_of_range": (_body("hi", 4, temperature=-1.0), ("temperature",)),
    "top_p_out_of_range": (_body("hi", 4, top_p=1.5), ("top_p",)),
    "unknown_model": ({**_body("hi", 4), "model": "no-such-model"}, ("no-such-model",)),
    "prompt_longer_than_max_model_len": (_body([5] * (MAX_MODEL_LEN + 40), 4), (str(MAX_MODEL_LEN),)),
    "token_id_outside_vocabulary": (_body([5, VOCAB + 1000, 7], 4), ("token",)),
}


def test_bad_requests_get_4xx_and_the_others_are_served(server, pair):
    import httpx

    base = server["base"]
    good = _prompts(4, 12, seed=1)

    async def go():
        async with httpx.AsyncClient() as c:
            tasks = [_stream(c, base, _body(p, 40)) for p in good]
            tasks += [_post(c, base, b if isinstance(b, bytes) else json.dumps(b).encode())
                      for b, _ in BAD.values()]
            return await asyncio.gather(*tasks)

    res = asyncio.run(go())
    streams, bad = res[:len(good)], res[len(good):]
    for p, (status, err, ids) in zip(good, streams, strict=True):
        assert status == 200, err
        assert ids == bigram_chain(pair["bigram"], p[-1], 40)
    problems = []
    for (case, (_, words)), (status, body) in zip(BAD.items(), bad, strict=True):
        msg = json.dumps(body).lower()
        if not (400 <= status < 500 and all(w.lower() in msg for w in words)):
            problems.append(f"{case}: {status} {msg[:300]}")
    assert not problems, "\n".join(problems)
    assert server["proc"].poll() is None


def test_cancelled_streams_free_their_slots(server, pair):
    import httpx

    base = server["base"]
    prompts = _prompts(MAX_SEQS, 20, seed=2)

    async def cancel_all():
        async with httpx.AsyncClient() as c:
            return await asyncio.gather(*(_stream(c, base, _body(p, 300), read_chunks=2, request_id=f"cancel-{i}")
                                          for i, p in enumerate(prompts)))

    for status, err, ids in asyncio.run(cancel_all()):
        assert status == 200 and 0 < len(ids) < 300, (status, err, len(ids))
    deadline = time.monotonic() + 60
    while True:  # the server notices the disconnects and aborts those requests
        m = _metrics(base)
        if m.get("vllm:num_requests_running", 1) == 0 and m.get("vllm:num_requests_waiting", 1) == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.5)
    assert m["vllm:kv_cache_usage_perc"] == 0.0, m

    # Full capacity: max_num_seqs requests, all answered correctly.
    fresh = _prompts(MAX_SEQS, 10, seed=3)

    async def full():
        async with httpx.AsyncClient() as c:
            return await asyncio.gather(*(_stream(c, base, _body(p, 24), request_id=f"fresh-{i}")
                                          for i, p in enumerate(fresh)))

    for p, (status, err, ids) in zip(fresh, asyncio.run(full()), strict=True):
        assert status == 200 and ids == bigram_chain(pair["bigram"], p[-1], 24), err
    # One more request: the runner learns at its next step which requests ended.
    r = httpx.post(base + "/v1/completions", json=_body([9, 8, 7], 3), timeout=60)
    assert r.status_code == 200
    state = _state(base)
    assert state["drafter"] == "DSparkProposer", state
    held = state["runner_requests"] + state["batch_requests"] + (state["prev"] or [])
    assert not [h for h in held if "cancel-" in h or "fresh-" in h], state
    assert len(state["runner_requests"]) <= 1, state
    assert _metrics(base)["vllm:kv_cache_usage_perc"] == 0.0


def test_seeded_long_prompts_split_over_prefill_steps_keep_the_server_alive(server):
    """Prompts of 300 tokens, prefill budget 64 tokens per step: each prompt takes 5+ steps, and a
    seeded request is sampled (and discarded) at each partial step: vLLM 0.32's CPU runner then
    rewinds its generator with set_offset and crashed the engine before the plugin's patch."""
    import httpx

    base = server["base"]
    prompts = _prompts(4, 300, seed=4)
    bodies = [_body(p, 16, temperature=0.9, seed=100 + i) for i, p in enumerate(prompts)]

    async def run():
        async with httpx.AsyncClient() as c:
            return await asyncio.gather(*(_stream(c, base, b) for b in bodies))

    first, second = asyncio.run(run()), asyncio.run(run())
    for (s1, e1, ids1), (s2, e2, ids2) in zip(first, second, strict=True):
        assert s1 == s2 == 200, (e1, e2)
        assert len(ids1) == 16 and ids1 == ids2  # the seed reproduces, alone or in a batch
    assert server["proc"].poll() is None
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    assert "CPU Generator does not use offset" not in server["log"].read_text()


def test_metrics_readable_and_speculation_ran(server):
    m = _metrics(server["base"])
    assert m.get("vllm:spec_decode_num_drafts_total", 0) > 0, m
    assert m.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0, m
    assert "vllm:kv_cache_usage_perc" in m


def test_server_listens_on_loopback_only(server):
    from tests.listeners import listeners, session_pids

    found = listeners(session_pids(server["proc"].pid))
    assert any(x["port"] == server["port"] for x in found), found
    assert all(x["address"] == "127.0.0.1" for x in found), found
