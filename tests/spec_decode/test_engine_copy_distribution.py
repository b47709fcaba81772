"""Sampled (T = 1) requests drafted by the copy source keep the target's distribution.

A copied draft is a deterministic proposal: its q is one-hot, and the rejection sampler accepts
it with probability p(token) and otherwise resamples from the residual. If that went wrong (a
copy accepted as if greedy, a q left over from the drafter), the copied tokens would show up far
more often than the target gives them.

The target is the tiny bigram model with its LM head scaled down, so that at T = 1 its chain
token has probability 0.3-0.8 instead of one. The prompt is its chain, then the chain's
first three tokens again: once the target samples the chain's next token, the copy source
proposes the rest of the chain. 600 seeded requests, 3 tokens each:
the first token is the target's own sample (no draft), the second and third are verified drafts
(copies and the drafter's, both through the rejection sampler). Their empirical frequencies are
compared with the target's exact conditionals, computed by transformers, within 4.5 standard
errors per token (a wrong acceptance rule moves the chain token by ten or more).
"""

from __future__ import annotations

import math
import shutil
from collections import Counter

import pytest
import torch

from benchmarks.harness.engine import dspark_report, llm_engine
from tests.helpers import VOCAB

pytestmark = pytest.mark.engine

N = 600
FLAT = {"verify": [[1, 0.01], [512, 0.01]], "draft": [[1, 0.001], [64, 0.001]]}  # every draft slot pays
HEAD_SCALE = 0.15


def _chain(bigram: torch.Tensor, start: int, n: int) -> list[int]:
    out = [start]
    while len(out) < n:
        out.append(int(bigram[out[-1]]))
    return out


@pytest.fixture(scope="module")
def soft_target(qwen_pair, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("soft_target")
    target = root / "target"
    shutil.copytree(qwen_pair["target"], target)
    path = target / "model.safetensors"
    state = load_file(str(path))
    state["lm_head.weight"] = state["lm_head.weight"] * HEAD_SCALE
    save_file(state, str(path), metadata={"format": "pt"})
    return str(target)


@pytest.fixture(scope="module")
def sampled(soft_target, qwen_pair):
    from vllm import SamplingParams

    chain = _chain(qwen_pair["bigram"], 17, 24)
    prompt = chain + chain[:3]  # the chain restarted: after its next token the copy proposes the chain
    spec = {"method": "dspark", "model": qwen_pair["draft"], "num_speculative_tokens": 7,
            "dspark": {"verification": "budget", "costs": FLAT, "copy": "auto"}}
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=1000 + i, ignore_eos=True) for i in range(N)]
    with llm_engine(soft_target, speculative_config=spec, max_num_seqs=64) as llm:
        # A first pass teaches the calibrators; the measured pass follows.
        llm.generate([{"prompt_token_ids": prompt}] * 64,
                     [SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True) for i in range(64)])
        before = dspark_report(llm)["stats"]["by_source"]
        outs = llm.generate([{"prompt_token_ids": prompt}] * N, params)
        after = dspark_report(llm)["stats"]["by_source"]
    return prompt, [list(o.outputs[0].token_ids) for o in outs], before, after


def _exact(target: str, prefix: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prefix])).logits[0, -1, :VOCAB].softmax(-1).double()


def _check(samples: list[int], p: torch.Tensor, what: str) -> None:
    n = len(samples)
    assert n >= 60, (what, n)
    freq = Counter(samples)
    for tok in set(freq) | set(torch.nonzero(p > 0.02).flatten().tolist()):
        q = float(p[tok])
        tol = 4.5 * math.sqrt(max(q * (1 - q), 1.0 / n) / n) + 1.0 / n
        assert abs(freq.get(tok, 0) / n - q) <= tol, (what, tok, freq.get(tok, 0), n, q, freq.most_common(5))


def test_copied_drafts_keep_the_targets_distribution(sampled, soft_target, qwen_pair):
    prompt, outs, before, after = sampled
    assert all(len(o) == 3 for o in outs)
    # The copies drafted for these requests (and were accepted on some, rejected on others).
    copy_verified = after["copy"]["verified"] - before.get("copy", {}).get("verified", 0)
    copy_accepted = after["copy"]["accepted"] - before.get("copy", {}).get("accepted", 0)
    assert copy_verified >= N // 2 and 0 < copy_accepted < copy_verified, (before, after)
    nxt = int(qwen_pair["bigram"][prompt[-1]])
    p1 = _exact(soft_target, prompt)
    assert 0.2 < float(p1[nxt]) < 0.9, float(p1[nxt])  # the scaled head: spread, not certain
    _check([o[0] for o in outs], p1, "token 1 (the target's own sample)")
    on_chain = [o for o in outs if o[0] == nxt]
    _check([o[1] for o in on_chain], _exact(soft_target, prompt + [nxt]), "token 2 after the chain token")
    nxt2 = int(qwen_pair["bigram"][nxt])
    deep = [o for o in on_chain if o[1] == nxt2]
    _check([o[2] for o in deep], _exact(soft_target, prompt + [nxt, nxt2]), "token 3 after two chain tokens")
