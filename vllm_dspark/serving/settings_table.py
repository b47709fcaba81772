"""The one table of DSpark's runtime settings: name, sources, parser, default and help.

:func:`~vllm_dspark.serving.settings.resolve_settings` reads every setting
through its row here; the settings module's docstring and the README's table
are generated from these rows (``python -m vllm_dspark.serving.settings_table``
prints the README's; a test checks that the README holds it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class DSparkSettingsError(ValueError):
    """DSpark settings that cannot be served; ``problems`` lists each one, naming the setting and the fix."""

    def __init__(self, message: str, problems: list[str] | None = None):
        self.problems = tuple(problems) if problems else (message,)
        super().__init__(message)


# ------------------------------------------------------------------ parsers: (value, source) -> value
def number(lo: float, hi: float, meaning: str, *, integer: bool = False) -> Callable[[Any, str, str], Any]:
    kind = "an integer" if integer else "a number"
    expected = (f"{kind} in [{lo:g}, {hi:g}]" if math.isfinite(hi) else f"{kind} >= {lo:g}") + \
        (f": {meaning}" if meaning else "")

    def parse(value: Any, name: str, source: str):
        bad = DSparkSettingsError(f"{name} ({source}): got {value!r}, expected {expected}")
        if isinstance(value, bool):
            raise bad
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise bad from None
        if math.isnan(v) or not lo <= v <= hi or (integer and v != int(v)):
            raise bad
        return int(v) if integer else v

    return parse


def choice(*choices: str) -> Callable[[Any, str, str], str]:
    def parse(value: Any, name: str, source: str) -> str:
        v = str(value).strip().lower()
        if v not in choices:
            raise DSparkSettingsError(f"{name} ({source}): got {value!r}, expected one of {list(choices)}")
        return v

    return parse


def tokens_or_off(minimum: int) -> Callable[[Any, str, str], int | None]:
    """A token count, or ``0``/``off`` (None). ``minimum`` may be a setting-time bound (see ``resolve``)."""
    def parse(value: Any, name: str, source: str) -> int | None:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("off", "none", "")):
            return None
        bad = DSparkSettingsError(f"{name} ({source}): got {value!r}, expected a token count or 'off'")
        if isinstance(value, bool):
            raise bad
        try:
            v = int(str(value).strip()) if not isinstance(value, int) else value
        except ValueError:
            raise bad from None
        if v == 0:
            return None
        if v < minimum:
            raise DSparkSettingsError(f"{name} ({source}): got {v}, expected 0/'off' or at least {minimum}")
        return v

    return parse


AUTO_DRAFT_VOCAB = 8192  # draft_vocab: auto, when the drafter ships a frequency table (measured: README)


def size_or_off(value: Any, name: str, source: str) -> int | str | None:
    """``off`` (None), ``auto`` or a number of tokens >= 1 (the upper bound, the target's vocabulary, is
    checked when the checkpoint is known)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("off", "none", "")):
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    bad = DSparkSettingsError(f"{name} ({source}): got {value!r}, expected 'auto', 'off' or a number N of draft "
                              "tokens, 1 <= N < the target's vocabulary size")
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise bad
    try:
        v = int(str(value).strip()) if not isinstance(value, (int, float)) else int(value)
    except ValueError:
        raise bad from None
    if v < 1:
        raise bad
    return v


def text(value: Any, name: str, source: str) -> str | None:
    v = str(value).strip()
    return v or None


def on_off_or_dir(value: Any, name: str, source: str) -> str:
    """``on``/``1`` (the default place), ``off``/``0``, or a directory."""
    v = str(value).strip()
    low = v.lower()
    if low in ("1", "on", "true", ""):
        return "on"
    if low in ("0", "off", "false"):
        return "off"
    return v


def disable_flag(value: Any, name: str, source: str) -> bool:
    """An environment flag that turns a setting off: ``1`` gives False (off), ``0`` True."""
    v = str(value).strip()
    if v not in ("0", "1", ""):
        raise DSparkSettingsError(f"{source}: got {value!r}, expected 0 or 1")
    return v != "1"


def boolean(value: Any, name: str, source: str) -> bool:
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in ("1", "true", "on"):
        return True
    if v in ("0", "false", "off"):
        return False
    raise DSparkSettingsError(f"{name} ({source}): got {value!r}, expected true or false")


