"""The benchmarks beside the package (not in the wheel): each ``bench_*.py`` here is a command,
``harness/`` the code they share. Run them from a checkout, e.g.
``.venv/bin/python benchmarks/bench_e2e.py --help``; records go to ``docs/benchmarks/``."""
