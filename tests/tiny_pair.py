"""Tiny target/drafter pairs in the real on-disk layouts, built in seconds on a CPU.

Used by the test-suite, the smoke scripts and anyone who wants to try the
plugin without a GPU or a model hub:

* ``make_tokenizer``: a byte-level tokenizer (256 byte tokens, then filler
  special tokens up to the vocabulary size) that vLLM loads from a directory.
* ``make_target``: a Qwen3 or Llama causal LM in the Hugging Face layout. With
  ``bigram`` it is (almost) a bigram model: its greedy next token is
  ``bigram[current token]``, computed through the real attention and MLP
  layers, whose contribution is kept small.
* ``make_drafter``: a DSpark drafter in SpecForge's export layout (one
  safetensors file, no embedding or LM head). ``oracle`` mode encodes a bigram
  table in the Markov head and silences the backbone, so its right answer is
  known: when the table equals the target's, every draft token is accepted.
  ``random`` mode exercises every weight of the backbone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from vllm_dspark.checkpoint.io import save_checkpoint
from vllm_dspark.config import DSparkConfig
from vllm_dspark.model.reference import DSparkDraftModel
from vllm_dspark.ops.markov_reference import d2t_of_target_ids


def make_tokenizer(path: str | Path, vocab_size: int) -> Path:
    """Byte-level tokenizer with exactly ``vocab_size`` ids; ids >= 256 are special fillers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < 260:
        raise ValueError(f"vocab_size {vocab_size} too small: need 256 byte tokens + 4 specials")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"]
    specials += [f"<|x{i}|>" for i in range(vocab_size - 256 - len(specials))]
    tok.add_special_tokens(specials)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False,
    }, indent=2))
    return path


TOKEN_IDS = {"bos": 256, "eos": 257, "pad": 258, "mask": 259}


def random_bigram(vocab_size: int, seed: int = 0, allowed: int | None = None) -> torch.Tensor:
    """A random next-token table over the first ``allowed`` ids (default: bytes only)."""
    g = torch.Generator().manual_seed(seed)
    allowed = allowed or 256
    table = torch.randint(0, allowed, (vocab_size,), generator=g)
    return table


def _unit_rows(n: int, dim: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, dim, generator=g)
    return x / x.norm(dim=-1, keepdim=True)


