"""A bad draft directory fails at start-up with one clear message, before any engine starts."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.helpers import tiny_pair
from tests.tiny_pair import make_drafter

pytestmark = pytest.mark.engine  # each case builds an LLM (refused at start-up, or started)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    p = tiny_pair(tmp_path_factory.mktemp("bad_drafts"), vocab=320, bigram_target=False, mode="random",
                  target={"num_layers": 3}, drafter={"block_size": 4, "markov_rank": 16, "target_layer_ids": (0, 1)},
                  draft_name="good")
    return p.root, Path(p.target), Path(p.draft), p.config


def _start(target, draft, n=4):
    from vllm import LLM

    return LLM(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True,
               gpu_memory_utilization=0.15,
               speculative_config={"method": "dspark", "model": str(draft), "num_speculative_tokens": n})


def _variant(pair, name, mutate):
    root, target, good, cfg = pair
    bad = root / name
    shutil.copytree(good, bad)
    mutate(bad)
    return target, bad


def _expect(target, draft, *needles, n=4):
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        _start(target, draft, n)
    msg = str(info.value)
    assert "dspark" in msg.lower(), msg
    for needle in needles:
        assert needle in msg, msg
    assert time.monotonic() - t0 < 30, "the error must come before the engine starts"


def test_missing_weights_file(pair):
    target, bad = _variant(pair, "missing", lambda d: (d / "model.safetensors").unlink())
    _expect(target, bad, "model.safetensors: missing")


def test_wrong_tensor_shape(pair):
    from safetensors.torch import load_file, save_file

    def mutate(d):
        st = load_file(str(d / "model.safetensors"))
        st["fc.weight"] = st["fc.weight"][:, :-8].contiguous()
        save_file(st, str(d / "model.safetensors"))

    target, bad = _variant(pair, "shape", mutate)
    _expect(target, bad, "fc.weight", "shape")


def test_vocab_mismatch(pair):
    root, target, good, cfg = pair
    other = make_drafter(root / "vocab", cfg.replace(vocab_size=cfg.vocab_size + 64))
    _expect(target, other, "vocab", str(cfg.vocab_size + 64), str(cfg.vocab_size))


def test_target_layer_beyond_target(pair):
    def mutate(d):
        c = json.loads((d / "config.json").read_text())
        c["dflash_config"]["target_layer_ids"] = [0, 5]
        c["num_target_layers"] = 6
        (d / "config.json").write_text(json.dumps(c))

    target, bad = _variant(pair, "layers", mutate)
    _expect(target, bad, "layer 5", "3 layers")


def test_too_many_speculative_tokens(pair):
    _, target, good, _ = pair
    _expect(target, good, "num_speculative_tokens", n=9)


def test_bad_threshold(pair, monkeypatch):
    _, target, good, _ = pair
    monkeypatch.setenv("VLLM_DSPARK_CONFIDENCE_THRESHOLD", "1.5")
    _expect(target, good, "VLLM_DSPARK_CONFIDENCE_THRESHOLD", "[0, 1]")
