"""The plugin's VLLM_DSPARK_* variables are declared to vLLM, so its start-up check does not call them
unknown (one warning per variable and engine before); a misspelt one still is."""

from __future__ import annotations

import logging

from vllm_dspark.plugin import env_var_names, register


def test_own_variables_are_known_and_a_typo_is_not(monkeypatch):
    import vllm.platforms.interface as interface
    from vllm.platforms import current_platform

    register()
    names = env_var_names()
    assert {"VLLM_DSPARK_PROFILE_CACHE", "VLLM_DSPARK_VERIFICATION", "VLLM_DSPARK_PRELOADED"} <= set(names)
    for n in names:
        monkeypatch.setenv(n, "1")
    monkeypatch.setenv("VLLM_DSPARK_VERIFICATON", "budget")  # misspelt
    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Catch()
    logging.getLogger(interface.__name__).addHandler(handler)
    try:
        current_platform.validate_environ(False)
    finally:
        logging.getLogger(interface.__name__).removeHandler(handler)
    flagged = [m for m in seen if "VLLM_DSPARK" in m]
    assert flagged == ["Unknown vLLM environment variable detected: VLLM_DSPARK_VERIFICATON"], flagged
