"""Batch script: input/output files, resume after a crash with a torn last line, no duplicates, no gaps.

These tests drive ``vllm_dspark.tools.deploy.batch.main`` with a fake engine (no vLLM
start-up); ``test_batch_engine.py`` kills a real run and resumes it.
"""

from __future__ import annotations

import json
import os
import random
from types import SimpleNamespace

import pytest

from vllm_dspark.tools.deploy import batch


def write_prompts(path, n, start=0):
    with open(path, "w") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"id": f"p{i}", "prompt": f"prompt number {i}"}) + "\n")
    return path


def read_results(path):
    return [json.loads(line) for line in open(path) if line.strip()]


class FakeEngine:
    """Finishes requests in a shuffled order, with ids suffixed like vLLM's; can crash after N results."""

    def __init__(self, crash_after=None, seed=0):
        self.waiting, self.finished_count = [], 0
        self.crash_after = crash_after
        self.rng = random.Random(seed)
        self.max_seen_in_flight = 0

    def has_unfinished_requests(self):
        return bool(self.waiting)

    def add_request(self, rid, prompt, params):
        self.waiting.append((rid, prompt, params))
        self.max_seen_in_flight = max(self.max_seen_in_flight, len(self.waiting))
        return rid

    def step(self):
        self.rng.shuffle(self.waiting)
        k = self.rng.randint(1, 3)
        done, self.waiting = self.waiting[:k], self.waiting[k:]
        outs = []
        for rid, prompt, params in done:
            if self.crash_after is not None and self.finished_count >= self.crash_after:
                raise KeyboardInterrupt("simulated crash")
            self.finished_count += 1
            toks = [len(prompt) % 7, params.max_tokens]
            outs.append(SimpleNamespace(request_id=f"{rid}-1a2b3c4d", finished=True, prompt_token_ids=[1] * 3,
                                        outputs=[SimpleNamespace(text=f"out:{prompt}", token_ids=toks,
                                                                 finish_reason="length")]))
        outs.append(SimpleNamespace(request_id="unfinished", finished=False))
        return outs


@pytest.fixture
def fake_llm(monkeypatch):
    vllm = pytest.importorskip("vllm")
    made = []

    def factory(crash_after=None):
        class FakeLLM:
            def __init__(self, **kw):
                self.kw = kw
                self.llm_engine = FakeEngine(crash_after)
                made.append(self)

        monkeypatch.setattr(vllm, "LLM", FakeLLM)
        return made

    return factory


def test_read_prompts_errors_name_the_line(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"id": 1, "prompt": "a"}\n\n{"id": 2, "prompt": "b"}\n{"id": 1, "prompt": "c"}\n')
    with pytest.raises(batch.BatchInputError, match=r"in.jsonl:4: id 1 already used on line 1"):
        batch.read_prompts(p)
    p.write_text('{"id": 1, "text": "a"}\n')
    with pytest.raises(batch.BatchInputError, match=r":1: needs \"prompt\""):
        batch.read_prompts(p)
    p.write_text('{"prompt": "a"}\n{"id": "1", "prompt": "b"}\n{"id": 1, "prompt_token_ids": [1, 2]}\n')
    recs = batch.read_prompts(p)
    assert [r["id"] for r in recs] == ["line-1", "1", 1]  # "1" and 1 are different ids


def test_load_done_cuts_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    good = '{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n'
    for torn in ['{"id": "c", "te', '{"id": "c", "te\n', '\x00\x00']:
        out.write_text(good + torn)
        done, note = batch.load_done(out)
        assert set(done) == {batch.id_key("a"), batch.id_key("b")}
        assert note and "torn last line" in note
        assert out.read_text() == good  # cut exactly at the last good line
    out.write_text(good)
    assert batch.load_done(out) == ({batch.id_key("a"): {"id": "a", "text": "x"},
                                     batch.id_key("b"): {"id": "b", "text": "y"}}, None)


