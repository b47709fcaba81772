"""The end-to-end benchmark without an engine: a suite's command line reaches its runner, and a record's
report comes out again from its results.json (``bench_e2e.py --report-only``)."""

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "benchmarks" / "copy-default-bf16"


def test_report_only_makes_the_committed_report_again(tmp_path):
    from benchmarks.harness.e2e_report import rewrite_report

    out = tmp_path / "rec"
    out.mkdir()
    shutil.copy(RECORD / "results.json", out)
    assert rewrite_report(out) == 0
    # The one line that names the folder the plots go to.
    assert (out / "report.md").read_text().replace(str(out), "docs/benchmarks/copy-default-bf16") \
        == (RECORD / "report.md").read_text()


def test_a_suite_measures_its_configs_and_writes_its_record(tmp_path, monkeypatch):
    from benchmarks.bench_e2e import parse_args
    from benchmarks.harness import e2e, e2e_suite

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    seen: dict = {}

    def interleaved(pair, configs, datasets, **kw):  # the runner, without engines
        seen.update(configs=[c.name for c in configs], datasets=list(datasets), **kw)
        return [{"pair": pair.name, "config": c.name, "dataset": "code", "concurrency": 1, "temperature": 0.0,
                 "requests": 2, "tokens_per_s": 10.0 * (1 + i), "speedup_median": 1.0 + i, "outputs": [[1, 2], [3]],
                 "per_position_acceptance": [0.5]}
                for i, c in enumerate(configs)]

    monkeypatch.setattr(e2e, "run_interleaved", interleaved)
    args = parse_args(["--pair", "toy", "--suite", "verification", "--configs", "no-spec,fixed-3", "--concurrency",
                       "1,4", "--temperatures", "0", "--prompts", "3", "--dtype", "float32", "--out", str(tmp_path)])
    assert e2e_suite.run(args) == 0
    assert seen["configs"] == ["no-spec", "fixed-3"] and seen["datasets"] == ["code"] and seen["repeats"] == 3
    assert seen["concurrencies"] == (1, 4) and seen["prompts_per_cell"](4) == 8
    rec = json.loads((tmp_path / "results.json").read_text())
    assert rec["meta"]["suite"] == "verification" and rec["meta"]["prompts_per_cell"] == {"1": 3, "4": 8}
    assert [r["speedup"] for r in rec["rows"]] == [1.0, 2.0] and rec["rows"][1]["greedy_identical"] == "2/2"
    assert all("outputs" not in r for r in rec["rows"])
    assert "| toy | code | fixed-3 | 1 | 0 | 20.0 | 2.00x |" in (tmp_path / "report.md").read_text()
    args = parse_args(["--pair", "toy", "--suite", "verification", "--configs", "nope", "--out", str(tmp_path)])
    assert e2e_suite.run(args) == 2
