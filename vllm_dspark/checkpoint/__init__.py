"""DSpark checkpoints of every family: the tensors each drafter holds (``shapes``), a draft vocabulary's id maps
(``vocab_map``), and reading, validating and writing them (``io``)."""

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
