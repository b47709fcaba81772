#!/usr/bin/env python
"""Draw a benchmark record's plots again from its ``results.json`` (no engine, no model).

    .venv/bin/python benchmarks/plot_record.py docs/benchmarks/copy-default-bf16
    .venv/bin/python benchmarks/plot_record.py --all

Records keep their numbers, not their pictures: PNGs are not committed (they
were half of ``docs/benchmarks``, several versions of each). The plots are
written next to the record's ``report.md``, with the same code that drew them
when the benchmark ran. The kind of record is told by its results' shape:

- ``bench_e2e.py``: ``rows`` of configurations and cells (``harness/e2e_report.py``);
- ``bench_step_cost.py``: ``dtypes`` with their ``analysis`` (``harness/step_cost_plots.py``);
- ``load_test.py``: the servers' ``summaries``;
- ``bench_long_context.py``: ``rows`` with a ``kv_probe``.

Records without plots (the op's models, the A/B timings) are skipped, named.
Needs matplotlib (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "benchmarks"
sys.path.insert(0, str(ROOT))


def _script(name: str):
    """One of the benchmark scripts beside this one, as a module (its ``main`` not run)."""
    return importlib.import_module(f"benchmarks.{name}")


def kind_of(results: dict) -> str | None:
    if "kv_probe" in results:
        return "long-context"
    if isinstance(results.get("rows"), list) and results["rows"] and "config" in results["rows"][0]:
        return "e2e"
    if isinstance(results.get("dtypes"), dict):
        return "step-cost"
    if "summaries" in results:
        return "load-test"
    return None


def plot_record(record: Path) -> list[str]:
    """Write the plots of ``record`` (a folder with ``results.json``); returns the files written."""
    path = record / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"{record} has no results.json: not a benchmark record")
    results = json.loads(path.read_text())
    kind = kind_of(results)
    if kind == "e2e":
        from benchmarks.harness.e2e_report import plots, report_rows

        return plots(report_rows(results["rows"]), record)
    if kind == "step-cost":
        from benchmarks.harness.step_cost_plots import plots
        from benchmarks.harness.step_cost_report import int_keys

        return plots(json.loads(path.read_text(), object_hook=int_keys), record)
    if kind == "load-test":
        _script("load_test").plot(results["summaries"], record / "latency.png")
        return ["latency.png"]
    if kind == "long-context":
        return [_script("bench_long_context").plot(results["rows"], record)]
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="*", type=Path, help="record folders (each with results.json)")
    ap.add_argument("--all", action="store_true", help=f"every record under {RECORDS.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    records = sorted(p.parent for p in RECORDS.glob("*/results.json")) if args.all else args.records
    if not records:
        ap.error("name a record folder, or --all")
    for record in records:
        try:
            made = plot_record(record)
        except FileNotFoundError as exc:
            print(f"plot_record: {exc}", file=sys.stderr)
            return 2
        print(f"{record}: {', '.join(made) if made else 'no plots for this kind of record'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
