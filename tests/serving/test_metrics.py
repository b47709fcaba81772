"""The per-source acceptance pair on /metrics (``serving/metrics.py``): publishers' files, summed and
labelled by the collector, in Prometheus' text format; the write rhythm; a bad file skipped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from vllm_dspark.serving.metrics import Publisher, SourceCollector, read_totals


def _counts(drafts, verified, accepted):
    return {"drafts": drafts, "verified": verified, "accepted": accepted}


def test_publishers_are_summed_per_model_and_source(tmp_path):
    a = Publisher("m", directory=str(tmp_path), interval_s=0.0)
    b = Publisher("m", directory=str(tmp_path), interval_s=0.0)
    c = Publisher("other", directory=str(tmp_path), interval_s=0.0)
    a.maybe_publish(lambda: {"dspark": _counts(3, 10, 4), "copy": _counts(2, 9, 8)})
    b.maybe_publish(lambda: {"copy": _counts(1, 5, 5)})
    c.maybe_publish(lambda: {"copy": _counts(7, 7, 7)})
    assert read_totals(tmp_path) == {("m", "dspark"): _counts(3, 10, 4), ("m", "copy"): _counts(3, 14, 13),
                                     ("other", "copy"): _counts(7, 7, 7)}
    registry = CollectorRegistry()
    registry.register(SourceCollector(tmp_path))
    text = generate_latest(registry).decode()
    assert 'vllm:dspark_spec_decode_num_accepted_tokens_total{model_name="m",source="copy"} 13.0' in text
    assert 'vllm:dspark_spec_decode_num_draft_tokens_total{model_name="m",source="dspark"} 10.0' in text
    assert 'vllm:dspark_spec_decode_num_drafts_total{model_name="other",source="copy"} 7.0' in text
    assert "# TYPE vllm:dspark_spec_decode_num_accepted_tokens_total counter" in text


def test_writes_follow_the_interval_and_a_report_forces_one(tmp_path):
    p = Publisher("m", directory=str(tmp_path), interval_s=3600.0)
    reads = []

    def counts(n):
        def get():
            reads.append(n)
            return {"copy": _counts(n, n, n)}
        return get

    p.maybe_publish(counts(1))
    p.maybe_publish(counts(2))  # within the interval: not even read
    assert reads == [1] and read_totals(tmp_path)[("m", "copy")]["accepted"] == 1
    p.maybe_publish(counts(3), force=True)
    assert reads == [1, 3] and read_totals(tmp_path)[("m", "copy")]["accepted"] == 3
    assert not list(tmp_path.glob("*.tmp"))  # written beside, then renamed over


def test_a_broken_file_is_skipped_and_no_directory_means_no_writes(tmp_path, monkeypatch):
    (tmp_path / "1-0.json").write_text("{not json")
    Publisher("m", directory=str(tmp_path), interval_s=0.0).maybe_publish(lambda: {"dspark": _counts(1, 2, 1)})
    assert read_totals(tmp_path) == {("m", "dspark"): _counts(1, 2, 1)}
    monkeypatch.delenv("VLLM_DSPARK_METRICS_DIR", raising=False)
    silent = Publisher("m")
    assert silent.path is None
    silent.maybe_publish(lambda: (_ for _ in ()).throw(AssertionError("read without a directory")))
