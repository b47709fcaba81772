"""The serve-time draft vocabulary's settings (``draft_vocab``, ``draft_vocab_table``), its start-up
checks and the frequency table it ranks by (no engine)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import tiny_config
from vllm_dspark.checkpoint.token_frequency import (
    FILE_NAME,
    FrequencyTableError,
    draft_vocab_ids,
    load_frequency_table,
    table_from_counts,
    write_frequency_table,
)
from vllm_dspark.serving.settings import DSparkSettingsError, resolve_settings
from vllm_dspark.serving.validate import DSparkDraftError, read_dspark_draft, validate_draft_for_serving

V = 80  # tiny_config's vocabulary


def resolve(*, opts=None, env=None, cfg=None):
    cfg = cfg or tiny_config(max_position_embeddings=4096)
    return resolve_settings(cfg, draft="/d", dflash_config=None, spec_options=opts, num_speculative_tokens=None,
                            served_context=4096, environ=env or {})


def test_auto_by_default_and_a_size_from_the_config_or_the_environment():
    s = resolve()  # auto: no table beside "/d", so the whole vocabulary
    assert s.draft_vocab is None and s.draft_vocab_table is None and s.draft_vocab_auto
    assert s.source("draft_vocab").startswith("auto: off")
    s = resolve(opts={"draft_vocab": 40})
    assert s.draft_vocab == 40 and s.draft_vocab_table == f"/d/{FILE_NAME}"
    assert "drafter's directory" in s.source("draft_vocab_table") and "draft vocabulary 40" in s.describe()
    s = resolve(env={"VLLM_DSPARK_DRAFT_VOCAB": "12", "VLLM_DSPARK_DRAFT_VOCAB_TABLE": "/t.json"})
    assert (s.draft_vocab, s.draft_vocab_table) == (12, "/t.json")
    assert s.source("draft_vocab") == "VLLM_DSPARK_DRAFT_VOCAB"
    assert resolve(opts={"draft_vocab": "off"}, env={"VLLM_DSPARK_DRAFT_VOCAB": "12"}).draft_vocab is None
    assert resolve(opts={"draft_vocab": 40}).to_dict()["draft_vocab"] == 40
    assert not resolve(opts={"draft_vocab": 40}).draft_vocab_auto


def test_auto_takes_the_table_beside_the_drafter_when_there_is_one(tmp_path):
    from vllm_dspark.serving.settings_table import AUTO_DRAFT_VOCAB

    cfg = tiny_config(max_position_embeddings=4096, vocab_size=4 * AUTO_DRAFT_VOCAB)

    def auto(draft, **changes):
        return resolve_settings(cfg.replace(**changes), draft=str(draft), dflash_config=None, spec_options=None,
                                num_speculative_tokens=None, served_context=4096, environ={})

    assert auto(tmp_path).draft_vocab is None  # no table yet
    (tmp_path / FILE_NAME).write_text("{}")
    s = auto(tmp_path)
    assert (s.draft_vocab, s.draft_vocab_table) == (AUTO_DRAFT_VOCAB, str(tmp_path / FILE_NAME))
    assert s.draft_vocab_auto and s.source("draft_vocab").startswith(f"auto: {AUTO_DRAFT_VOCAB}")
    assert auto(tmp_path, draft_vocab_size=1000).draft_vocab is None  # its own vocabulary: no slicing
    assert auto(tmp_path, vocab_size=AUTO_DRAFT_VOCAB).draft_vocab is None  # no smaller than the target's


@pytest.mark.parametrize("value, needle", [
    (0, "expected 'auto', 'off' or a number N of draft tokens"),
    (-3, "expected 'auto', 'off' or a number N of draft tokens"),
    ("half", "draft_vocab (speculative_config['dspark']['draft_vocab']): got 'half'"),
    (True, "expected 'auto', 'off' or a number N"),
    (2.5, "expected 'auto', 'off' or a number N"),
    (V, f"got {V}, but the vocabulary has {V} tokens; set 1 <= draft_vocab < {V}"),
    (10 * V, "set 1 <= draft_vocab"),
])
def test_bad_sizes_are_refused_naming_the_setting_and_the_fix(value, needle):
    with pytest.raises(DSparkSettingsError) as exc:
        resolve(opts={"draft_vocab": value})
    assert needle in str(exc.value)


def test_a_drafter_with_its_own_draft_vocabulary_is_refused():
    cfg = tiny_config(max_position_embeddings=4096, draft_vocab_size=32)
    with pytest.raises(DSparkSettingsError, match="already has a draft vocabulary"):
        resolve(opts={"draft_vocab": 16}, cfg=cfg)


# ---------------------------------------------------------------- the table
def test_table_round_trip_ranking_and_draft_ids(tmp_path):
    counts = [0] * V
    counts[5], counts[7], counts[9], counts[3] = 10, 30, 10, 1
    t = table_from_counts(counts, vocab_size=V, source="unit")
    assert t.ids == (7, 5, 9, 3) and t.counts == (30, 10, 10, 1) and t.tokens == 51
    path = write_frequency_table(tmp_path / "t.json", t)
    assert not list(tmp_path.glob(".*tmp"))  # written through a temporary file, renamed
    back = load_frequency_table(path)
    assert (back.ids, back.counts, back.vocab_size, back.source) == (t.ids, t.counts, V, "unit")
    assert draft_vocab_ids(back, 2) == [5, 7]
    # Past the ranked ids: the rest in id order.
    assert draft_vocab_ids(back, 6) == [0, 1, 3, 5, 7, 9]
    # A required (end-of-sequence) id replaces the least frequent one, never another required one.
    assert draft_vocab_ids(back, 3, required=[2, 79]) == [2, 7, 79]
    assert back.coverage([7, 5]) == pytest.approx(40 / 51)
    with pytest.raises(FrequencyTableError):
        draft_vocab_ids(back, V)


@pytest.mark.parametrize("raw, needle", [
    ("not json", "not a readable JSON"),
    ({"vocab_size": 4, "tokens": 3, "ids": [1, 1], "counts": [2, 1]}, "listed twice"),
    ({"vocab_size": 4, "tokens": 3, "ids": [1, 9], "counts": [2, 1]}, "outside the vocabulary"),
    ({"vocab_size": 4, "tokens": 3, "ids": [1, 2], "counts": [1, 2]}, "not ranked"),
    ({"vocab_size": 4, "tokens": 1, "ids": [1, 2], "counts": [2, 1]}, "below the sum"),
    ({"vocab_size": 4, "ids": [1]}, "two lists of one length"),
])
def test_a_bad_table_is_refused_naming_the_file(tmp_path, raw, needle):
    p = tmp_path / "t.json"
    p.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    with pytest.raises(FrequencyTableError) as exc:
        load_frequency_table(p)
    assert needle in str(exc.value) and str(p) in str(exc.value) and "vocab-table" in str(exc.value)


# ---------------------------------------------------------------- start-up (validate)
def _draft(tiny_ckpt, tmp_path):
    d = tmp_path / "draft"
    shutil.copytree(tiny_ckpt, d)
    return d


def _validate(d, opts):
    return validate_draft_for_serving(read_dspark_draft(d), None, num_speculative_tokens=None, served_context=512,
                                      spec_options=opts, environ={})


def test_start_up_refuses_a_missing_table_and_one_of_another_vocabulary(tiny_ckpt, tmp_path):
    d = _draft(tiny_ckpt, tmp_path)
    with pytest.raises(DSparkDraftError) as exc:
        _validate(d, {"draft_vocab": 40})
    msg = str(exc.value)
    assert "draft_vocab 40 needs a token frequency table" in msg and "draft_vocab_table" in msg
    assert str(d / FILE_NAME) in msg and "no such file" in msg
    other = tmp_path / "other.json"
    write_frequency_table(other, table_from_counts([1] * (V + 8), vocab_size=V + 8, source="x"))
    with pytest.raises(DSparkDraftError) as exc:
        _validate(d, {"draft_vocab": 40, "draft_vocab_table": str(other)})
    assert f"counts a vocabulary of {V + 8} tokens, but the target's has {V}" in str(exc.value)
    # The table in the drafter's directory is found by default.
    write_frequency_table(d / FILE_NAME, table_from_counts([1] * V, vocab_size=V, source="x"))
    _, s = _validate(d, {"draft_vocab": 40})
    assert s.draft_vocab == 40 and s.draft_vocab_table == str(d / FILE_NAME)
