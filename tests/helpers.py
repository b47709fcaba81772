"""Shared test data and helpers: the reference configs, a tiny drafter config, the one tiny-pair factory
(:func:`tiny_pair`) and the one ``vllm serve`` helper (:func:`serving`)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


# ---------------------------------------------------------------- the one tiny-pair factory
@dataclass
class TinyPair:
    """A tiny target (almost a bigram model) and a DSpark drafter for it, on disk."""

    target: str
    draft: str
    bigram: Any  # the target's greedy next token per token ([vocab] int64)
    draft_bigram: Any  # the table the drafter's Markov head encodes (oracle mode)
    config: DSparkConfig
    root: Path

    def as_dict(self) -> dict:
        return {"target": self.target, "draft": self.draft, "bigram": self.bigram, "config": self.config,
                "root": self.root}


def tiny_pair(root: Path, *, vocab: int = VOCAB, seed: int = 3, target: dict | None = None,
              drafter: dict | None = None, mode: str = "oracle", known: float = 1.0, known_seed: int = 11,
              config_changes: dict | None = None, draft_bigram=None, draft_seed: int = 0,
              bigram_target: bool = True, draft_name: str = "draft", **make_drafter_kw) -> TinyPair:
    """Build a tiny target and its drafter under ``root``.

    ``target`` / ``drafter``: keyword arguments of ``make_target`` / ``drafter_config_for``;
    ``config_changes`` then replace fields of the drafter's config.
    ``known``: the share of the bigram table the drafter knows (the rest is replaced by random
    byte tokens, seeded by ``known_seed``): real rejections beside real acceptances. An explicit
    ``draft_bigram`` replaces that table. ``make_drafter_kw`` go to ``make_drafter``
    (``backbone_scale``, ``scale``, ...). ``bigram_target=False``: a target with random weights
    (``bigram`` is then only the drafter's table).
    """
    import torch

    from tests.tiny_pair import drafter_config_for, make_drafter, make_target, random_bigram

    bigram = random_bigram(vocab, seed=seed)
    tdir = make_target(root / "target", vocab_size=vocab, bigram=bigram if bigram_target else None,
                       **(target or {}))
    cfg = drafter_config_for(tdir, **(drafter or {}))
    if config_changes:
        cfg = cfg.replace(**config_changes)
    if draft_bigram is None:
        draft_bigram = bigram.clone()
        if known < 1.0:
            g = torch.Generator().manual_seed(known_seed)
            flip = torch.rand(vocab, generator=g) < (1.0 - known)
            draft_bigram[flip] = torch.randint(0, 256, (int(flip.sum()),), generator=g)
    extra = {"bigram": draft_bigram} if mode == "oracle" else {}
    ddir = make_drafter(root / draft_name, cfg, mode=mode, seed=draft_seed, **extra, **make_drafter_kw)
    return TinyPair(str(tdir), str(ddir), bigram, draft_bigram, cfg, root)


def family_draft(pair: dict, root: Path, layout: str, *, shift: int = 0, backbone_scale: float = 0.0,
                 head: str = "vanilla") -> tuple[Path, Any]:
    """An exact oracle drafter of the session pair's target (the whole bigram table, Markov rank = the
    vocabulary, a ``head`` Markov head passing it through), saved in SpecForge's layout and re-saved in
    ``layout``: ``"specforge"`` (as it is), ``"deepspec"`` (flat keys, target copies of embed_tokens /
    lm_head), ``"specforge-vocab"`` (SpecForge's layout with a draft vocabulary) or ``"speculators"``
    (1 + N layout, a draft vocabulary, ``d2t`` shifted by ``shift`` draft ids when asked). A draft
    vocabulary holds the target ids the table uses plus end-of-sequence. Returns (its directory, the
    draft vocabulary's target ids or None)."""
    import torch

    from tests.tiny_pair import (
        TOKEN_IDS,
        make_drafter,
        to_deepspec_layout,
        to_specforge_draft_vocab,
        to_speculators_layout,
    )

    cfg = pair["config"].replace(markov_rank=pair["config"].vocab_size, markov_head_type=head)
    src = make_drafter(root / "specforge", cfg, mode="oracle", bigram=pair["bigram"], seed=5,
                       backbone_scale=backbone_scale)
    if layout == "specforge":
        return src, None
    if layout == "deepspec":
        return to_deepspec_layout(src, root / layout, target=pair["target"]), None
    ids = torch.unique(torch.cat([pair["bigram"], torch.tensor([TOKEN_IDS["eos"]])]))
    if layout == "specforge-vocab":
        return to_specforge_draft_vocab(src, root / layout, target=pair["target"], draft_ids=ids), ids
    return to_speculators_layout(src, root / layout, target=pair["target"], draft_ids=ids, shift=shift,
                                 sample_from_anchor=False), ids


def greedy_fixed_run(target: str, draft: Path, prompts: list[list[int]], trace: Path | None = None
                     ) -> tuple[list[list[int]], dict]:
    """Greedy answers of ``target`` with ``draft`` verifying every draft (``verification: fixed``, the copy
    off: the drafter's own acceptance), and vLLM's acceptance summary: (tokens per prompt, summary).
    ``trace``: the proposer's trace file."""
    from vllm import SamplingParams

    from benchmarks.harness.engine import acceptance_summary, llm_engine, spec_metrics

    spec = {"method": "dspark", "model": str(draft),
            "dspark": {"verification": "fixed", "copy": "off", **({"trace": str(trace)} if trace else {})}}
    with llm_engine(target, speculative_config=spec) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs], acceptance_summary(spec_metrics(llm))


def traced_family_run(pair: dict, prompts: list[list[int]], root: Path, layout: str, head: str = "vanilla"):
    """:func:`family_draft` served by :func:`greedy_fixed_run` with a trace: (its config, the draft
    vocabulary's target ids or None, tokens per prompt, vLLM's acceptance summary, the trace records)."""
    from benchmarks.harness.engine import read_trace
    from vllm_dspark.config import DSparkConfig

    draft, ids = family_draft(pair, root, layout, head=head)
    tokens, summary = greedy_fixed_run(pair["target"], draft, prompts, trace=root / "trace.jsonl")
    return DSparkConfig.from_json(draft), ids, tokens, summary, read_trace(root / "trace.jsonl")


# ---------------------------------------------------------------- the one `vllm serve` helper
@dataclass
class Server:
    base: str  # http://127.0.0.1:PORT
    port: int
    proc: subprocess.Popen
    log: Path


def serve_command(target: str, draft: str, port: int, *, num_speculative_tokens: int = 6,
                  max_model_len: int = 512, extra: tuple[str, ...] = ()) -> list[str]:
    """``vllm serve`` of a tiny pair on loopback, in float32, eager."""
    vllm = str(Path(sys.executable).with_name("vllm"))
    spec = json.dumps({"method": "dspark", "model": str(draft), "num_speculative_tokens": num_speculative_tokens})
    return [vllm, "serve", str(target), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", str(max_model_len), "--enforce-eager", "--speculative-config", spec, *extra]


@contextlib.contextmanager
def serving(cmd: list[str], log_path: Path, env: dict[str, str], timeout: float = 300) -> Iterator[Server]:
    """Start ``cmd`` (a ``vllm serve`` on 127.0.0.1 ``--port``); yield it once /health answers, then stop it."""
    import urllib.request

    port = int(cmd[cmd.index("--port") + 1])
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1", "tests serve on loopback only"
    log = open(log_path, "w")  # noqa: SIM115 (the server outlives this function)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {proc.returncode}:\n" + log_path.read_text()[-4000:])
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm serve did not become healthy in {timeout:.0f} s:\n"
                                     + log_path.read_text()[-4000:])
            time.sleep(1)
        yield Server(base, port, proc, log_path)
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()
