"""Byte-level BPE tokenizer for the tiny target, saved as a Hugging Face tokenizer.

Three special tokens come first in the vocabulary: ``<|endoftext|>`` (bos, eos),
``<|pad|>`` and ``<|mask|>``. The last is the DSpark ``mask_token_id``: it never
occurs in text (special tokens are not produced by the pre-tokenizer), so the
drafter's mask queries can never be confused with a real token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path,
                    *, model_max_length: int = 2048):
    """Train byte-level BPE on ``texts`` and save it under ``out_dir``.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` and
    ``special_tokens_map.json``. Returns the ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[MASK_TOKEN],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    # Keep the config minimal and explicit: no bos prepended, so a prompt's
    # token ids are exactly its text's ids in vLLM and in plain transformers.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update({"add_bos_token": False, "add_eos_token": False,
                "tokenizer_class": "PreTrainedTokenizerFast"})
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return fast


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def special_ids(tokenizer) -> dict[str, int]:
    """``{'eos': .., 'pad': .., 'mask': ..}`` token ids of a tokenizer trained here."""
    ids = {name: tokenizer.convert_tokens_to_ids(tok)
           for name, tok in (("eos", EOS_TOKEN), ("pad", PAD_TOKEN), ("mask", MASK_TOKEN))}
    return ids
