"""Batch script input formats: plain prompts, chats (the target's chat template), token ids, OpenAI batch requests.

With a fake engine (no vLLM start-up), as ``test_batch.py``: chats reach the engine as the
token ids ``apply_chat_template`` gives; OpenAI requests are answered in the OpenAI batch
output shape with their ``custom_id`` kept, and resume by it; every bad line is refused
with its line number before any tokenizer or engine is loaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.deploy.test_batch import FakeEngine, read_results
from vllm_dspark.tools.deploy import batch

TOY_TARGET = Path(__file__).resolve().parents[1] / "fixtures" / "toy_pair" / "target"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]


class RecordingEngine(FakeEngine):
    """FakeEngine that keeps every request it was given, by the record's position in the queue."""

    def __init__(self, crash_after=None):
        super().__init__(crash_after)
        self.requests: list[tuple] = []

    def add_request(self, rid, prompt, params):
        self.requests.append((prompt, params))
        return super().add_request(rid, prompt, params)


@pytest.fixture
def engines(monkeypatch):
    """``engines(crash_after=None)`` installs a fake ``vllm.LLM``; returns the list of LLMs made."""
    vllm = pytest.importorskip("vllm")
    made: list = []

    def install(crash_after=None):
        class FakeLLM:
            def __init__(self, **kw):
                self.kw = kw
                self.llm_engine = RecordingEngine(crash_after)
                made.append(self)

        monkeypatch.setattr(vllm, "LLM", FakeLLM)
        return made

    return install


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory) -> Path:
    """The toy target's tokenizer (and config) with a ChatML template beside it: offline, no weights."""
    d = tmp_path_factory.mktemp("chat_tok")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOY_TARGET / name, d / name)
    (d / "chat_template.jinja").write_text(CHATML)
    return d


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def template_ids(tok_dir, messages, **kw) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def by_prompt_ids(engine) -> dict:
    return {json.dumps(p["prompt_token_ids"]) if isinstance(p, dict) else p: params for p, params in engine.requests}


# ------------------------------------------------------------------ parsing
def test_each_line_is_detected_on_its_own(tmp_path):
    p = write_lines(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "text"},
        {"id": "b", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                                {"type": "text", "text": "y"}]}]},
        {"prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 4}},
    ])
    a, b, c = batch.read_prompts(p)
    assert (a["kind"], a["prompt"]) == ("prompt", "text")
    assert b["kind"] == "chat" and b["messages"] == [{"role": "user", "content": "x\ny"}]  # parts joined as vLLM
    assert (c["id"], c["kind"], c["prompt_token_ids"], c["sampling"]) == ("line-3", "tokens", [1, 2, 3],
                                                                          {"max_tokens": 4})


def test_openai_requests_parse_with_their_sampling(tmp_path):
    p = write_lines(tmp_path / "in.jsonl", [
        {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": CHAT, "max_tokens": 9, "max_completion_tokens": 5, "temperature": 0.7,
                  "top_p": 0.9, "top_k": 20, "seed": 3, "stop": ["\n"], "n": 1, "stream": False, "user": "u",
                  "frequency_penalty": None, "chat_template_kwargs": {"enable_thinking": False}}},
        {"custom_id": "r2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once", "max_tokens": 2}},
        {"custom_id": "r3", "method": "POST", "url": "/v1/completions", "body": {"prompt": [[5, 6]]}},
    ])
    r1, r2, r3 = batch.read_prompts(p)
    assert [r["id"] for r in (r1, r2, r3)] == ["r1", "r2", "r3"]
    assert r1["kind"] == "chat" and r1["messages"] == CHAT and r1["chat_template_kwargs"] == {"enable_thinking": False}
    assert r1["sampling"] == {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 3,
                              "stop": ["\n"]}  # max_completion_tokens wins; nulls are "not given"
    assert (r2["kind"], r2["prompt"], r2["sampling"]) == ("prompt", "Once", {"max_tokens": 2})
    assert (r3["kind"], r3["prompt_token_ids"]) == ("tokens", [5, 6])


GOOD_SIMPLE = [{"id": "a", "prompt": "one"}, {"id": "b", "messages": CHAT}]
GOOD_OPENAI = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": CHAT}},
               {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}]


