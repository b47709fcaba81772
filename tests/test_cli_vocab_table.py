"""`vllm-dspark vocab-table` (the draft vocabulary's frequency table) and the default pair's shipped table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tiny_pair import make_tokenizer
from vllm_dspark.checkpoint.token_frequency import FORMAT, load_frequency_table
from vllm_dspark.tools import cli

V = 300
REPO = Path(__file__).resolve().parents[1]
DEFAULT_TABLE = REPO / "vllm_dspark" / "assets" / "smollm2" / "dspark" / "token_frequency.json"


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A target directory with a byte-level tokenizer and a config.json naming its vocabulary."""
    d = make_tokenizer(tmp_path_factory.mktemp("target"), V)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": V}))
    return d


def _run(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_builds_a_table_from_text_and_token_id_lines(target, tmp_path, capsys):
    from transformers import AutoTokenizer

    src = tmp_path / "corpus.jsonl"
    src.write_text(json.dumps({"text": "aaab"}) + "\n\n" + json.dumps({"token_ids": [7, 7, 7, 7, 7, 299]}) + "\n")
    out = tmp_path / "sub" / "freq.json"
    rc, stdout, _ = _run(capsys, "vocab-table", "--tokenizer", str(target), "--input", str(src), "--out", str(out))
    assert rc == 0 and str(out) in stdout
    a, b = AutoTokenizer.from_pretrained(str(target))("ab", add_special_tokens=False)["input_ids"]
    t = load_frequency_table(out)
    assert json.loads(out.read_text())["format"] == FORMAT
    assert t.vocab_size == V and t.tokens == 10
    assert t.ids[:2] == (7, a) and t.counts[:2] == (5, 3) and set(t.ids[2:]) == {b, 299}
    assert "vocab-table" in t.source and str(src) in t.source  # the command is the default source
    assert not [p for p in out.parent.iterdir() if p.name != out.name]  # no temporary file left


@pytest.mark.parametrize("line, needle", [
    ("{not json", ":2: not JSON"),
    (json.dumps({"txt": "x"}), ':2: expected {"text": "..."} or {"token_ids": [...]}'),
    (json.dumps({"token_ids": [1, "2"]}), ":2: token_ids must be a list of integers"),
    (json.dumps({"token_ids": [1, V]}), f":2: token id {V} is outside the vocabulary (0..{V - 1})"),
])
def test_a_bad_line_is_refused_by_its_number(target, tmp_path, capsys, line, needle):
    src = tmp_path / "corpus.jsonl"
    src.write_text(json.dumps({"token_ids": [1]}) + "\n" + line + "\n")
    out = tmp_path / "freq.json"
    rc, _, err = _run(capsys, "vocab-table", "--tokenizer", str(target), "--input", str(src), "--out", str(out))
    assert rc == 1 and f"{src}{needle}" in err, err
    assert not out.exists()


def test_a_missing_input_is_a_usage_error(target, tmp_path, capsys):
    rc, _, err = _run(capsys, "vocab-table", "--tokenizer", str(target), "--input", str(tmp_path / "nope.jsonl"),
                      "--out", str(tmp_path / "f.json"))
    assert rc == 2 and "no such file" in err


def test_the_default_pairs_table_counts_its_training_prompts_not_an_eval_set():
    """The shipped table is built from the default drafter's TRAINING prompts (the turns
    ``train_prompts.npz`` records, disjoint from every evaluation prompt), never from the chat eval
    set or HumanEval, and over the default target's vocabulary (49,152, SmolLM2's)."""
    t = load_frequency_table(DEFAULT_TABLE)
    assert DEFAULT_TABLE.stat().st_size < 1_000_000
    assert t.vocab_size == 49152
    cfg = json.loads((DEFAULT_TABLE.parent / "config.json").read_text())
    assert t.vocab_size == cfg["vocab_size"]
    assert "train_prompts.npz" in t.source and "training prompts" in t.source
    assert "vllm-dspark vocab-table" in t.source and "python -m vllm_dspark.tools.draft_vocab" in t.source
    for eval_set in ("chat_eval", "humaneval", "eval_sharegpt", "chat_prompts"):
        assert eval_set not in t.source.lower()
    assert t.tokens > 100_000 and len(t.ids) > 10_000
