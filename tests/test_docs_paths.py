"""The file and folder names the layout docs cite exist (a move that forgets the docs fails here)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/architecture.md", "docs/training.md", "docs/deployment.md", "docs/vllm-0.33.md")
# ``vllm/...`` names upstream's files, not ours.
# Where a cited name may be relative to: the repo, the package, the tools.
# Made when the commands run (the environment, the GPU check's first report), not shipped.
MADE_BY_RUNNING = {".venv/", "docs/benchmarks/gpu-check/"}
BASES = (REPO, REPO / "vllm_dspark", REPO / "vllm_dspark" / "tools", REPO / "vllm_dspark" / "spec_decode")


def cited_paths(text: str) -> set[str]:
    names = set()
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.split("::")[0].rstrip(",.;:")
        if ("/" in token and re.fullmatch(r"[\w./-]+(\.py|\.cu|\.cpp|\.h|/)", token)
                and not token.startswith(("http", "~", "/", "vllm/")) and token not in MADE_BY_RUNNING):
            names.add(token)
    return names


def test_every_cited_module_and_folder_exists():
    missing = []
    for doc in DOCS:
        for name in sorted(cited_paths((REPO / doc).read_text())):
            if not any((base / name).exists() for base in BASES):
                missing.append(f"{doc}: `{name}`")
    assert not missing, "cited but not in the tree:\n" + "\n".join(missing)


def test_the_check_sees_a_path_that_is_gone():
    assert cited_paths("see `spec_decode/model_v1.py`, `tools/` and `model.py`") == {
        "spec_decode/model_v1.py", "tools/"}
    assert not (REPO / "vllm_dspark" / "spec_decode" / "model_v1.py").exists()
