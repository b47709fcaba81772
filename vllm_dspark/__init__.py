"""vllm_dspark: DSpark speculative decoding for vLLM.

Importing this package is cheap and never imports vLLM or CUDA: vLLM loads the
plugin through the ``vllm.general_plugins`` entry point
(``vllm_dspark.plugin:register``) in every process it starts.
"""

__version__ = "0.1.0"
