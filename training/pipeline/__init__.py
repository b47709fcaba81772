"""Training DSpark drafters: one pipeline, two users.

``training/train_default.py`` trains the default pair's drafter (SmolLM2-135M-Instruct's own
answers to ShareGPT and code prompts, ``docs/training.md``); ``training/train_tiny.py`` rebuilds
the toy pair the tests use (a tiny Qwen3 target trained on the standard library). Both go
through the same capture and trainer. The pieces:

- :mod:`.sharegpt`, :mod:`.prompt_set` the training prompts, deduplicated and disjoint from
  every evaluation prompt; :mod:`.chat_prompts` the evaluation prompts;
- :mod:`.generate` the target's answers, through vLLM, resumable per conversation;
- :mod:`.features` the target's aux hidden states and top-K next-token distribution, captured once;
- :mod:`.trainer` the one drafter trainer (dense anchors, candidate-set loss, resumable);
- :mod:`.drafter` the drafter's shape and starting weights for a target;
- :mod:`.export` the SpecForge-layout export;
- :mod:`.corpus`, :mod:`.tokenizer`, :mod:`.target`, :mod:`.capture` the toy pair's corpus,
  tokenizer, target and greedy continuations; :mod:`.evaluate` offline acceptance.
"""

from pathlib import Path

# The DFlash-style ablation of the default drafter (same backbone, data and steps, no Markov head):
# a research artifact kept in the checkout, not in the wheel. The benchmarks compare against it.
ABLATION_DIR = Path(__file__).resolve().parents[1] / "assets" / "smollm2" / "dflash"
