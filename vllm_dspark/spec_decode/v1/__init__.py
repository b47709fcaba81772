"""The DSpark proposer and draft model for vLLM 0.32's V1 runner."""