def _openai(body=None, **fields):
    return {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": CHAT} if body is None else body, **fields}


BAD_LINES = [  # (the good lines before it, the bad line 3, what the message says)
    (GOOD_SIMPLE, "{not json", "not valid JSON"),
    (GOOD_SIMPLE, [1, 2], "expected a JSON object"),
    (GOOD_SIMPLE, {"id": "c", "text": "hi"}, 'needs "prompt" (text), "messages"'),
    (GOOD_SIMPLE, {"id": "c", "messages": "hi"}, "messages must be a non-empty list"),
    (GOOD_SIMPLE, {"id": "c", "messages": [{"content": "hi"}]}, 'messages[0] needs a "role" string'),
    (GOOD_SIMPLE, {"id": "c", "messages": [{"role": "user"}]}, 'messages[0] needs a "content" string'),
    (GOOD_SIMPLE, {"id": "c", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "only text parts"),
    (GOOD_SIMPLE, {"id": "c", "prompt": "x", "messages": CHAT}, "has both 'prompt' and 'messages'"),
    (GOOD_SIMPLE, {"id": "c", "prompt_token_ids": [1, "2"]}, "prompt_token_ids must be a list of token ids"),
    (GOOD_SIMPLE, {"id": "a", "prompt": "again"}, "id 'a' already used on line 1"),
    (GOOD_SIMPLE, _openai(), "this line is an OpenAI batch request, but line 1 is a simple prompt line"),
    (GOOD_OPENAI, {"id": "c", "prompt": "x"},
     "this line is a simple prompt line, but line 1 is an OpenAI batch request"),
    (GOOD_OPENAI, _openai(custom_id="a"), "custom_id 'a' already used on line 1"),
    (GOOD_OPENAI, _openai(url="/v1/embeddings"), "url '/v1/embeddings' is not answered here"),
    (GOOD_OPENAI, _openai(method="GET"), 'method must be "POST"'),
    (GOOD_OPENAI, {"custom_id": "c", "url": "/v1/chat/completions"}, "an OpenAI batch request needs 'body'"),
    (GOOD_OPENAI, _openai(custom_id=7), "custom_id must be a non-empty string"),
    (GOOD_OPENAI, _openai({"prompt": "x"}), "the body of a /v1/chat/completions request needs 'messages'"),
    (GOOD_OPENAI, _openai({"messages": [{"role": "user", "content": 5}]}), "body: messages[0] needs a \"content\""),
    (GOOD_OPENAI, _openai({"messages": CHAT, "n": 2}), "body.n=2 is not supported"),
    (GOOD_OPENAI, _openai({"messages": CHAT, "tools": []}), "body.tools is not supported"),
    (GOOD_OPENAI, _openai({"prompt": ["a", "b"]}, url="/v1/completions"), "body.prompt holds 2 prompts"),
    # Checked after parsing, still before any engine: sampling values vLLM refuses.
    (GOOD_SIMPLE, {"id": "c", "prompt": "x", "sampling": {"temperature": -1}}, "bad sampling field in sampling"),
    (GOOD_SIMPLE, {"id": "c", "prompt": "x", "sampling": {"no_such_field": 1}}, "bad sampling field"),
    (GOOD_OPENAI, _openai({"messages": CHAT, "top_p": 7}), "bad sampling field in body"),
]


@pytest.mark.parametrize("good, bad, says", BAD_LINES, ids=[str(i) for i in range(len(BAD_LINES))])
def test_a_bad_line_is_refused_by_number_before_any_engine(tmp_path, engines, monkeypatch, capsys, good, bad, says):
    made = engines()
    loaded = []
    monkeypatch.setattr(batch, "load_tokenizer", lambda model: loaded.append(model))
    inp = write_lines(tmp_path / "in.jsonl", [*good, bad])
    out = tmp_path / "out.jsonl"
    assert batch.main(["--model", "m", "--input", str(inp), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "in.jsonl:3: " in err and says in err, err
    assert not made and not loaded, "nothing may be loaded for a file with a bad line"
    assert not out.exists()


# ------------------------------------------------------------------ chats and the chat template
def test_chats_reach_the_engine_as_the_chat_template_renders_them(tmp_path, engines, chat_tokenizer_dir):
    made = engines()
    inp = write_lines(tmp_path / "in.jsonl", [
        {"id": "chat", "messages": CHAT},
        {"id": "plain", "prompt": "Name a prime."},
        {"id": "ids", "prompt_token_ids": [5, 6, 7]},
    ])
    args = ["--model", str(chat_tokenizer_dir), "--input", str(inp), "--max-tokens", "3"]
    assert batch.main([*args, "--output", str(tmp_path / "a.jsonl")]) == 0
    got = by_prompt_ids(made[-1].llm_engine)
    chat_ids = template_ids(chat_tokenizer_dir, CHAT)
    assert set(got) == {json.dumps(chat_ids), "Name a prime.", json.dumps([5, 6, 7])}  # plain text: as it is
    res = {r["id"]: r for r in read_results(tmp_path / "a.jsonl")}
    assert set(res) == {"chat", "plain", "ids"} and res["chat"]["prompt_tokens"] == 3  # the simple result shape
    assert res["chat"]["token_ids"][1] == 3

    # --apply-chat-template: a plain prompt becomes one user turn.
    assert batch.main([*args, "--output", str(tmp_path / "b.jsonl"), "--apply-chat-template"]) == 0
    got = by_prompt_ids(made[-1].llm_engine)
    user_turn = template_ids(chat_tokenizer_dir, [{"role": "user", "content": "Name a prime."}])
    assert set(got) == {json.dumps(chat_ids), json.dumps(user_turn), json.dumps([5, 6, 7])}


def test_the_default_targets_chat_template(tmp_path, engines):
    """SmolLM2-135M-Instruct's own template (when scripts/setup_env.sh has converted the target)."""
    from vllm_dspark.tools.default_pair import check_target, target_dir

    target = target_dir()
    if check_target(target, hash_weights=False):
        pytest.skip("the default target is not prepared; run scripts/setup_env.sh")
    made = engines()
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "messages": CHAT}])
    assert batch.main(["--model", str(target), "--input", str(inp), "--output", str(tmp_path / "o.jsonl")]) == 0
    (prompt, _), = made[-1].llm_engine.requests
    assert prompt["prompt_token_ids"] == template_ids(target, CHAT)


def test_a_chat_the_template_refuses_or_no_template_stops_before_the_engine(tmp_path, engines, chat_tokenizer_dir,
                                                                             capsys):
    made = engines()
    picky = tmp_path / "picky.jinja"
    picky.write_text("{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first turn must be the "
                     "user') }}{% endif %}" + CHATML)
    inp = write_lines(tmp_path / "in.jsonl", [{"id": 1, "messages": [{"role": "user", "content": "hi"}]},
                                              {"id": 2, "messages": CHAT}])
    args = ["--model", str(chat_tokenizer_dir), "--input", str(inp), "--output", str(tmp_path / "o.jsonl")]
    assert batch.main([*args, "--chat-template", str(picky)]) == 2
    err = capsys.readouterr().err
    assert "in.jsonl:2: the chat template cannot render these messages" in err
    assert "the first turn must be the user" in err

    bare = tmp_path / "bare"  # the toy tokenizer as shipped: no chat template
    bare.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOY_TARGET / name, bare / name)
    args[1] = str(bare)
    assert batch.main(args) == 2
    assert "in.jsonl:1: has messages, but the tokenizer of" in capsys.readouterr().err
    assert not made and not (tmp_path / "o.jsonl").exists()
    # The same tokenizer with --chat-template given as text works.
    assert batch.main([*args, "--chat-template", CHATML]) == 0
    assert len(made) == 1


