"""The training prompts: ShareGPT's truncated file, the filters, and disjointness from every evaluation prompt.

Nothing here reads the 125 MB ShareGPT file: the record of the prompts actually
trained on (hashes + MinHash sketches) is checked against the evaluation sets.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from training.pipeline import prompt_set, sharegpt
from training.pipeline.chat_prompts import chat_eval_prompts, copy_eval_prompts, humaneval_prompts
from vllm_dspark.tools.prompt_record import read_record

RECORD = Path(__file__).resolve().parents[2] / "vllm_dspark" / "assets" / "smollm2" / "train_prompts.npz"


def test_a_cut_off_json_array_yields_its_complete_records_and_one_line(tmp_path):
    recs = [{"id": i, "conversations": [{"from": "human", "value": f"What is {i} plus {i}?"}]} for i in range(3)]
    text = json.dumps(recs, indent=1)
    cut = text[:text.rindex('"value"') + 12]  # inside the last record's string
    (tmp_path / "f.json").write_text(cut)
    lines: list[str] = []
    got = list(sharegpt.iter_records(tmp_path / "f.json", log=lines.append))
    assert [r["id"] for r in got] == [0, 1]
    assert len(lines) == 1 and "cut off after record 2" in lines[0]
    (tmp_path / "g.json").write_text(text)
    assert [r["id"] for r in sharegpt.iter_records(tmp_path / "g.json", log=lines.append)] == [0, 1, 2]
    assert len(lines) == 1


@pytest.mark.parametrize("text,ok", [
    ("How do I sort a list of dictionaries by a key in Python?", True),
    ("Write a short poem about the sea and the wind.", True),
    ("Пожалуйста, напиши мне письмо для моего начальника о повышении", False),
    ("请帮我写一篇关于环境保护的文章，字数在五百字左右", False),
    ("hi", False),
    ("Summarize https://example.com/article for me please", False),
    ("x" * 2000, False),
])
def test_usable_turns_are_english_and_of_answerable_length(text, ok):
    assert sharegpt.usable_turn(text) is ok


def test_a_code_prompt_that_restates_a_humaneval_task_is_caught():
    index = prompt_set.evaluation_index()
    he = humaneval_prompts(3)
    # HumanEval/0 restated inside another request, with other words around it.
    body = he[0].split("```python\n", 1)[1]
    assert index.why_excluded(f"Can you help me with my homework? {body} Please explain your answer.")
    assert "entry point" in index.why_excluded("Fix my has_close_elements implementation, it is slow")
    assert index.why_excluded(chat_eval_prompts()[0].upper() + "!!")  # equal after normalisation
    assert index.why_excluded("Explain how a compiler allocates registers for local variables.") is None
    # Short evaluation prompts are compared on word 3-grams, which makes the filter conservative:
    # "How do I reverse a string in Python?" also excludes this one (3 of its 6 3-grams).
    assert index.why_excluded("How do I reverse a linked list in C?")


def test_minhash_estimates_jaccard():
    a = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat"
    b = a.replace("sleeps", "naps")
    c = "completely different words about compilers registers and instruction scheduling today"
    sa, sb, sc = (prompt_set.minhash(t) for t in (a, b, c))
    assert prompt_set.estimated_jaccard(sa[None], sb)[0] > 0.4
    assert prompt_set.estimated_jaccard(sa[None], sc)[0] < 0.2
    assert np.array_equal(prompt_set.minhash(a), sa)  # a fixed, seeded family


@pytest.mark.skipif(not RECORD.exists(), reason="no training run recorded its prompts yet")
def test_the_recorded_training_prompts_are_disjoint_from_every_evaluation_prompt():
    rec = read_record(RECORD)
    hashes = set(int(h) for h in rec["hashes"])
    assert len(hashes) > 1000 and rec["minhash"].shape == (len(rec["hashes"]), prompt_set.NUM_PERM)
    evals = chat_eval_prompts() + humaneval_prompts() + copy_eval_prompts()
    assert len(copy_eval_prompts()) == 16
    assert not hashes & {prompt_set.prompt_hash(p) for p in evals}
    # The filter dropped every prompt holding >= NEAR_DUP of an evaluation prompt's n-grams. 16 MinHash
    # values estimate Jaccard to about +-0.12, so 12 of 16 equal would be a near-duplicate that slipped.
    worst = max(float(prompt_set.estimated_jaccard(rec["minhash"], prompt_set.minhash(p)).max()) for p in evals)
    assert worst < 0.75, worst
    assert rec["stats"]["dropped"]["near_duplicate"] > 0  # the filter ran on the real set
