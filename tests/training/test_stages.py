"""The pipelines' stage runner: order, unknown stages, times added over resumed runs."""

from __future__ import annotations

import json

import pytest

from training.pipeline.stages import parse_stages, run_stages

ORDER = ("prompts", "generate", "capture", "dspark")


def test_stages_run_in_pipeline_order_and_unknown_ones_are_named():
    assert parse_stages("dspark, prompts", ORDER) == ["prompts", "dspark"]
    with pytest.raises(ValueError, match=r"\['trian'\]"):
        parse_stages("prompts,trian", ORDER)


def test_times_of_a_resumed_stage_add_up(tmp_path):
    (tmp_path / "timings.json").write_text(json.dumps({"capture": 100.0, "prompts": {"wall_s": 2.0, "cpu_s": 1.0}}))
    ran, lines = [], []
    out = run_stages(["prompts", "capture"], ran.append, tmp_path, log=lines.append)
    assert ran == ["prompts", "capture"]
    assert out["capture"]["wall_s"] >= 100.0 and out["prompts"]["wall_s"] >= 2.0 and out["prompts"]["cpu_s"] >= 1.0
    assert json.loads((tmp_path / "timings.json").read_text()) == out
    assert lines[0] == "=== stage prompts" and any("capture done" in x for x in lines)


def test_a_failing_stage_keeps_the_times_of_those_before_it(tmp_path):
    def run(stage):
        if stage == "capture":
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        run_stages(["prompts", "capture"], run, tmp_path, log=lambda _: None)
    assert set(json.loads((tmp_path / "timings.json").read_text())) == {"prompts"}