def cost_table(value: Any, name: str, source: str) -> dict:
    ok = isinstance(value, dict) and all(
        isinstance(value.get(k), (list, tuple)) and value.get(k)
        and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value[k]) for k in ("verify", "draft"))
    sources = value.get("sources", {}) if isinstance(value, dict) else None
    ok = ok and isinstance(sources, dict) and all(
        isinstance(v, (list, tuple)) and v and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in v)
        for v in sources.values())
    if not ok:
        raise DSparkSettingsError(f"{name} ({source}): expected {{'verify': [[tokens, seconds], ...], "
                                  "'draft': [[requests, seconds], ...]} and optionally 'sources': "
                                  "{'copy': [[requests, seconds], ...]}")
    out: dict[str, Any] = {k: [[float(a), float(b)] for a, b in value[k]] for k in ("verify", "draft")}
    if sources:
        out["sources"] = {str(k): [[float(a), float(b)] for a, b in v] for k, v in sources.items()}
    return out


# ------------------------------------------------------------------ the table
@dataclass(frozen=True)
class Setting:
    name: str  # the speculative config's "dspark" key (also the DSparkSettings field, unless ``field``)
    env: str | None  # environment variable, for operators (None: speculative config only)
    dflash_key: str | None  # the draft checkpoint's dflash_config key, if it may set it
    parse: Callable[[Any, str, str], Any]
    default: Any  # the value when no source sets it (settings with a computed default: see default_text)
    default_text: str  # the default as the docs state it
    help: str
    field: str | None = None  # the DSparkSettings field, when it differs from the name

    @property
    def attr(self) -> str:
        return self.field or self.name


VERIFICATION_MODES = ("budget", "threshold", "product", "fixed")
DRAFT_SAMPLING_MODES = ("auto", "greedy")
COPY_MODES = ("auto", "off")

