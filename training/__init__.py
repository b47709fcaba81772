"""The training pipeline beside the package (not in the wheel): ``pipeline/`` is the code, each
``train_*.py`` here a command (``train_default.py`` the default pair's drafter, ``train_probes.py``
the recipe's probes and the runs that continue it, ``train_tiny.py`` the tests' toy pair).
Run them from a checkout, e.g. ``.venv/bin/python training/train_default.py --help``."""