# ------------------------------------------------------------------ OpenAI batch files
def openai_file(path: Path, n: int) -> Path:
    lines = []
    for i in range(n):
        if i % 2:
            lines.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                          "body": {"model": "m", "prompt": f"p{i}", "max_tokens": 4 + i, "stop": "\n"}})
        else:
            lines.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                          "body": {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}],
                                   "max_completion_tokens": 4 + i, "temperature": 0.5, "seed": i}})
    return write_lines(path, lines)


def test_an_openai_batch_file_is_answered_by_custom_id_and_resumes(tmp_path, engines, chat_tokenizer_dir, capsys):
    n = 20
    inp = openai_file(tmp_path / "in.jsonl", n)
    out = tmp_path / "out.jsonl"
    args = ["--model", str(chat_tokenizer_dir), "--input", str(inp), "--output", str(out)]
    made = engines(crash_after=7)
    with pytest.raises(KeyboardInterrupt):
        batch.main(args)
    first = out.read_bytes()
    k = first.count(b"\n")
    assert 0 < k <= 7
    engines()
    assert batch.main(args) == 0
    assert f"{k} already in" in capsys.readouterr().err
    assert out.read_bytes().startswith(first)
    res = read_results(out)
    assert sorted(r["custom_id"] for r in res) == sorted(f"req-{i}" for i in range(n))  # once each
    for r in res:
        i = int(r["custom_id"].split("-")[1])
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert r["id"].startswith("batch_req_")
        body = r["response"]["body"]
        choice = body["choices"][0]
        assert body["model"] == str(chat_tokenizer_dir) and choice["finish_reason"] == "length"
        if i % 2:
            assert body["object"] == "text_completion" and choice["text"] == f"out:p{i}"
        else:
            assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
            assert choice["message"]["content"].startswith("out:{'prompt_token_ids'")  # sent rendered
        usage = body["usage"]
        assert usage["prompt_tokens"] == 3 and usage["completion_tokens"] == 2 and usage["total_tokens"] == 5
    # Each body's sampling reached the engine (the fake engine echoes max_tokens as its second token).
    params = {p if isinstance(p, str) else json.dumps(p["prompt_token_ids"]): sp
              for llm in made for p, sp in llm.llm_engine.requests}
    assert params["p1"].max_tokens == 5 and params["p1"].stop == ["\n"] and params["p1"].temperature == 0.0
    chat0 = params[json.dumps(template_ids(chat_tokenizer_dir, [{"role": "user", "content": "q0"}]))]
    assert (chat0.max_tokens, chat0.temperature, chat0.seed) == (4, 0.5, 0)

    # A simple prompts file does not resume from OpenAI results (nor the other way round).
    simple = write_lines(tmp_path / "simple.jsonl", [{"id": "req-0", "prompt": "x"}])
    assert batch.main(["--model", "m", "--input", str(simple), "--output", str(out)]) == 2
    assert "holds OpenAI batch results, but the prompts file needs simple results" in capsys.readouterr().err
