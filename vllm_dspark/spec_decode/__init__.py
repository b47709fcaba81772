"""Speculative decoding with a DSpark drafter, split by what runs where.

* ``common/``: runner-independent logic, used by both runners: the draft budget
  (``budget``, with its cost model ``costs`` and acceptance ``calibration``) and
  its start-up profile, the verification rules, draft sampling, the Markov
  stage's inputs, the tensor-parallel consensus and the draft config keys.
* ``v1/``: vLLM 0.32's V1 runner (the CPU backend and other V1 platforms): the
  proposer, its draft model, the held context K/V, the upstream couplings it
  checks and the worker extension.
* ``v2/``: vLLM 0.33's V2 GPU runner: the hook that runs the Markov op in
  upstream's own DSpark speculator.

``v1`` and ``v2`` never import each other (``tests/test_layers.py``).
"""
