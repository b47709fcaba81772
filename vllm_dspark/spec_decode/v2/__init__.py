"""The DSpark hook for vLLM 0.33's V2 GPU runner."""
