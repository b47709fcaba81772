"""What users run beside serving: the CLI, the default pair, deployment and the CPU set-up.

The benchmarks (``benchmarks/``) and the training pipeline (``training/``) live beside the
package in a checkout, outside the wheel.

Nothing vLLM imports in its processes (the plugin, its patches, the worker-side
classes) imports from here (``tests/test_serving_imports.py``); the tools may
import everything else.
"""
