"""Early-stop settings and the early-stop counters (no engine)."""

from __future__ import annotations

import pytest

from vllm_dspark.spec_decode.settings import (DSparkSettingsError, markov_enabled, parse_threshold,
                                              resolve_threshold)


def test_threshold_from_config_and_env(monkeypatch):
    monkeypatch.delenv("VLLM_DSPARK_CONFIDENCE_THRESHOLD", raising=False)
    assert resolve_threshold({}) == (0.0, "default")
    assert resolve_threshold({"confidence_threshold": 0.25}) == (0.25, "draft config.json")
    monkeypatch.setenv("VLLM_DSPARK_CONFIDENCE_THRESHOLD", "0.6")
    assert resolve_threshold({"confidence_threshold": 0.25}) == (0.6, "VLLM_DSPARK_CONFIDENCE_THRESHOLD")


@pytest.mark.parametrize("bad", ["-0.1", "1.01", "nan", "half"])
def test_bad_thresholds_name_the_setting(bad):
    with pytest.raises(DSparkSettingsError, match=r"SRC: got .*\[0, 1\]"):
        parse_threshold(bad, "SRC")


def test_bad_config_threshold(monkeypatch):
    monkeypatch.delenv("VLLM_DSPARK_CONFIDENCE_THRESHOLD", raising=False)
    with pytest.raises(DSparkSettingsError, match="dflash_config.confidence_threshold"):
        resolve_threshold({"confidence_threshold": 2})


def test_markov_switch(monkeypatch):
    monkeypatch.delenv("VLLM_DSPARK_DISABLE_MARKOV", raising=False)
    assert markov_enabled()
    monkeypatch.setenv("VLLM_DSPARK_DISABLE_MARKOV", "1")
    assert not markov_enabled()
    monkeypatch.setenv("VLLM_DSPARK_DISABLE_MARKOV", "yes")
    with pytest.raises(DSparkSettingsError, match="VLLM_DSPARK_DISABLE_MARKOV"):
        markov_enabled()


def test_early_stop_counters_and_log_line():
    from vllm_dspark.spec_decode.proposer_v1 import EarlyStopStats

    s = EarlyStopStats()
    s.add(7, [7, 3, 0])
    s.add(7, [7, 7])
    assert s.as_dict() == {"steps": 2, "requests": 5, "requests_cut": 2, "tokens_drafted": 35,
                           "tokens_kept": 24, "empty_drafts": 1}
    assert s.line() == ("DSpark early stop: 2/5 drafts cut (40.0%), 11/35 draft tokens not verified, "
                        "mean kept length 4.80, 1 empty drafts")
