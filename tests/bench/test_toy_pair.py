"""The benchmark's toy pair is found in a clone (its path broke once when the tools moved)."""

from pathlib import Path

from benchmarks.harness.e2e import toy_pair


def test_toy_pair_is_the_repository_fixture():
    pair = toy_pair(3)
    root = Path(__file__).resolve().parents[1] / "fixtures" / "toy_pair"
    assert Path(pair.target) == root / "target" and Path(pair.draft) == root / "drafter"
    assert (Path(pair.draft) / "config.json").is_file() and len(pair.datasets["code"]) == 3
