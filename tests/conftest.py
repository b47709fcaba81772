"""Shared pytest configuration.

Created by the Markov-op work only to register the ``requires_cuda`` marker it
uses; the project's lead owns this file and may extend it.
"""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_cuda: needs a CUDA GPU and a CUDA build of the op (skipped otherwise)")
