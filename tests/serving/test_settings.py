"""DSpark settings: sources, precedence, validation, transport (no engine)."""

from __future__ import annotations

import pytest

from tests.helpers import tiny_config
from vllm_dspark.serving.settings import DSparkSettings, DSparkSettingsError, attach, resolve_settings, settings_of


def resolve(cfg=None, *, dc=None, opts=None, n=None, served=4096, env=None):
    cfg = cfg or tiny_config(max_position_embeddings=4096)
    return resolve_settings(cfg, draft="/d", dflash_config=dc, spec_options=opts, num_speculative_tokens=n,
                            served_context=served, environ=env or {})


def test_defaults_budget_with_confidence_head_fixed_without():
    s = resolve()
    assert s.verification == "budget" and s.source("verification") == "default"
    assert s.window is None and s.max_draft_context is None and s.draft_sampling == "auto"
    assert s.max_draft_tokens == s.num_draft_tokens == 5
    s = resolve(tiny_config(max_position_embeddings=4096, enable_confidence_head=False,
                            confidence_head_with_markov=False))
    assert s.verification == "fixed"


def test_threshold_implies_the_reference_rule_and_precedence():
    s = resolve(dc={"confidence_threshold": 0.25})
    assert (s.verification, s.threshold) == ("threshold", 0.25)
    assert s.source("threshold") == "dflash_config.confidence_threshold"
    s = resolve(dc={"confidence_threshold": 0.25}, env={"VLLM_DSPARK_CONFIDENCE_THRESHOLD": "0.6"})
    assert s.threshold == 0.6 and s.source("threshold") == "VLLM_DSPARK_CONFIDENCE_THRESHOLD"
    s = resolve(dc={"confidence_threshold": 0.25}, env={"VLLM_DSPARK_CONFIDENCE_THRESHOLD": "0.6"},
                opts={"threshold": 0.7, "verification": "product"})
    assert (s.verification, s.threshold) == ("product", 0.7)
    assert s.source("verification") == "speculative_config['dspark']['verification']"


def test_window_defaults_to_trained_context_only_when_served_longer():
    cfg = tiny_config(max_position_embeddings=512)
    assert resolve(cfg, served=512).window is None
    s = resolve(cfg, served=8192)
    assert s.window == 512 and "trained context" in s.source("window")
    assert "most recent 512" in s.context_note()
    assert resolve(cfg, served=8192, opts={"window": "off"}).window is None
    assert resolve(cfg, served=8192, opts={"window": 0}).window is None
    assert resolve(cfg, served=8192, env={"VLLM_DSPARK_WINDOW": "2048"}).window == 2048
    assert resolve(cfg, served=8192, dc={"use_swa": True, "swa_window_size": 1024}).window == 1024
    assert resolve(cfg, served=8192, dc={"use_swa": False}).window is None
    note = resolve(cfg, served=8192, opts={"window": None}).context_note()
    assert "window is OFF" in note


@pytest.mark.parametrize("opts, needle", [
    ({"verification": "sometimes"}, "verification (speculative_config['dspark']['verification']): got 'sometimes'"),
    ({"threshold": 1.5}, "threshold (speculative_config['dspark']['threshold']): got 1.5"),
    ({"threshold": "nan"}, "expected a number in [0, 1]"),
    ({"window": 3}, "window (speculative_config['dspark']['window']): got 3, expected 0/'off' or at least 6"),
    ({"window": "wide"}, "expected a token count or 'off'"),
    ({"max_draft_context": -4}, "max_draft_context"),
    ({"draft_sampling": "nucleus"}, "draft_sampling"),
    ({"verification": "threshold"}, "needs a threshold in (0, 1]"),
    ({"windwo": 4}, "unknown keys ['windwo']"),
    ({"costs": {"verify": [[1, 0.1]]}}, "costs (speculative_config['dspark']['costs'])"),
])
def test_bad_values_name_the_setting_source_and_fix(opts, needle):
    with pytest.raises(DSparkSettingsError) as exc:
        resolve(opts=opts)
    assert needle in str(exc.value)


def test_all_problems_at_once():
    with pytest.raises(DSparkSettingsError) as exc:
        resolve(opts={"threshold": 2, "window": 1, "draft_sampling": "x"}, n=9)
    msg = str(exc.value)
    for needle in ("threshold", "window", "draft_sampling", "num_speculative_tokens: got 9"):
        assert needle in msg


def test_threshold_rules_need_a_confidence_head():
    cfg = tiny_config(enable_confidence_head=False, confidence_head_with_markov=False)
    with pytest.raises(DSparkSettingsError, match="needs the drafter's confidence head"):
        resolve(cfg, opts={"verification": "budget"})


def test_markov_switch():
    assert resolve().use_markov
    assert not resolve(env={"VLLM_DSPARK_DISABLE_MARKOV": "1"}).use_markov
    with pytest.raises(DSparkSettingsError, match="VLLM_DSPARK_DISABLE_MARKOV"):
        resolve(env={"VLLM_DSPARK_DISABLE_MARKOV": "yes"})


def test_transport_through_the_hf_config_is_strict():
    class Hf:
        pass

    hf = Hf()
    with pytest.raises(DSparkSettingsError, match="carries no dspark_settings"):
        settings_of(hf)
    s = resolve(opts={"window": 64, "max_draft_context": 3000})
    attach(hf, s)
    assert isinstance(hf.dspark_settings, dict)  # picklable and JSON-able with vLLM's config
    assert settings_of(hf) == s
    bad = dict(hf.dspark_settings, windw=3)
    with pytest.raises(DSparkSettingsError, match=r"unknown \['windw'\]"):
        DSparkSettings.from_dict(bad)
    assert s.cuts_drafts  # the context gate cuts drafts: needs synchronous scheduling


