"""Shared test data: the reference configs (inside the repository) and a tiny drafter config."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_dspark.config import DSparkConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures"
K3_CONFIG = FIXTURES / "kimi-k3-dspark.config.json"
QWEN3_CONFIG = FIXTURES / "qwen3-8b-dspark.config.json"
K3_PARAMS = 2_249_289_601


def k3_dict() -> dict:
    return json.loads(K3_CONFIG.read_text())


def tiny_config(**changes) -> DSparkConfig:
    """A drafter small enough to run in milliseconds; every feature switched on."""
    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=96, vocab_size=80, max_position_embeddings=512, rope_theta=10000.0,
              dtype="bfloat16", block_size=5, target_layer_ids=(0, 2), num_target_layers=4,
              mask_token_id=79, markov_rank=8, enable_confidence_head=True, confidence_head_with_markov=True)
    kw.update(changes)
    return DSparkConfig(**kw)


# The engine tests' tiny Qwen3 pair and prompts (fixtures in tests/conftest.py).
VOCAB = 384
NUM_PROMPTS = 16
MAX_TOKENS = 32


def make_prompts(n: int = NUM_PROMPTS, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = [3 + (7 * i) % 41 for i in range(n)]  # 3..43 tokens, all different
    return [torch.randint(0, 256, (L,), generator=g).tolist() for L in lengths]


def free_port() -> int:
    """A free TCP port on the loopback interface (tests never bind anything else)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the README's commands, as written
REPO = Path(__file__).resolve().parents[1]


def readme_commands(readme: Path = REPO / "README.md") -> list[list[str]]:
    """Every shell command of the README's ```bash blocks, split as bash would (quotes may span lines)."""
    import re
    import shlex

    commands: list[list[str]] = []
    for block in re.findall(r"```bash\n(.*?)```", readme.read_text(), flags=re.S):
        pending = ""
        for line in block.splitlines():
            pending = f"{pending}\n{line}" if pending else line
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            try:
                argv = shlex.split(pending, comments=True)
            except ValueError:  # an open quote: the command goes on on the next line
                continue
            if argv:
                commands.append(argv)
            pending = ""
    return commands


def readme_command(*prefix: str, placeholders: dict[str, str]) -> list[str]:
    """The README command whose argv starts with ``prefix``, with its placeholders filled in.

    A placeholder is replaced wherever it occurs in an argument (also inside the speculative
    config's JSON). Fails if the README has no such command or a placeholder is gone, so a test
    built on it breaks when the README changes.
    """
    found = [c for c in readme_commands() if c[:len(prefix)] == list(prefix)]
    assert len(found) == 1, f"README.md: expected one command starting with {' '.join(prefix)!r}, found {found}"
    cmd = found[0]
    for name in placeholders:
        assert any(name in arg for arg in cmd), f"README.md: {name} is no longer in {cmd}"
    out = []
    for arg in cmd:
        for name, value in placeholders.items():
            arg = arg.replace(name, value)
        out.append(arg)
    return out


def default_pair_dirs() -> dict[str, str]:
    """``vllm-dspark default --json``: the default pair's target and draft directories, as the README says.

    Skips the calling test when the target is not converted yet (``scripts/setup_env.sh`` does that).
    """
    import subprocess
    import sys

    import pytest

    from vllm_dspark.tools.default_pair import check_target

    cli = Path(sys.executable).with_name("vllm-dspark")
    out = subprocess.run([str(cli), "default", "--json"], capture_output=True, text=True, timeout=120, check=True)
    paths = json.loads(out.stdout)
    problems = check_target(Path(paths["target"]), hash_weights=False)
    if problems:
        pytest.skip(f"the default target is not prepared ({problems[0]}); run scripts/setup_env.sh")
    return paths
