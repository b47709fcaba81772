"""The file and folder names the layout docs cite exist (a move that forgets the docs fails here)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Every page: the README, docs/ and the benchmarks index (a new page is checked without being listed
# here). A record's own report.md is history, written when it ran: not checked.
DOCS = ("README.md", *sorted(str(p.relative_to(REPO)) for d in ("docs", "docs/benchmarks")
                            for p in (REPO / d).glob("*.md")))
# ``vllm/...`` names upstream's files, not ours.
# Where a cited name may be relative to: the repo, the package, the tools.
# Made when the commands run (the environment, the GPU check's first report), not shipped.
MADE_BY_RUNNING = {".venv/", "docs/benchmarks/gpu-check/"}
BASES = (REPO, REPO / "vllm_dspark", REPO / "vllm_dspark" / "tools", REPO / "vllm_dspark" / "spec_decode")


def cited_paths(text: str) -> set[str]:
    names = set()
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.split("::")[0].rstrip(",.;:")
        if token in MADE_BY_RUNNING:
            continue
        if token.startswith("docs/benchmarks/") or (  # a record is cited without a trailing slash
                "/" in token and re.fullmatch(r"[\w./-]+(\.py|\.cu|\.cpp|\.h|\.md|\.sh|/)", token)
                and not token.startswith(("http", "~", "/", "vllm/"))):
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


def test_the_benchmarks_index_lists_every_record_with_its_command():
    """docs/benchmarks/README.md: one row per record folder, each naming the script that made it."""
    index = (REPO / "docs" / "benchmarks" / "README.md").read_text()
    rows = [ln for ln in index.splitlines() if ln.startswith("| ") and "`docs/benchmarks/" in ln]
    listed = {}
    for row in rows:
        record = re.search(r"`docs/benchmarks/([\w.-]+)/?`", row)
        script = re.search(r"`((?:scripts|benchmarks)/[\w.-]+\.py)", row)
        assert record and script, f"an index row without its record or command: {row}"
        assert (REPO / script.group(1)).exists(), script.group(1)
        listed[record.group(1)] = row
    folders = {p.name for p in (REPO / "docs" / "benchmarks").iterdir() if p.is_dir()} - {"gpu-check"}
    assert folders == set(listed), (f"records not in the index: {sorted(folders - set(listed))}; "
                                    f"indexed but gone: {sorted(set(listed) - folders)}")
