"""DSpark checkpoint I/O: SpecForge's single-file BF16 export layout."""

from vllm_dspark.checkpoint.io import (
                                       CheckpointError,
                                       CheckpointReport,
                                       canonical_name,
                                       iter_tensors,
                                       load_checkpoint,
                                       load_reference_model,
                                       save_checkpoint,
                                       validate_checkpoint,
)

__all__ = ["CheckpointError", "CheckpointReport", "canonical_name", "iter_tensors", "load_checkpoint",
           "load_reference_model", "save_checkpoint", "validate_checkpoint"]
