"""Runtime settings of the DSpark proposer: where each comes from and how it is checked.

* Confidence-gated early stop threshold: ``VLLM_DSPARK_CONFIDENCE_THRESHOLD``
  (environment, wins) or ``dflash_config.confidence_threshold`` in the draft's
  ``config.json``; a float in [0, 1]; default 0 (verify the whole draft).
* ``VLLM_DSPARK_TRACE``: a JSONL file; every draft step appends one record per
  request (anchor, drafted tokens, confidences, kept length, which Markov path
  ran). For debugging and the tests; off by default.
* ``VLLM_DSPARK_STATS_INTERVAL``: seconds between the early-stop log lines
  (default 30; 0 turns them off).
* ``VLLM_DSPARK_DISABLE_MARKOV=1``: draft without the Markov bias (each row's
  argmax; the DFlash-style ablation the benchmarks compare against). Still
  lossless; the confidence head keeps its real Markov input.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

THRESHOLD_ENV = "VLLM_DSPARK_CONFIDENCE_THRESHOLD"
TRACE_ENV = "VLLM_DSPARK_TRACE"
STATS_INTERVAL_ENV = "VLLM_DSPARK_STATS_INTERVAL"
DISABLE_MARKOV_ENV = "VLLM_DSPARK_DISABLE_MARKOV"
CONFIG_THRESHOLD_KEY = "confidence_threshold"


class DSparkSettingsError(ValueError):
    pass


def parse_threshold(value, source: str) -> float:
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise DSparkSettingsError(
            f"{source}: got {value!r}, expected a number in [0, 1] (0 disables the early stop)") from None
    if not 0.0 <= t <= 1.0 or t != t:
        raise DSparkSettingsError(
            f"{source}: got {t}, expected a number in [0, 1]: the draft is cut where the running product "
            "of confidences falls below it (0 disables the early stop)")
    return t


def resolve_threshold(dflash_config: dict | None) -> tuple[float, str]:
    """(threshold, where it came from)."""
    env = os.environ.get(THRESHOLD_ENV)
    if env not in (None, ""):
        return parse_threshold(env, THRESHOLD_ENV), THRESHOLD_ENV
    value = (dflash_config or {}).get(CONFIG_THRESHOLD_KEY)
    if value is not None:
        return parse_threshold(value, f"dflash_config.{CONFIG_THRESHOLD_KEY}"), "draft config.json"
    return 0.0, "default"


@dataclass(frozen=True)
class ProposerSettings:
    num_draft_tokens: int  # drafts kept per step (<= block size)
    block_size: int  # queries the drafter runs per step
    threshold: float
    threshold_source: str
    trace_path: str | None
    stats_interval_s: float
    use_markov: bool = True

    @property
    def cuts_drafts(self) -> bool:
        return self.threshold > 0.0 or self.num_draft_tokens < self.block_size


def stats_interval() -> float:
    raw = os.environ.get(STATS_INTERVAL_ENV, "30")
    try:
        v = float(raw)
    except ValueError:
        raise DSparkSettingsError(f"{STATS_INTERVAL_ENV}: got {raw!r}, expected seconds (0 = off)") from None
    return max(0.0, v)


def markov_enabled() -> bool:
    raw = os.environ.get(DISABLE_MARKOV_ENV, "0").strip()
    if raw not in ("0", "1", ""):
        raise DSparkSettingsError(f"{DISABLE_MARKOV_ENV}: got {raw!r}, expected 0 or 1")
    return raw != "1"
