"""The committed conversations: the archive round-trips done.jsonl exactly, restores a cache, and its
training conversations are disjoint from every evaluation prompt."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from training.pipeline import prompt_set
from training.pipeline.conversations import SETS, pack, restore, unpack
from training.pipeline.generate import read_done

ARCHIVE = Path(__file__).resolve().parents[2] / "vllm_dspark" / "assets" / "smollm2" / "conversations"


def _rows():
    g = np.random.RandomState(0)
    return [{"i": i, "kind": ("chat", "code")[i % 2], "temperature": 0.7 * (i % 3 == 0),
             "ids": g.randint(0, 49152, 20 + i).tolist(), "gen_spans": [[5, 10], [12, 20 + i]]} for i in range(5)]


def test_pack_round_trips_done_jsonl(tmp_path):
    rows = _rows()
    got = pack(rows, tmp_path / "a.npz", {"seconds": 3.0})
    back, summary = unpack(tmp_path / "a.npz")
    assert back == [{**r, "temperature": float(np.float32(r["temperature"]))} for r in rows]
    assert summary == {"seconds": 3.0} and got["conversations"] == 5
    assert got["generated"] == sum(b - a for r in rows for a, b in r["gen_spans"])
    with pytest.raises(ValueError, match="uint16"):
        pack([{**rows[0], "ids": [70000]}], tmp_path / "b.npz")


def test_restore_seeds_a_shorter_cache_and_leaves_a_longer_one(tmp_path):
    rows = _rows()
    pack(rows[:3], tmp_path / "a.npz", {"seconds": 1.0})
    d = tmp_path / "set"
    assert restore(tmp_path / "a.npz", d, log=lambda *_: None) == 3
    assert read_done(d / "done.jsonl") == unpack(tmp_path / "a.npz")[0]
    assert json.loads((d / "summary.json").read_text()) == {"seconds": 1.0}
    with open(d / "done.jsonl", "a") as fh:  # the cache ran ahead of the archive: kept as it is
        for r in rows[3:]:
            fh.write(json.dumps(r) + "\n")
    assert restore(tmp_path / "a.npz", d, log=lambda *_: None) == 5
    assert restore(tmp_path / "missing.npz", tmp_path / "none", log=lambda *_: None) == 0


def _human_turns(tok, row: dict) -> list[str]:
    """The user turns of a conversation: the text between each user header and its end marker."""
    text = tok.decode(row["ids"])
    return [t.strip() for t in re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text, flags=re.S)]


@pytest.mark.skipif(not (ARCHIVE / "train_text.npz").exists(), reason="no generation archived yet")
def test_archived_training_conversations_are_disjoint_from_every_evaluation_prompt():
    from transformers import AutoTokenizer

    from vllm_dspark.tools.default_pair import default_paths

    tok = AutoTokenizer.from_pretrained(default_paths(require=True)["target"])
    index = prompt_set.evaluation_index()
    rows, _ = unpack(ARCHIVE / "train_text.npz")
    turns = [t for r in rows for t in _human_turns(tok, r)]
    assert len(turns) >= len(rows) > 0
    bad = [(t[:60], why) for t in turns if (why := index.why_excluded(t))]
    assert not bad, bad[:5]
    for name in SETS[:3]:  # and no held-out conversation was trained on
        if (ARCHIVE / f"{name}.npz").exists():
            held = {prompt_set.prompt_hash(t) for r in unpack(ARCHIVE / f"{name}.npz")[0]
                    for t in _human_turns(tok, r)}
            assert not held & {prompt_set.prompt_hash(t) for t in turns}, name


def test_reading_for_the_archive_never_cuts_a_file_a_generator_is_writing(tmp_path):
    from training.pipeline.conversations import read_rows

    path = tmp_path / "done.jsonl"
    raw = json.dumps(_rows()[0]) + "\n" + '{"i": 1, "ids": [1, 2'  # the writer is mid-line
    path.write_text(raw)
    assert [r["i"] for r in read_rows(path)] == [0]
    assert path.read_text() == raw  # untouched: only the writer repairs its file
