"""The copy's acceptance by match length, measured offline and stored with the drafter (copy_prior.py)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tests.spec_decode.test_copy_source import brute_force
from vllm_dspark.spec_decode.common.calibration import Calibrator
from vllm_dspark.spec_decode.common.copy_prior import PRIOR_FILE, CopyPrior, CopyPriorError, load, measure
from vllm_dspark.spec_decode.common.suffix_index import match_confidence


def replay(tokens: list[int], spans, k: int) -> Calibrator:
    """What serving's copy calibrator would count, step by step, written out the long way."""
    cal = Calibrator(k, memory=0)
    for start, end in spans:
        t = start
        while t < end - 1:
            got, match = brute_force(tokens[:t + 1], k, 2, 8)  # the copy by definition
            truth = tokens[t + 1:end]
            acc = 0
            while acc < min(len(got), len(truth)) and got[acc] == truth[acc]:
                acc += 1
            if got:
                cal.observe([match_confidence(match)] * len(got), len(got), acc, False)
            t += min(acc + 1, end - 1 - t)
    return cal


def test_the_walk_counts_what_the_copys_calibrator_would_have_counted():
    rng = random.Random(0)
    texts = []
    for _ in range(6):
        prompt = [rng.randrange(20) for _ in range(40)]
        answer = prompt[5:25] + [rng.randrange(20) for _ in range(15)] + prompt[10:20]
        texts.append((prompt + answer, [(len(prompt), len(prompt) + len(answer))]))
    prior = measure(texts, 6)
    for tokens, spans in texts[:1]:
        one = measure([(tokens, spans)], 6)
        cal = replay(tokens, spans, 6)
        assert np.array_equal(one.counts, cal.total_counts[0]) and np.array_equal(one.hits, cal.total_hits[0])
    assert prior.meta["answers"] == 6 and prior.counts[0].sum() == prior.meta["drafting_steps"] > 0
    assert 0 < prior.accepted_per_step() <= 6


def test_a_prior_round_trips_and_a_bad_one_names_its_file(tmp_path):
    prior = measure([([1, 2, 3, 1, 2, 3, 1, 2, 3, 1], [(4, 10)])], 4)
    assert load(tmp_path) is None
    prior.save(tmp_path / PRIOR_FILE)
    back = load(tmp_path)
    assert back is not None and np.array_equal(back.hits, prior.hits) and back.meta == prior.meta
    raw = json.loads((tmp_path / PRIOR_FILE).read_text())
    raw["hits"][0][0] = raw["counts"][0][0] + 5
    (tmp_path / PRIOR_FILE).write_text(json.dumps(raw))
    with pytest.raises(CopyPriorError, match=str(tmp_path / PRIOR_FILE)):
        load(tmp_path)


def test_a_seed_is_believed_at_once_then_outweighed_and_never_reported_as_measured():
    cal = Calibrator(4)
    hits, counts, pred = (np.zeros((4, 10)) for _ in range(3))
    counts[:, 9], hits[:, 9], pred[:, 9] = 5000, 4900, 5000 * 0.95
    cal.seed(hits, counts, pred)
    conf = np.full((1, 4), 0.95)
    assert cal.calibrate(conf, np.zeros(1, bool))[0, 0] > 0.9
    assert not cal.measured(False) and cal.table()["count"] == [0, 0, 0, 0]
    for _ in range(200):
        cal.observe([0.95] * 4, 4, 0, False)  # every copy rejected now
    assert cal.calibrate(conf, np.zeros(1, bool))[0, 0] < 0.3


def test_the_default_drafter_ships_a_prior_measured_on_its_answers():
    from vllm_dspark.tools.default_pair import draft_dir

    prior = load(draft_dir())
    assert isinstance(prior, CopyPrior) and prior.meta["answers"] > 100
    assert set(prior.meta["sets"]) == {"eval_chat", "eval_humaneval", "eval_sharegpt"}
    rate = prior.hits[0] / np.maximum(prior.counts[0], 1)
    assert rate[9] > rate[3] > 0.3  # longer matches are accepted more, and even 2 tokens often
