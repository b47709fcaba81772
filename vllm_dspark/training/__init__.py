"""Training of the bundled default pair: a tiny Qwen3 target and its DSpark drafter.

Everything here runs on a CPU in about an hour and is deterministic for a
given seed. The pieces, in pipeline order:

- :mod:`.corpus` the Python standard library's source, split by file;
- :mod:`.tokenizer` a byte-level BPE tokenizer with a reserved mask token;
- :mod:`.target` the target language model (``Qwen3ForCausalLM``);
- :mod:`.capture` the target's aux hidden states and greedy labels;
- :mod:`.drafter` the DSpark drafter's training loss and loop;
- :mod:`.export` the SpecForge-layout export of the drafter.

``scripts/train_tiny.py`` runs the whole pipeline.
"""
