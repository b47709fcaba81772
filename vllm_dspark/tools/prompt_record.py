"""The record of the prompts a drafter was trained on: hashes of their normalised texts plus a
MinHash sketch each, in an ``.npz`` shipped beside the drafter (``assets/smollm2/train_prompts.npz``).

Reading it is part of the package: ``vllm-dspark vocab-table``'s default table is rebuilt from
exactly the recorded turns. Building the prompt set and writing the record are the training
pipeline's (``training/pipeline/prompt_set.py``).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

_TOKEN = re.compile(r"[a-z0-9_]+")


def normalize(text: str) -> str:
    return " ".join(_TOKEN.findall(text.lower()))


def prompt_hash(text: str) -> int:
    """The first 8 bytes of the sha256 of the normalised text, as an unsigned integer."""
    return int.from_bytes(hashlib.sha256(normalize(text).encode()).digest()[:8], "little")


def read_record(path: str | Path) -> dict:
    z = np.load(path)
    names = [str(k) for k in z["kind_names"]]
    return {"hashes": z["hashes"], "kinds": [names[k] for k in z["kinds"]], "minhash": z["minhash"],
            "stats": json.loads(str(z["stats"]))}