def make_target(path: str | Path, *, arch: str = "qwen3", vocab_size: int = 384, hidden_size: int = 128,
                num_layers: int = 4, num_heads: int = 2, num_kv_heads: int = 1, head_dim: int = 64,
                intermediate_size: int = 256, bigram: torch.Tensor | None = None, seed: int = 0,
                dtype: torch.dtype = torch.float32, max_position_embeddings: int = 4096) -> Path:
    """Save a small causal LM (+ tokenizer) that vLLM serves from ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                  intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
                  bos_token_id=TOKEN_IDS["bos"], eos_token_id=TOKEN_IDS["eos"], pad_token_id=TOKEN_IDS["pad"],
                  tie_word_embeddings=False, rms_norm_eps=1e-6)
    if arch == "qwen3":
        cfg, cls = Qwen3Config(**common), Qwen3ForCausalLM
    elif arch == "llama":
        cfg, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        raise ValueError(f"arch {arch!r}: expected 'qwen3' or 'llama'")
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05, generator=g)
        if bigram is not None:
            # Strong bigram path: logits_j ~ beta * <u_j', u_x> for j = bigram[x].
            u = _unit_rows(vocab_size, hidden_size, g)
            model.model.embed_tokens.weight.copy_(u)
            lm = torch.zeros(vocab_size, hidden_size)
            # Each output row collects the embeddings of the tokens that map to it.
            lm.index_add_(0, bigram, u)
            model.lm_head.weight.copy_(lm * 4.0)
            for layer in model.model.layers:  # keep layers contributing, but small
                layer.self_attn.o_proj.weight.mul_(0.02)
                layer.mlp.down_proj.weight.mul_(0.02)
    model = model.to(dtype)
    model.save_pretrained(str(path), safe_serialization=True)
    make_tokenizer(path, vocab_size)
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": TOKEN_IDS["bos"], "eos_token_id": TOKEN_IDS["eos"], "pad_token_id": TOKEN_IDS["pad"]}))
    return path


def drafter_config_for(target_dir: str | Path, *, block_size: int = 7, target_layer_ids=None,
                       num_layers: int = 1, markov_rank: int = 32, confidence: bool = True,
                       with_markov: bool = True, num_heads: int | None = None, num_kv_heads: int | None = None,
                       head_dim: int = 64, intermediate_size: int | None = None,
                       mask_token_id: int | None = None) -> DSparkConfig:
    """A DSparkConfig that fits the target saved at ``target_dir``."""
    t = json.loads((Path(target_dir) / "config.json").read_text())
    n_t = t["num_hidden_layers"]
    if target_layer_ids is None:  # spread over the target, never its last layer
        target_layer_ids = sorted({max(0, round(i * (n_t - 2) / 2)) for i in range(3)})
    heads = num_heads or max(1, t["hidden_size"] // head_dim)
    return DSparkConfig(
        hidden_size=t["hidden_size"], num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=num_kv_heads or max(1, heads // 2), head_dim=head_dim,
        intermediate_size=intermediate_size or 2 * t["hidden_size"], rms_norm_eps=1e-6,
        vocab_size=t["vocab_size"], max_position_embeddings=t.get("max_position_embeddings", 4096),
        rope_theta=10000.0, dtype="bfloat16", block_size=block_size, target_layer_ids=tuple(target_layer_ids),
        num_target_layers=n_t, mask_token_id=TOKEN_IDS["mask"] if mask_token_id is None else mask_token_id,
        markov_rank=markov_rank, enable_confidence_head=confidence,
        confidence_head_with_markov=with_markov and confidence and markov_rank > 0)


def random_drafter(config: DSparkConfig, *, generator: torch.Generator | None = None, seed: int = 0,
                   scale: float = 0.05) -> DSparkDraftModel:
    """A reference drafter with every weight random: norms in [0.8, 1.2], the rest N(0, scale^2)."""
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    model = DSparkDraftModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2, generator=g)
            else:
                p.normal_(0.0, scale, generator=g)
    return model


def make_drafter(path: str | Path, config: DSparkConfig, *, mode: str = "random", bigram: torch.Tensor | None = None,
                 confidence_by_prev: torch.Tensor | None = None, seed: int = 0, scale: float = 0.05,
                 backbone_scale: float = 0.0, legacy_names: bool = False) -> Path:
    """Save a DSpark drafter in SpecForge's export layout.

    mode ``random``: every weight random (``scale``), the backbone matters.
    mode ``oracle``: Markov head encodes ``bigram``; the backbone's output is
    scaled by ``backbone_scale`` (final norm weight; 0 silences it, small values
    keep the tokens on the bigram while the confidence head, whose hidden part is
    scaled up to match, still depends on every backbone weight);
    ``confidence_by_prev`` ([V] probabilities) instead sets each position's
    confidence from its previous token alone. A gated or rnn head passes the
    table through (:func:`_open_head`); with ``markov_rank`` >= the vocabulary
    the table is exact.
    """
    g = torch.Generator().manual_seed(seed)
    model = random_drafter(config, generator=g, scale=scale)
    with torch.no_grad():
        if mode == "oracle":
            if bigram is None or model.markov_head is None:
                raise ValueError("oracle mode needs a bigram table and markov_rank > 0")
            model.norm.weight.fill_(backbone_scale)
            v, r = config.vocab_size, config.markov_rank
            # With rank >= vocabulary, one basis vector per token: the table is exact (random rows in
            # fewer dimensions leak a little of every row into every other, enough to map a few tokens
            # wrongly), and an elementwise map of a row (the rnn head's tanh) keeps the rows apart.
            u = torch.eye(v, r) if r >= v else _unit_rows(v, r, g)
            model.markov_head.markov_w1.weight.copy_(u)
            w2 = torch.zeros(config.vocab_size, config.markov_rank)
            w2.index_add_(0, bigram, u)  # bias[bigram[x]] gets <u_x, u_x> = 1
            model.markov_head.markov_w2.weight.copy_(w2 * 8.0)
            _open_head(model.markov_head, config.markov_rank)
            if model.confidence_head is not None:
                h = config.hidden_size
                w = model.confidence_head.proj.weight
                if backbone_scale > 0:
                    w[0, :h].normal_(0.0, 1.0 / (backbone_scale * math.sqrt(h)), generator=g)
                else:
                    w[0, :h].zero_()
                w[0, h:].normal_(0.0, 1.0, generator=g)
                model.confidence_head.proj.bias.fill_(1.5)
                if confidence_by_prev is not None and config.confidence_head_with_markov:
                    # logit(c) = v . u_prev with v chosen by least squares over all tokens.
                    logit = torch.logit(confidence_by_prev.clamp(1e-4, 1 - 1e-4).float())
                    sol = torch.linalg.lstsq(u, logit[:, None]).solution[:, 0]
                    w[0, :h].zero_()
                    w[0, h:] = sol
                    model.confidence_head.proj.bias.zero_()
        elif mode != "random":
            raise ValueError(f"mode {mode!r}: expected 'random' or 'oracle'")
    state = dict(model.state_dict())
    out = save_checkpoint(path, config, state)
    if legacy_names:
        _rename_to_legacy(out)
    return out


def _open_head(head, rank: int) -> None:
    """An oracle's gated or rnn head passes the table through: the gate open (sigmoid(8)), the rnn's
    output ``tanh(3 e)`` read from the token alone (its state and the hidden rows weigh nothing)."""
    gate, joint = getattr(head, "gate_proj", None), getattr(head, "joint_proj", None)
    if gate is not None:
        gate.weight.zero_()
        gate.bias.fill_(8.0)
    if joint is not None:  # rows [a ; c ; o], columns [s ; e ; h]
        joint.weight.zero_()
        joint.bias.zero_()
        joint.weight[2 * rank:, rank:2 * rank] = 3.0 * torch.eye(rank)


def _rename_to_legacy(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    state = load_file(str(f))
    renamed = {}
    for k, v in state.items():
        if k.startswith("markov_head."):
            k = "logit_head." + k[len("markov_head."):]
        elif k.startswith("confidence_head."):
            k = "logit_head." + k
        renamed[k] = v
    save_file(renamed, str(f), metadata={"format": "pt"})


# ---------------------------------------------------------------- the other families' layouts
def _target_tensor(target: Path, *names: str) -> torch.Tensor:
    """The first of ``names`` in the target's safetensors (its embedding or LM head), as saved."""
    from safetensors import safe_open

    with safe_open(str(Path(target) / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())  # noqa: SIM118 (a safetensors handle, not a dict)
        for name in names:
            if name in keys:
                return f.get_tensor(name)
    raise KeyError(f"{target}: none of {names} in model.safetensors")


def _backbone_dict(cfg: DSparkConfig) -> dict:
    """The Qwen3 layer keys of ``cfg`` as a Hugging Face config writes them (transformers 5 spelling)."""
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    return {"model_type": "qwen3", "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "hidden_act": cfg.hidden_act,
            "rms_norm_eps": cfg.rms_norm_eps, "attention_bias": cfg.attention_bias, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings, "rope_parameters": rope,
            "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": False}


def _head_keys(cfg: DSparkConfig) -> dict:
    return {"mask_token_id": cfg.mask_token_id, "markov_rank": cfg.markov_rank,
            "markov_head_type": cfg.markov_head_type, "enable_confidence_head": cfg.enable_confidence_head,
            "confidence_head_with_markov": cfg.confidence_head_with_markov}


def _write_layout(dst: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def to_deepspec_layout(src: str | Path, dst: str | Path, *, target: str | Path,
                       lm_head_offset: float = 0.0) -> Path:
    """Re-save a SpecForge-layout drafter as DeepSpec's native ``Qwen3DSparkModel`` checkpoint.

    Flat config keys (``block_size``, ``target_layer_ids``, ``mask_token_id``, ... at the top level,
    ``sample_from_anchor`` left out: DeepSpec reads its absence as true), and the file carries
    ``embed_tokens.weight`` and ``lm_head.weight``: exact copies of the target's, as DeepSpec saves
    its frozen ones. ``lm_head_offset`` != 0 adds it to every entry of the LM head copy, which then
    differs from the target's (a drafter whose head is its own).
    """
    from safetensors.torch import load_file

    cfg = DSparkConfig.from_json(src)
    if cfg.draft_vocab_size is not None:
        raise ValueError("to_deepspec_layout: DeepSpec's native checkpoints score the full vocabulary")
    config = {"architectures": ["Qwen3DSparkModel"], **_backbone_dict(cfg), "torch_dtype": cfg.dtype,
              "block_size": cfg.block_size, "target_layer_ids": list(cfg.target_layer_ids),
              "num_target_layers": cfg.num_target_layers, **_head_keys(cfg)}
    if not cfg.sample_from_anchor:
        config["sample_from_anchor"] = False
    tensors = dict(load_file(str(Path(src) / "model.safetensors")))
    tensors["embed_tokens.weight"] = _target_tensor(Path(target), "model.embed_tokens.weight")
    head = _target_tensor(Path(target), "lm_head.weight", "model.embed_tokens.weight")
    tensors["lm_head.weight"] = head + lm_head_offset if lm_head_offset else head
    return _write_layout(Path(dst), config, tensors)


def _draft_vocab_tensors(src: str | Path, cfg: DSparkConfig, target: str | Path, draft_ids, shift: int,
                         caller: str) -> tuple[dict[str, torch.Tensor], int]:
    """The drafter's tensors with a draft vocabulary of ``draft_ids`` (see :func:`to_speculators_layout`)."""
    from safetensors.torch import load_file

    ids = torch.as_tensor(draft_ids, dtype=torch.int64).reshape(-1)
    if ids.numel() == 0 or not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{caller}: draft_ids must be non-empty, sorted and distinct")
    vd = int(ids.numel())
    mapped = torch.roll(ids, -shift) if shift else ids
    tensors = dict(load_file(str(Path(src) / "model.safetensors")))
    head = _target_tensor(Path(target), "lm_head.weight", "model.embed_tokens.weight")
    tensors["lm_head.weight"] = head[ids].to(tensors["norm.weight"].dtype)
    w2 = "markov_head.markov_w2.weight"
    if w2 in tensors:
        tensors[w2] = tensors[w2][ids]
    tensors["d2t"] = d2t_of_target_ids(mapped)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[mapped] = True
    tensors["t2d"] = t2d
    return tensors, vd


def to_specforge_draft_vocab(src: str | Path, dst: str | Path, *, target: str | Path, draft_ids) -> Path:
    """Re-save a SpecForge-layout drafter with a draft vocabulary of ``draft_ids``, still in SpecForge's
    layout (``dflash_config``, top-level ``draft_vocab_size``; ``lm_head`` [Vd, H], ``markov_w2`` [Vd, r],
    ``d2t`` offsets and ``t2d`` as :func:`to_speculators_layout` writes them)."""
    cfg = DSparkConfig.from_json(src)
    tensors, vd = _draft_vocab_tensors(src, cfg, target, draft_ids, 0, "to_specforge_draft_vocab")
    config = json.loads((Path(src) / "config.json").read_text())
    config["draft_vocab_size"] = vd
    return _write_layout(Path(dst), config, tensors)


def to_speculators_layout(src: str | Path, dst: str | Path, *, target: str | Path, draft_ids,
                          shift: int = 0, sample_from_anchor: bool | None = None) -> Path:
    """Re-save a SpecForge-layout drafter as a vllm-project/speculators DSpark checkpoint with a draft vocabulary.

    ``draft_ids``: the target ids the draft vocabulary holds (sorted, distinct); draft id j is
    ``draft_ids[j]``. The drafter's own ``lm_head`` [Vd, H] is the target's LM head at those rows,
    ``markov_w2`` [Vd, r] the drafter's rows, ``d2t`` int64 [Vd] the offsets (target id = draft id +
    d2t[draft id]), ``t2d`` bool [V] marks the ids. ``shift`` != 0 writes a deliberately wrong map:
    draft id j goes to ``draft_ids[(j + shift) % Vd]`` (still one-to-one and inside the vocabulary,
    with a ``t2d`` that agrees, so only what is drafted is wrong).

    The config is speculators': the layers in ``transformer_layer_config``,
    ``aux_hidden_state_layer_ids`` = ``target_layer_ids`` + 1, ``draft_vocab_size``, and
    ``speculators_config.proposal_methods[0].speculative_tokens`` = the drafts of the layout.
    ``sample_from_anchor``: the layout to declare (None: the source's); it is written only when
    true, since speculators reads its absence as false (the 1 + N layout, block - 1 drafts).
    """
    cfg = DSparkConfig.from_json(src)
    anchor = cfg.sample_from_anchor if sample_from_anchor is None else sample_from_anchor
    tensors, vd = _draft_vocab_tensors(src, cfg, target, draft_ids, shift, "to_speculators_layout")
    tensors["embed_tokens.weight"] = _target_tensor(Path(target), "model.embed_tokens.weight")
    config = {"architectures": ["Qwen3DSparkModel"], "speculators_model_type": "dspark",
              "transformer_layer_config": _backbone_dict(cfg), "torch_dtype": cfg.dtype,
              "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids], "block_size": cfg.block_size,
              "draft_vocab_size": vd, **_head_keys(cfg),
              "speculators_config": {"algorithm": "dspark", "proposal_methods": [
                  {"proposal_type": "greedy", "speculative_tokens": cfg.block_size - (0 if anchor else 1)}],
                  "verifier": {"name_or_path": str(target)}}}
    if anchor:
        config["sample_from_anchor"] = True
    return _write_layout(Path(dst), config, tensors)


def bigram_chain(bigram: torch.Tensor, start: int, n: int) -> list[int]:
    out, cur = [], int(start)
    for _ in range(n):
        cur = int(bigram[cur])
        out.append(cur)
    return out


def expected_length(conf: list[float], threshold: float) -> int:
    """The DSpark reference rule: drafts before the first position whose confidence is below threshold."""
    from vllm_dspark.spec_decode.common.verify import threshold_length

    return threshold_length(conf, threshold)


__all__ = ["make_tokenizer", "make_target", "make_drafter", "random_drafter", "drafter_config_for", "random_bigram",
           "bigram_chain", "expected_length", "to_deepspec_layout", "to_speculators_layout", "TOKEN_IDS"]