def test_load_done_refuses_a_bad_line_in_the_middle(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(batch.BatchInputError, match=r"out.jsonl:2: not a result record"):
        batch.load_done(out)
    assert out.read_text() == '{"id": "a"}\nnot json\n{"id": "b"}\n'  # untouched


def test_generate_stream_bounds_in_flight_and_maps_suffixed_ids():
    sd = batch.SamplingDefaults(max_tokens=5)
    llm = SimpleNamespace(llm_engine=FakeEngine())
    pytest.importorskip("vllm")
    recs = [{"id": i, "prompt": f"q{i}"} for i in range(50)]
    got = list(batch.generate_stream(llm, recs, sd, max_in_flight=4))
    assert sorted(r["id"] for r in got) == list(range(50))
    assert llm.llm_engine.max_seen_in_flight <= 4
    assert all(r["text"] == f"out:q{r['id']}" for r in got)


def test_sampled_requests_get_a_stable_seed_per_id():
    pytest.importorskip("vllm")
    sd = batch.SamplingDefaults(temperature=0.8, seed=7)
    a = sd.params_for({"id": "x", "prompt": "p"}).seed
    assert a == sd.params_for({"id": "x", "prompt": "other"}).seed
    assert a != sd.params_for({"id": "y", "prompt": "p"}).seed
    assert batch.SamplingDefaults(temperature=0.0).params_for({"id": "x"}).seed is None
    assert sd.params_for({"id": "x", "sampling": {"max_tokens": 3}}).max_tokens == 3


def test_crash_then_resume_no_duplicates_no_gaps(tmp_path, fake_llm, capsys):
    inp = write_prompts(tmp_path / "in.jsonl", 40)
    out = tmp_path / "out.jsonl"
    args = ["--model", "m", "--draft", "d", "--input", str(inp), "--output", str(out), "--max-tokens", "9"]
    made = fake_llm(crash_after=13)
    with pytest.raises(KeyboardInterrupt):
        batch.main(args)
    assert made[0].kw["speculative_config"] == {"method": "dspark", "model": "d", "num_speculative_tokens": 7}
    first = out.read_text()
    k = len(first.splitlines())
    assert 0 < k <= 13  # everything returned before the crash was written
    with open(out, "a") as f:  # the crash tore the record being written
        f.write('{"id": "p39", "text": "out:prom')
    fake_llm(crash_after=None)
    assert batch.main(args) == 0
    err = capsys.readouterr().err
    assert "torn last line" in err and f"{k} already in" in err and f"{40 - k} to generate" in err
    assert out.read_text().startswith(first)  # finished results are never rewritten
    res = read_results(out)
    ids = [r["id"] for r in res]
    assert len(ids) == len(set(ids)) == 40  # no duplicates, no gaps
    assert set(ids) == {f"p{i}" for i in range(40)}
    assert all(r["text"] == f"out:prompt number {r['id'][1:]}" and r["token_ids"][1] == 9 for r in res)
    # A third run has nothing to do and writes nothing.
    before = out.read_bytes()
    fake_llm(crash_after=0)
    assert batch.main(args) == 0
    assert out.read_bytes() == before


def test_bad_input_exits_2(tmp_path, capsys):
    assert batch.main(["--model", "m", "--input", str(tmp_path / "missing.jsonl"),
                       "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err


def test_memory_flags_reach_the_llm_and_win_over_the_environment(tmp_path, fake_llm, capsys, monkeypatch):
    inp = write_prompts(tmp_path / "in.jsonl", 2)
    made = fake_llm()
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert batch.main(["--model", "m", "--input", str(inp), "--output", str(tmp_path / "a.jsonl"),
                       "--kv-cache-gib", "1.5"]) == 0
    assert made[-1].kw["kv_cache_memory_bytes"] == int(1.5 * (1 << 30))
    assert "gpu_memory_utilization" not in made[-1].kw
    assert "--kv-cache-gib is given, so VLLM_CPU_KVCACHE_SPACE=3 from the environment is ignored" \
        in capsys.readouterr().err
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # so vLLM (and every replica) sees the flag's size
    assert batch.main(["--model", "m", "--input", str(inp), "--output", str(tmp_path / "b.jsonl"),
                       "--gpu-memory-utilization", "0.3"]) == 0
    assert made[-1].kw["gpu_memory_utilization"] == 0.3 and "kv_cache_memory_bytes" not in made[-1].kw
    with pytest.raises(SystemExit):  # one or the other
        batch.build_parser().parse_args(["--model", "m", "--input", "i", "--output", "o", "--kv-cache-gib", "1",
                                         "--gpu-memory-utilization", "0.5"])


@pytest.mark.parametrize("native_bf16", [False, True])
def test_native_dtype_is_float32_only_on_a_cpu_without_native_bf16(tmp_path, fake_llm, capsys, monkeypatch,
                                                                   native_bf16):
    from vllm.platforms import current_platform

    from vllm_dspark.serving import cpu_flags

    assert current_platform.is_cpu()
    monkeypatch.setattr(cpu_flags, "has_native_bf16", lambda flags=None: native_bf16)
    inp = write_prompts(tmp_path / "in.jsonl", 1)
    made = fake_llm()
    assert batch.main(["--model", "m", "--input", str(inp), "--output", str(tmp_path / "a.jsonl")]) == 0
    assert made[-1].kw["dtype"] == ("auto" if native_bf16 else "float32")
    assert ("--dtype native: float32 (this CPU has no native bf16" in capsys.readouterr().err) == (not native_bf16)
    # A dtype the user names is theirs, on any CPU.
    assert batch.main(["--model", "m", "--input", str(inp), "--output", str(tmp_path / "b.jsonl"),
                       "--dtype", "bfloat16"]) == 0
    assert made[-1].kw["dtype"] == "bfloat16" and "--dtype native" not in capsys.readouterr().err


def test_native_dtype_is_vllms_auto_off_the_cpu(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)  # a GPU node: the checkpoint's dtype
    assert batch.resolve_dtype({"dtype": "native"}, native_bf16=False) == ({"dtype": "auto"}, None)


def test_an_engine_that_will_not_start_for_memory_is_one_line(tmp_path, monkeypatch, capsys):
    vllm = pytest.importorskip("vllm")
    from vllm_dspark.serving.memory import DSparkMemoryError

    inp = write_prompts(tmp_path / "in.jsonl", 2)
    args = ["--model", "m", "--input", str(inp), "--output", str(tmp_path / "o.jsonl"),
            "--dtype", "float32"]  # (no dtype note: the failure's line is the only one)
    failures = [DSparkMemoryError("VLLM_CPU_KVCACHE_SPACE=99 asks for a 99.00 GiB KV cache, but ...; lower it"),
                ValueError("Available memory on node 0 (8.69/11.09 GiB) on startup is less than desired CPU "
                           "memory utilization (0.92, 10.2 GiB). To resolve: ..."),
                RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")]
    for exc in failures:
        def boom(exc=exc, **kw):
            raise exc
        monkeypatch.setattr(vllm, "LLM", boom)
        assert batch.main(args) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if "to generate" not in line]
        assert len(lines) == 1 and lines[0].startswith("batch_generate: "), lines
        assert "--kv-cache-gib" in lines[0] or "VLLM_CPU_KVCACHE_SPACE=99" in lines[0], lines
    monkeypatch.setattr(vllm, "LLM", lambda **kw: (_ for _ in ()).throw(KeyError("not ours")))
    with pytest.raises(KeyError):  # anything else keeps its traceback
        batch.main(args)


def test_vllms_kv_flag_is_named_as_this_scripts_flag():
    from vllm_dspark.serving.memory import DSparkMemoryError

    line = batch.startup_error(DSparkMemoryError(
        "--kv-cache-memory-bytes 21474836480 asks for a 20.00 GiB KV cache, but NUMA node 0 has 16.00 GiB "
        "available of 24.00 GiB; lower it, e.g. --kv-cache-memory-bytes 8589934592 (or set ...)"))
    assert "--kv-cache-gib 20 asks" in line and "e.g. --kv-cache-gib 8 (" in line
