"""Build the token frequency table a serve-time draft vocabulary ranks by (``vllm-dspark vocab-table``).

The input is JSONL, one record a line: ``{"text": "..."}`` (tokenized with the
target's tokenizer, no special tokens added) or ``{"token_ids": [...]}``. The
table (format: :mod:`vllm_dspark.checkpoint.token_frequency`) counts every
token and ranks the ids seen, most frequent first; it is written atomically.
Build it from the drafter's TRAINING text, never from the prompts you evaluate
on: a table fitted to the evaluation set flatters the measured speed-up.

:func:`default_pair_training_turns` writes the default pair's training turns
(the human turns ``training/train_default.py`` trained on, as
``vllm_dspark/assets/smollm2/train_prompts.npz`` records them) as such a JSONL;
``python -m vllm_dspark.tools.draft_vocab`` rebuilds the shipped
``assets/smollm2/dspark/token_frequency.json`` from it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from vllm_dspark.checkpoint.token_frequency import (
    FILE_NAME,
    MAX_IDS,
    FrequencyTable,
    table_from_counts,
    write_frequency_table,
)

PROGRESS_S = 5.0  # seconds between progress lines
ASSETS = Path(__file__).resolve().parents[1] / "assets" / "smollm2"
TRAIN_RECORD = ASSETS / "train_prompts.npz"
DEFAULT_TABLE = ASSETS / "dspark" / FILE_NAME


class InputError(ValueError):
    """A JSONL line that cannot be counted; the message names the file and the line number."""


def target_vocab_size(target_dir: str | Path) -> int | None:
    """The target's ``vocab_size`` from its config.json (its text config's), or None without one."""
    from vllm_dspark.serving.compat import load_target_config, text_config

    try:
        v = text_config(load_target_config(target_dir)).get("vocab_size")
    except Exception:  # no config.json: the tokenizer's size is used
        return None
    return int(v) if isinstance(v, int) else None


def count_tokens(path: str | Path, *, vocab_size: int, encode: Callable[[str], list[int]] | None,
                 log: Callable[[str], None] | None = None) -> tuple[np.ndarray, int]:
    """Per-id counts [vocab_size] int64 over every line of the JSONL ``path``, and the lines read.

    ``encode`` turns a ``text`` line into ids (None: only ``token_ids`` lines are accepted).
    Raises :class:`InputError` at the first bad line, naming its number.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    lines = tokens = 0
    last = time.monotonic()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: not JSON ({exc.msg})") from None
            if isinstance(rec, dict) and isinstance(rec.get("token_ids"), list):
                ids = rec["token_ids"]
                if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    raise InputError(f"{where}: token_ids must be a list of integers")
            elif isinstance(rec, dict) and isinstance(rec.get("text"), str):
                if encode is None:
                    raise InputError(f"{where}: a text line needs a tokenizer")
                ids = encode(rec["text"])
            else:
                raise InputError(f'{where}: expected {{"text": "..."}} or {{"token_ids": [...]}}')
            arr = np.asarray(ids, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
                bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
                raise InputError(f"{where}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
            np.add.at(counts, arr, 1)
            lines += 1
            tokens += int(arr.size)
            if log is not None and time.monotonic() - last >= PROGRESS_S:
                last = time.monotonic()
                log(f"vocab-table: {lines:,} lines, {tokens:,} tokens")
    return counts, lines


def build_table(input_path: str | Path, tokenizer_dir: str | Path, *, source: str, top: int = MAX_IDS,
                log: Callable[[str], None] | None = None) -> FrequencyTable:
    """The frequency table of a JSONL, over the vocabulary of the target at ``tokenizer_dir``."""
    tok = None

    def load_tokenizer():
        nonlocal tok
        if tok is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        return tok

    vocab = target_vocab_size(tokenizer_dir)
    if vocab is None:
        vocab = len(load_tokenizer())

    def encode(text: str) -> list[int]:
        return list(load_tokenizer()(text, add_special_tokens=False)["input_ids"])

    counts, lines = count_tokens(input_path, vocab_size=vocab, encode=encode, log=log)
    if log is not None:
        log(f"vocab-table: {lines:,} lines, {int(counts.sum()):,} tokens, {int((counts > 0).sum()):,} distinct "
            f"of {vocab:,}")
    return table_from_counts(counts.tolist(), vocab_size=vocab, source=source, top=top)


def default_pair_training_turns(out: str | Path, *, prompts_json: str | Path | None = None,
                                record: str | Path = TRAIN_RECORD) -> int:
    """Write the default drafter's training turns as ``{"text": ...}`` lines; returns how many.

    The texts come from the training run's ``prompts.json`` (``training/train_default.py``'s prompt
    stage, in the cache); a turn is kept only when its hash is in ``train_prompts.npz``, the record of
    the turns actually trained on, and every recorded hash must be found (else the cache's prompts are
    not the ones trained on, and nothing is written).
    """
    from vllm_dspark.cache import cache_dir
    from vllm_dspark.tools.prompt_record import prompt_hash, read_record

    src = Path(prompts_json) if prompts_json else cache_dir() / "train" / "smollm2" / "prompts.json"
    want = {int(h) for h in read_record(record)["hashes"]}
    convs = json.loads(Path(src).read_text())["train"]
    texts: dict[int, str] = {}
    for conv in convs:
        for turn in conv["turns"]:
            h = prompt_hash(turn)
            if h in want and h not in texts:
                texts[h] = turn
    if len(texts) != len(want):
        raise RuntimeError(f"{src} holds {len(texts)} of the {len(want)} training turns {record} records; "
                           "regenerate it with training/train_default.py's prompt stage")
    p = Path(out)
    p.write_text("".join(json.dumps({"text": texts[h]}) + "\n" for h in sorted(texts)))
    return len(texts)


DEFAULT_SOURCE = ("the default drafter's training prompts: the {turns:,} distinct human turns recorded in "
                  "vllm_dspark/assets/smollm2/train_prompts.npz (texts from training/train_default.py's "
                  "prompts.json), no evaluation prompts; built by `python -m vllm_dspark.tools.draft_vocab`, i.e. "
                  "vllm-dspark vocab-table --tokenizer <default target> --input train_turns.jsonl --out "
                  "vllm_dspark/assets/smollm2/dspark/token_frequency.json")


def build_default_table(out: str | Path = DEFAULT_TABLE, *, log: Callable[[str], None] = print) -> FrequencyTable:
    """Rebuild the default pair's table from its training turns (the target must be prepared)."""
    import tempfile

    from vllm_dspark.tools.default_pair import default_paths

    target = default_paths(require=True)["target"]
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "train_turns.jsonl"
        n = default_pair_training_turns(jsonl)
        log(f"vocab-table: {n:,} training turns")
        table = build_table(jsonl, target, source=DEFAULT_SOURCE.format(turns=n), log=log)
    write_frequency_table(out, table)
    log(f"vocab-table: wrote {out}")
    return table


if __name__ == "__main__":
    build_default_table(log=lambda m: print(m, file=sys.stderr))
