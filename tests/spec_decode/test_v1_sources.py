"""V1's draft sources below the engine: text sources' offers from the batch's texts, and each row's drafts
taken from the source the planner picked."""

from __future__ import annotations

import types

import numpy as np
import torch

from vllm_dspark.spec_decode.common.copy_source import CopySource, match_confidence
from vllm_dspark.spec_decode.common.drafts import Drafts, DraftSource
from vllm_dspark.spec_decode.common.sources import COPY_SOURCE, MODEL_SOURCE
from vllm_dspark.spec_decode.v1.sources import pick_rows, request_texts, text_offers


def _texts(rows: dict[int, list[int]], ids: list[str]) -> dict[int, tuple]:
    return {i: (ids[i], np.asarray(t[:-1]), (t[-1],), 2) for i, t in rows.items()}


def test_the_copy_is_a_text_source_and_the_markov_stage_is_not():
    from vllm_dspark.spec_decode.common.drafts import MarkovStage

    src = CopySource()
    assert isinstance(src, DraftSource) and src.reads_hidden is False
    assert MarkovStage.reads_hidden is True


def test_offers_cover_the_whole_batch_and_only_the_rows_that_may_draft():
    src = CopySource(min_match=2, max_match=8)
    ids = ["a", "b", "c"]
    texts = _texts({0: [1, 2, 3, 4, 1, 2], 1: [7, 8, 9, 7, 8], 2: [5, 6, 5, 6]}, ids)
    offers = text_offers([src], ids, [4, 4, 0], texts, torch.tensor([2, 8, 6]), 4)
    offer = offers[COPY_SOURCE]
    assert offer.drafts.tokens.shape == (3, 4)
    # Row 1's copy reaches the present after 3 tokens (period 3) and continues with itself.
    assert offer.drafts.tokens[0].tolist() == [3, 4, 1, 2] and offer.drafts.tokens[1].tolist() == [9, 7, 8, 9]
    assert offer.lengths == [4, 4, 0]  # row 2 has a match but no cap: not drafted
    assert offer.drafts.confidence[0, 0].item() == np.float32(match_confidence(2))
    view = offer.view()
    assert view.lengths == offer.lengths and view.confidence.shape == (3, 4)


def test_the_batch_retires_the_indexes_of_requests_that_left():
    src = CopySource()
    texts = _texts({0: [1, 2, 1, 2], 1: [3, 4, 3, 4]}, ["a", "b"])
    text_offers([src], ["a", "b"], [2, 2], texts, torch.tensor([2, 4]), 2)
    assert set(src.indexes) == {"a", "b"}
    text_offers([src], ["b"], [2], {0: texts[1]}, torch.tensor([4]), 2)
    assert set(src.indexes) == {"b"}


def _drafts(tokens, conf, source, probs=None) -> Drafts:
    return Drafts(torch.tensor(tokens), torch.tensor(conf, dtype=torch.float32), probs, source, source)


def test_each_row_takes_its_picked_sources_drafts_and_a_sampled_copy_row_gets_a_one_hot_q():
    probs = torch.full((3, 2, 10), 0.1)
    model = _drafts([[1, 2], [3, 4], [5, 6]], [[0.9, 0.8]] * 3, MODEL_SOURCE, probs)
    copy = _drafts([[7, 8], [0, 0], [9, 9]], [[0.5, 0.5], [0, 0], [0.6, 0.6]], COPY_SOURCE)
    got = pick_rows({MODEL_SOURCE: model, COPY_SOURCE: copy}, [COPY_SOURCE, MODEL_SOURCE, COPY_SOURCE],
                    np.array([True, True, False]))
    assert got.tokens.tolist() == [[7, 8], [3, 4], [9, 9]]
    assert got.confidence[0].tolist() == [0.5, 0.5] and torch.equal(got.confidence[1], model.confidence[1])
    assert got.probs is not None
    assert got.probs[0, 0, 7] == 1 and got.probs[0, 0].sum() == 1 and got.probs[0, 1, 8] == 1  # sampled copy row
    assert got.probs[2].sum() == 0  # a greedy copy row needs no q
    assert torch.equal(got.probs[1], probs[1])
    assert model.tokens.tolist()[0] == [1, 2]  # the sources' records are not written


def test_without_the_models_drafts_there_is_no_q_and_nothing_is_merged():
    copy = _drafts([[7, 8]], [[0.5, 0.5]], COPY_SOURCE)
    got = pick_rows({COPY_SOURCE: copy}, [COPY_SOURCE], np.array([True]))
    assert got is copy and got.probs is None


def test_request_texts_reads_the_accepted_text_and_skips_a_prefill_chunk():
    tokens = np.array([[1, 2, 3, 4, 9, 9], [5, 6, 7, 0, 0, 0]])
    ib = types.SimpleNamespace(num_tokens_no_spec=[3, 3], num_computed_tokens_cpu=[2, 0], token_ids_cpu=tokens,
                               num_prompt_tokens=[2, 3])
    cad = types.SimpleNamespace(query_start_loc_cpu=torch.tensor([0, 3, 5]))
    # Row 0 verified 2 drafts (4, 9) and rejected 1; row 1 is a prefill chunk of 2 of its 3 prompt tokens.
    got = request_texts(types.SimpleNamespace(input_batch=ib), ["a", "b"], cad, torch.tensor([1, 0]),
                        torch.tensor([11, 12]))
    assert list(got) == [0]
    rid, head, tail, prompt = got[0]
    assert (rid, head.tolist(), tail, prompt) == ("a", [1, 2, 3, 4], (11,), 2)
