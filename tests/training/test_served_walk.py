"""The served-walk metric: the walk itself on hand-made hits, and its hits against the teacher-forced eval."""

from __future__ import annotations

import numpy as np
import torch

from tests.training.test_trainer import _config, embed, features, target_dir  # noqa: F401 (fixtures)
from training.pipeline.drafter import init_drafter
from training.pipeline.served_walk import anchor_hits, answer_spans, served_walk, summarize, walk
from training.pipeline.trainer import block_hits, evaluate


def test_answer_spans_are_the_runs_of_target_tokens():
    assert answer_spans(np.array([0, 0, 1, 1, 1, 0, 1, 0, 1, 1])) == [(2, 5), (6, 7), (8, 10)]
    assert answer_spans(np.zeros(4)) == []


def test_the_walk_jumps_past_what_was_accepted():
    hits = np.zeros((20, 3), dtype=bool)
    hits[2] = [True, True, False]  # anchor 2: 2 accepted -> next anchor 5
    hits[5] = [True, True, True]  # all 3 -> next anchor 9
    hits[3] = [True, True, True]  # never visited: the walk skips anchor 3
    steps = walk(hits, [(2, 12)])
    # anchors 2, 5, 9, 10 (9 and 10 miss; 11 is the answer's last token: no draft after it)
    assert steps == [2, 3, 0, 0]
    s = summarize(steps, 3)
    assert s["accept_len"] == 1 + 5 / 4
    assert s["p_run_ge"] == [0.5, 0.5, 0.25]
    assert walk(hits, [(5, 6)]) == []  # a one-token answer has nothing to draft


def test_the_walk_restarts_at_every_answer():
    hits = np.ones((30, 2), dtype=bool)
    # (0, 7): anchors 0 and 3 (6 is the answer's last token); (10, 14): anchor 10 (13 is its last).
    assert walk(hits, [(0, 7), (10, 14)]) == [2, 2, 2]


def test_served_hits_equal_the_teacher_forced_blocks(features, target_dir, embed):  # noqa: F811
    fs, _ = features
    cfg = _config(target_dir)
    model = init_drafter(cfg, seed=0).eval()
    hits = anchor_hits(model, fs, 0, embed, embed, None, block_hits=block_hits)
    gen = fs.gen[int(fs.offsets[0]):int(fs.offsets[1])]
    anchors = [t for a, b in answer_spans(gen) for t in range(a, b - 1)]
    pick = torch.tensor(anchors[::5])
    tf = evaluate(model, fs, {0: pick}, embed, embed, None)
    expect = hits[pick.numpy()]
    assert tf["blocks"] == len(pick)
    got_len = float(1 + np.cumprod(expect, axis=1).sum(1).mean())
    assert abs(tf["tf_accept_len"] - round(got_len, 4)) < 1e-9
    assert tf["acc_per_pos"] == [round(x, 4) for x in expect.mean(0).tolist()]


def test_served_walk_reports_vllm_convention(features, target_dir, embed):  # noqa: F811
    fs, _ = features
    cfg = _config(target_dir)
    model = init_drafter(cfg, seed=0)
    r = served_walk(model, fs, embed, embed, None, block_hits=block_hits, max_tokens=60)
    assert r["conversations"] == 2 and r["steps"] > 0
    assert 1.0 <= r["accept_len"] <= 1 + cfg.block_size
    p = r["p_run_ge"]
    assert len(p) == cfg.block_size and all(p[i] >= p[i + 1] for i in range(len(p) - 1))
    assert abs(r["accept_len"] - (1 + sum(p))) < 1e-3  # E[n] = sum_k P(n >= k)
    assert model.training  # restored


def test_training_evals_report_the_served_walk_and_log_full_vocabulary_steps(features, target_dir, embed,  # noqa: F811
                                                                             tmp_path):
    from training.pipeline.trainer import TrainArgs, eval_anchors, train

    fs, _ = features
    cfg = _config(target_dir)
    sets = {"held": (fs, eval_anchors(fs, cfg.block_size, 8, seed=1))}
    args = TrainArgs(steps=3, seqs_per_step=2, anchors_per_seq=3, eval_every=3, log_every=3, full_vocab_every=2)
    rec = train(init_drafter(cfg, seed=0), embed, embed, fs, sets, args, tmp_path / "r", log=lambda *_: None)
    logged = {r["step"]: r for r in rec["curve"]}
    # Steps 0 and 2 (done 1 and 3) scored the whole vocabulary: both logged though log_every is 3.
    assert logged[1]["full_vocab"] and logged[3]["full_vocab"]
    served = logged[3]["eval"]["held"]["served"]
    assert served["steps"] > 0 and 1.0 <= served["accept_len"] <= 1 + cfg.block_size


def test_the_bootstrap_interval_holds_the_walk_and_narrows_with_more_conversations():
    from training.pipeline.served_walk import bootstrap_accept_len

    g = np.random.default_rng(0)
    few = [list(g.integers(0, 4, size=g.integers(5, 30))) for _ in range(8)]
    many = few * 16
    a, b = bootstrap_accept_len(few), bootstrap_accept_len(many)
    steps = [n for c in few for n in c]
    assert a["accept_len"] == b["accept_len"] == round(1 + sum(steps) / len(steps), 4)
    assert a["lo"] < a["accept_len"] < a["hi"] and b["hi"] - b["lo"] < (a["hi"] - a["lo"]) / 2
    assert bootstrap_accept_len([[], []])["steps"] == 0