SETTINGS: tuple[Setting, ...] = (
    Setting("verification", "VLLM_DSPARK_VERIFICATION", "verification", choice(*VERIFICATION_MODES), None,
            "`budget` with a confidence head, else `fixed`",
            "which drafts the target verifies each step: `budget` ranks (request, position) slots by "
            "survival and admits those that pay for their verify cost; `threshold`, the DSpark reference "
            "rule, cuts at the first position whose confidence is below the threshold; `product`, the "
            "project's earlier rule, keeps the longest prefix whose running product stays above it; `fixed` "
            "verifies min(N, num_speculative_tokens)"),
    Setting("threshold", "VLLM_DSPARK_CONFIDENCE_THRESHOLD", "confidence_threshold",
            number(0.0, 1.0, "drafts are cut before the first position whose confidence is below it "
                   "(0 keeps every draft)"), 0.0, "0",
            "the threshold of `threshold` and `product`; a value > 0 with no verification set selects "
            "`threshold`"),
    Setting("window", "VLLM_DSPARK_WINDOW", None, tokens_or_off(2), None,
            "the drafter's trained context when the served context is longer, else off",
            "draft attention window in tokens, or `off`/0 (the checkpoint's `use_swa`/`swa_window_size` "
            "also set it)"),
    Setting("max_draft_context", "VLLM_DSPARK_MAX_DRAFT_CONTEXT", "max_draft_context", tokens_or_off(1), None,
            "off", "past this context length a request decodes without drafts"),
    Setting("draft_sampling", "VLLM_DSPARK_DRAFT_SAMPLING", None, choice(*DRAFT_SAMPLING_MODES), "auto", "`auto`",
            "`auto`: requests with temperature > 0 draft by sampling (honouring top-k/top-p) and hand the "
            "exact draft distribution to the rejection sampler; `greedy`: every draft is an argmax"),
    Setting("trace", "VLLM_DSPARK_TRACE", None, text, None, "off",
            "JSONL file: one record per request and draft step, plus acceptance records", field="trace_path"),
    Setting("stats_interval", "VLLM_DSPARK_STATS_INTERVAL", None,
            number(0.0, math.inf, "seconds between log lines (0 = off)"), 30.0, "30",
            "seconds between verification log lines (0: off)", field="stats_interval_s"),
    Setting("use_markov", "VLLM_DSPARK_DISABLE_MARKOV", None, boolean, True, "on (`VLLM_DSPARK_DISABLE_MARKOV=1`: off)",
            "false drafts without the Markov bias (ablation, diagnostic only)"),
    Setting("costs", None, None, cost_table, None, "profiled at start-up",
            "the budget's cost table, `{\"verify\": [[tokens, s], ...], \"draft\": [[requests, s], ...]}`, "
            "instead of the start-up profile; `\"sources\": {\"copy\": [[requests, s], ...]}` fixes the copy's "
            "own cost of a step (else 0 with a given table; learnt online with a profile)"),
    Setting("profile_cache", "VLLM_DSPARK_PROFILE_CACHE", None, on_off_or_dir, "on", "`<cache>/budget`",
            "where the budget's start-up profiles are cached: `on`, `off` (profile at every start) or a "
            "directory (the tests pin their own)"),
    Setting("prior_strength", "VLLM_DSPARK_PRIOR_STRENGTH", None,
            number(0.0, math.inf, "pseudo-observations of the pessimistic acceptance prior"), 4.0, "4",
            "budget: pseudo-observations of the pessimistic prior on the drafter's acceptance (0: data only)"),
    Setting("prior_acceptance", "VLLM_DSPARK_PRIOR_ACCEPTANCE", None,
            number(0.0, 1.0, "the acceptance the prior assumes at the first position"), 0.1, "0.1",
            "budget: the acceptance that prior assumes at the first position, before any is measured"),
    Setting("probe_tokens", "VLLM_DSPARK_PROBE_TOKENS", None,
            number(0, math.inf, "drafts a probe verifies per probed request (0: no probes)", integer=True), 2,
            "2", "budget: drafts a probe verifies for each of up to 4 requests while drafting is unproven "
            "(0: no probes)"),
    Setting("probe_period", "VLLM_DSPARK_PROBE_PERIOD", None,
            number(1, math.inf, "steps without drafting before a probe", integer=True), 1, "1",
            "budget: steps without drafting before a probe (doubles after a rejected probe, halves after an "
            "accepted one)"),
    Setting("probe_max_period", "VLLM_DSPARK_PROBE_MAX_PERIOD", None,
            number(1, math.inf, "the longest wait between probes, in steps", integer=True), 256, "256",
            "budget: the longest wait between probes, in steps"),
    Setting("reject_run", "VLLM_DSPARK_REJECT_RUN", None,
            number(0, math.inf, "all-rejected drafting steps in a row that stop admitting (0: never)",
                   integer=True), 8, "8",
            "budget: drafting steps in a row with every draft rejected that stop admitting (sooner when the "
            "run was unlikely; 0: never)"),
    Setting("copy", "VLLM_DSPARK_COPY", None, choice(*COPY_MODES), "auto", "`auto`",
            "`auto`: each request may also draft by copying the continuation of the longest earlier match "
            "of its latest tokens in its own prompt and output; the copy's acceptance by match length starts "
            "from the drafter's `copy_prior.json` (measured offline) and is calibrated online, and each "
            "request takes the source that promises more (the budget also skips the drafter's forward when "
            "every request copies; under `fixed` only a copy as long as the cap is taken); `off`: the "
            "drafter alone"),
    Setting("copy_min_match", "VLLM_DSPARK_COPY_MIN_MATCH", None,
            number(1, 64, "tokens the latest suffix must match to copy", integer=True), 2, "2",
            "the copy source's shortest match, in tokens (longer: fewer, surer copies)"),
    Setting("copy_shared", "VLLM_DSPARK_COPY_SHARED", None, tokens_or_off(64), None, "off",
            "the copy source also copies from the outputs of recent requests (suffix decoding's cross-request "
            "index): this many tokens of them, oldest dropped first; a token count or `off`"),
    Setting("draft_vocab", "VLLM_DSPARK_DRAFT_VOCAB", None, size_or_off, "auto", "`auto`",
            "a full-vocabulary drafter drafts over the N most frequent tokens of `draft_vocab_table` only "
            "(its LM head and Markov stage score N rows instead of the target's V; lossless: a token outside "
            f"them is never proposed); N with 1 <= N < V, `off`, or `auto`: {AUTO_DRAFT_VOCAB} when the drafter's "
            "directory has a table (the bundled drafter does) and its LM head is a plain one, else off"),
    Setting("draft_vocab_table", "VLLM_DSPARK_DRAFT_VOCAB_TABLE", None, text, None,
            "`token_frequency.json` in the drafter's directory",
            "the token frequency table `draft_vocab` ranks by (`vllm-dspark vocab-table` builds one)"),
)
BY_NAME = {s.name: s for s in SETTINGS}
TRUST_NAMES = ("prior_strength", "prior_acceptance", "probe_tokens", "probe_period", "probe_max_period",
               "reject_run")


def markdown_table() -> str:
    """The README's table (between its ``settings-table`` markers)."""
    rows = ["| `dspark` key | environment | default | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        env = f"`{s.env}`" if s.env else "speculative config only"
        if s.dflash_key:
            env += f"; checkpoint `dflash_config.{s.dflash_key}`"
        rows.append(f"| `{s.name}` | {env} | {s.default_text} | {s.help} |")
    return "\n".join(rows)


def docstring_table() -> str:
    """The same rows as plain text, for the settings module's docstring."""
    out = []
    for s in SETTINGS:
        src = s.env or "(speculative config only)"
        if s.dflash_key:
            src += f", dflash_config.{s.dflash_key}"
        out.append(f"* ``{s.name}`` [{src}; default {s.default_text.replace('`', '')}]:\n  "
                   + s.help.replace("`", "``"))
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown_table())
