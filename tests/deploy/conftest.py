"""Markers for the deployment tests (registered here so ``-m ray`` / ``-m "not ray"`` work)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "ray: starts a local Ray cluster and vLLM engines on it (runs in the default suite; "
                   "deselect with -m 'not ray')")
