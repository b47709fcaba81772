"""The DSpark drafter as plain PyTorch modules (no vLLM imports)."""

from vllm_dspark.model.reference import DraftOutput, DSparkDraftModel, count_parameters, expected_tensor_shapes

__all__ = ["DSparkDraftModel", "DraftOutput", "count_parameters", "expected_tensor_shapes"]
