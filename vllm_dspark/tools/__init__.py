"""What users run beside serving: the CLI, the default pair, training, deployment and benchmarks.

Nothing vLLM imports in its processes (the plugin, its patches, the worker-side
classes) imports from here (``tests/test_serving_imports.py``); the tools may
import everything else.
"""
