"""What vLLM imports in a worker holds only what serving needs: never the training, benchmark,
deployment, test-helper or CLI code (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

TOOLS = ("vllm_dspark.tools",)

# The plugin entry point, the patches it applies, and the classes vLLM builds from them in a worker.
SERVING = ("vllm_dspark.plugin", "vllm_dspark.patch", "vllm_dspark.spec_decode.v1.proposer",
           "vllm_dspark.spec_decode.v1.model", "vllm_dspark.spec_decode.v2.model",
           "vllm_dspark.spec_decode.v1.worker_ext", "vllm_dspark.ops")


def test_the_serving_path_imports_no_tool():
    code = (
        "import importlib, json, sys\n"
        "import vllm_dspark.plugin as p\n"
        "p.register()\n"
        f"for m in {SERVING!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('vllm_dspark'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "vllm_dspark.spec_decode.v1.proposer" in loaded and "vllm_dspark.patch" in loaded
    leaked = [m for m in loaded if m.startswith(TOOLS)]
    assert not leaked, f"the serving path imports tool modules: {leaked}"
