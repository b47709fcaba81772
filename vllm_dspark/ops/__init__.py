"""Custom ops of vllm_dspark and their PyTorch references.

``markov_draft`` (``markov.py``) is DSpark's sequential Markov stage as one
compiled op (``csrc/``); ``markov_reference.py`` is its golden semantics.
"""

from vllm_dspark.ops.markov import (
    MarkovDraftOutput,
    gumbel_noise,
    is_compiled_available,
    markov_draft,
    markov_draft_reference,
    markov_max_norms,
    markov_row_norms,
)

__all__ = [
    "MarkovDraftOutput",
    "gumbel_noise",
    "is_compiled_available",
    "markov_draft",
    "markov_draft_reference",
    "markov_max_norms",
    "markov_row_norms",
]
