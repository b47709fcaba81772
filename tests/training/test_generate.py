"""The generation stage's on-disk record: what a kill mid-write leaves is cut off, never misread."""

from __future__ import annotations

import json

from training.pipeline.generate import generated_tokens, read_done


def test_a_half_written_last_line_is_cut_off_and_the_rest_kept(tmp_path):
    path = tmp_path / "done.jsonl"
    rows = [{"i": i, "ids": list(range(10)), "gen_spans": [[2, 5], [7, 10]]} for i in range(3)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text + '{"i": 3, "ids": [1, 2')  # killed mid-write
    got = read_done(path)
    assert [r["i"] for r in got] == [0, 1, 2]
    assert path.read_text() == text  # appending resumes on a clean line boundary
    assert generated_tokens(got[0]) == 6
    assert read_done(tmp_path / "missing.jsonl") == []