def test_budget_trust_settings_defaults_sources_and_errors():
    import dataclasses

    from vllm_dspark.serving.settings_table import BY_NAME, TRUST_NAMES
    from vllm_dspark.spec_decode.common.budget import TrustConfig

    s = resolve()
    fields = {f.name: f.default for f in dataclasses.fields(DSparkSettings)}
    trust = TrustConfig()
    for name in TRUST_NAMES:  # one default per setting, the same in all three places
        default = BY_NAME[name].default
        assert getattr(s, name) == fields[name] == getattr(trust, name) == default, name
        assert BY_NAME[name].env == "VLLM_DSPARK_" + name.upper()
    assert TrustConfig(**s.trust()) == trust
    s = resolve(opts={"prior_strength": 10, "probe_tokens": 1},
                env={"VLLM_DSPARK_PROBE_PERIOD": "4", "VLLM_DSPARK_REJECT_RUN": "0", "VLLM_DSPARK_PROBE_TOKENS": "3"})
    assert (s.prior_strength, s.probe_tokens, s.probe_period, s.reject_run) == (10.0, 1, 4, 0)
    assert s.source("probe_tokens") == "speculative_config['dspark']['probe_tokens']"
    assert s.source("probe_period") == "VLLM_DSPARK_PROBE_PERIOD"
    assert resolve(n=1, opts={"probe_tokens": 2}).trust()["probe_tokens"] == 1  # never more than verified
    with pytest.raises(DSparkSettingsError) as exc:
        resolve(opts={"prior_acceptance": 1.5, "probe_tokens": 1.5, "probe_period": 0, "reject_run": True},
                env={"VLLM_DSPARK_PRIOR_STRENGTH": "lots"})
    msg = str(exc.value)
    for needle in ("prior_acceptance (speculative_config['dspark']['prior_acceptance']): got 1.5",
                   "probe_tokens (speculative_config['dspark']['probe_tokens']): got 1.5, expected an integer",
                   "probe_period", "reject_run", "prior_strength (VLLM_DSPARK_PRIOR_STRENGTH): got 'lots'"):
        assert needle in msg, (needle, msg)
    with pytest.raises(DSparkSettingsError, match="below probe_period"):
        resolve(opts={"probe_period": 8, "probe_max_period": 4})


def test_the_readme_and_the_docstring_show_the_table():
    from pathlib import Path

    import vllm_dspark.serving.settings as settings_module
    from vllm_dspark.serving.settings_table import SETTINGS, markdown_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("<!-- settings-table")
    block = readme[readme.index("\n", start) + 1: readme.index("<!-- /settings-table -->")].strip()
    stale = "README's settings table is stale: paste `python -m vllm_dspark.serving.settings_table`"
    assert block == markdown_table(), stale
    doc = settings_module.__doc__ or ""
    for row in SETTINGS:
        assert f"``{row.name}``" in doc and (row.env is None or row.env in doc), row.name
    assert set(settings_module.SPEC_KEYS) == {row.name for row in SETTINGS}


def test_profile_cache_on_off_or_a_directory():
    assert resolve().profile_cache == "on"
    assert resolve(env={"VLLM_DSPARK_PROFILE_CACHE": "0"}).profile_cache == "off"
    assert resolve(opts={"profile_cache": "/tmp/profiles"}).profile_cache == "/tmp/profiles"


def test_async_scheduling_turns_the_default_budget_into_fixed_and_refuses_a_chosen_cut():
    from vllm_dspark.serving.settings import for_async_scheduling

    s, warning = for_async_scheduling(resolve())
    assert s.verification == "fixed" and s.source("verification") == "async scheduling"
    assert "--no-async-scheduling" in warning
    fixed = resolve(opts={"verification": "fixed"})
    assert for_async_scheduling(fixed) == (fixed, None)
    for opts, n in (({"verification": "budget"}, None), ({"max_draft_context": 100}, None), ({}, 3)):
        with pytest.raises(DSparkSettingsError, match="needs synchronous scheduling"):
            for_async_scheduling(resolve(opts=opts, n=n))


def test_v2_names_every_table_setting_it_ignores():
    from vllm_dspark.serving.settings import not_applied_on_v2

    assert not_applied_on_v2({}, copy="off") is None
    # The copy source is on by default: the line says it does not run on V2 whenever it is on.
    assert "the copy source (copy: auto, the default) does not run there" in not_applied_on_v2({})
    assert "does not run there" in not_applied_on_v2({}, copy="auto")
    msg = not_applied_on_v2({"VLLM_DSPARK_CONFIDENCE_THRESHOLD": "0.9", "VLLM_DSPARK_WINDOW": "64", "OTHER": "1"},
                            copy="off")
    assert msg.startswith("VLLM_DSPARK_CONFIDENCE_THRESHOLD, VLLM_DSPARK_WINDOW are not applied")
    assert "OTHER" not in msg and "copy source" not in msg
    msg = not_applied_on_v2({"VLLM_DSPARK_COPY": "auto"})
    assert msg.startswith("VLLM_DSPARK_COPY is not applied") and "upstream's speculator owns the draft" in msg
    assert "copy source" not in not_applied_on_v2({"VLLM_DSPARK_COPY": "off"})


def test_a_settings_error_carries_each_problem_as_a_value():
    from vllm_dspark.serving.settings import DSparkSettingsError

    with pytest.raises(DSparkSettingsError) as info:
        resolve(opts={"probe_period": 8, "probe_max_period": 4, "verification": "fixed"},
                env={"VLLM_DSPARK_CONFIDENCE_THRESHOLD": "0.5"})
    assert len(info.value.problems) == 1 and "probe_max_period" in info.value.problems[0]
    assert "\n" not in info.value.problems[0]
