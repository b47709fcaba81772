"""How a DSpark draft is served: every runtime setting, resolved once into one frozen object.

Sources, highest precedence first:

1. the speculative config's ``"dspark"`` block, e.g.
   ``--speculative-config '{"method": "dspark", "model": DIR, "dspark": {"window": 4096}}'``;
2. environment variables (``VLLM_DSPARK_*``), for operators;
3. the draft checkpoint's ``dflash_config`` (``confidence_threshold``,
   ``verification``, ``use_swa`` / ``swa_window_size``, ``max_draft_context``);
4. defaults.

The settings, one row each in :mod:`.settings_table` (this list and the
README's table are generated from it):

{table}

:func:`resolve_settings` builds a :class:`DSparkSettings` (every problem is
reported at once, naming the setting, its source, the value and the fix);
the config patch attaches it to the draft's Hugging Face config as one
attribute (``dspark_settings``, a plain dict so vLLM can pickle and hash the
config) and :func:`settings_of` turns it back into the frozen object, refusing
a missing or malformed one. No vLLM imports here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dspark.checkpoint.token_frequency import FILE_NAME
from vllm_dspark.config import DSparkConfig
from vllm_dspark.serving.settings_table import (
    AUTO_DRAFT_VOCAB,
    BY_NAME,
    SETTINGS,
    TRUST_NAMES,
    DSparkSettingsError,
    disable_flag,
    docstring_table,
    tokens_or_off,
)

ATTR = "dspark_settings"
SPEC_KEY = "dspark"
SPEC_KEYS = tuple(row.name for row in SETTINGS)
__doc__ = (__doc__ or "").replace("{table}", docstring_table())


def _auto_draft_vocab(cfg: DSparkConfig, table: str) -> int | None:
    """``draft_vocab: auto``: :data:`AUTO_DRAFT_VOCAB` for a full-vocabulary drafter larger than it whose
    frequency table is at hand; else None (the whole vocabulary)."""
    if cfg.draft_vocab_size is not None or cfg.vocab_size <= AUTO_DRAFT_VOCAB or not Path(table).is_file():
        return None
    return AUTO_DRAFT_VOCAB


def _default(name: str):
    return BY_NAME[name].default


@dataclass(frozen=True, kw_only=True)
class DSparkSettings:
    """Everything the DSpark proposer and model need at run time (see the module docstring)."""

    draft: str
    block_size: int  # queries the drafter runs per step
    num_draft_tokens: int  # drafts one block proposes (anchor-first: block_size)
    max_draft_tokens: int  # num_speculative_tokens: at most this many are verified per request
    query_layout: str
    has_confidence_head: bool
    verification: str
    threshold: float
    window: int | None
    max_draft_context: int | None
    draft_sampling: str
    use_markov: bool
    trained_context: int  # the drafter's max_position_embeddings
    served_context: int  # the target's max_model_len
    trace_path: str | None = None
    stats_interval_s: float = _default("stats_interval")
    costs: dict | None = None  # explicit budget cost table (skips the start-up profile)
    profile_cache: str = _default("profile_cache")  # "on", "off" or a directory
    # The budget's trust settings (meanings in the table).
    prior_strength: float = _default("prior_strength")
    prior_acceptance: float = _default("prior_acceptance")
    probe_tokens: int = _default("probe_tokens")
    probe_period: int = _default("probe_period")
    probe_max_period: int = _default("probe_max_period")
    reject_run: int = _default("reject_run")
    # A serve-time draft vocabulary: its size (None: the target's whole vocabulary) and its table.
    draft_vocab: int | None = None
    draft_vocab_table: str | None = None
    draft_vocab_auto: bool = False  # chosen by ``auto``: a head the slice cannot serve turns it off, not an error
    copy: str = _default("copy")  # "auto": the copy source drafts beside the drafter (every verification mode)
    copy_min_match: int = _default("copy_min_match")
    copy_shared: int | None = None  # tokens of recent requests' outputs the copy source indexes (None: off)
    sources: tuple[tuple[str, str], ...] = field(default=())

    # -------------------------------------------------------------- derived
    @property
    def cuts_drafts(self) -> bool:
        """Whether requests may verify fewer than the block's drafts (needs synchronous scheduling)."""
        return (self.verification != "fixed" or self.max_draft_tokens < self.num_draft_tokens
                or self.max_draft_context is not None)

    @property
    def copies(self) -> bool:
        """Whether the copy source drafts (``copy: auto``): the budget, or the verification rule, picks each
        request's source."""
        return self.copy == "auto"

    def trust(self) -> dict[str, float | int]:
        """The budget's :class:`~vllm_dspark.spec_decode.common.budget.TrustConfig` arguments (a plain dict:
        this layer does not import the budget)."""
        return {"prior_strength": self.prior_strength, "prior_acceptance": self.prior_acceptance,
                "probe_tokens": min(self.probe_tokens, self.max_draft_tokens), "probe_period": self.probe_period,
                "probe_max_period": max(self.probe_max_period, self.probe_period), "reject_run": self.reject_run}

    @property
    def past_trained_context(self) -> bool:
        return self.served_context > self.trained_context

    def source(self, name: str) -> str:
        return dict(self.sources).get(name, "default")

    def describe(self) -> str:
        """One log line: what is served and where each choice came from."""
        ver = self.verification
        if ver in ("threshold", "product"):
            ver += f" {self.threshold:g}"
        window = f"{self.window} tokens" if self.window else "off"
        gate = f"{self.max_draft_context}" if self.max_draft_context else "off"
        return (f"block {self.block_size}, verify up to {self.max_draft_tokens} drafts ({ver}, "
                f"{self.source('verification')}), window {window} ({self.source('window')}), "
                f"context gate {gate}, draft sampling {self.draft_sampling}"
                + (f", draft vocabulary {self.draft_vocab}" if self.draft_vocab else "")
                + (f", copy source (min match {self.copy_min_match}"
                   + (f", {self.copy_shared} shared tokens" if self.copy_shared else "") + ")" if self.copies else "")
                + ("" if self.use_markov else ", Markov bias DISABLED (ablation)"))

    def context_note(self) -> str | None:
        """What the drafter does past its trained context (None when it never gets there)."""
        if not self.past_trained_context:
            return None
        head = (f"DSpark drafter trained at {self.trained_context:,} positions serves contexts up to "
                f"{self.served_context:,}: RoPE angles are computed exactly at every position")
        if self.max_draft_context is not None:
            head += f"; requests past {self.max_draft_context:,} tokens decode without drafts"
        if self.window:
            return head + (f"; it attends to the most recent {self.window:,} context tokens (its KV cache "
                           "is bounded to that window)")
        return head + ("; the attention window is OFF, so past the trained context it attends to relative "
                       "distances it never saw and acceptance may fall")

    # -------------------------------------------------------------- transport
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sources"] = [list(x) for x in self.sources]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DSparkSettings:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = set(d) - names, {f.name for f in dataclasses.fields(cls)
                                            if f.default is dataclasses.MISSING and f.name not in d}
        if unknown or missing:
            raise DSparkSettingsError(f"malformed DSpark settings (unknown {sorted(unknown)}, missing "
                                      f"{sorted(missing)}); they are built by vllm_dspark's config patch")
        kw = dict(d)
        kw["sources"] = tuple(tuple(x) for x in d.get("sources", ()))
        return cls(**kw)


def for_async_scheduling(s: DSparkSettings) -> tuple[DSparkSettings, str | None]:
    """The settings under vLLM's asynchronous scheduling, and the warning to log (or None).

    With async scheduling the V1 runner verifies a fixed number of drafts per request, so a
    rule that cuts drafts cannot run. The default budget falls back to ``fixed`` (with a
    warning); a rule, a context gate or a verify cap the user chose is refused.
    """
    if not s.cuts_drafts:
        return s, None
    if s.source("verification") == "default" and s.max_draft_context is None \
            and s.max_draft_tokens == s.num_draft_tokens:
        return (dataclasses.replace(s, verification="fixed",
                                    sources=s.sources + (("verification", "async scheduling"),)),
                "async scheduling is on, and the V1 runner then verifies a fixed number of drafts per request: "
                "budgeted verification is off (start vLLM with --no-async-scheduling to use it)")
    raise DSparkSettingsError(
        f"verification {s.verification!r} (or a context gate, or num_speculative_tokens below the block) cuts "
        "drafts per request, which needs synchronous scheduling on the V1 runner; start vLLM with "
        "--no-async-scheduling (LLM(..., async_scheduling=False)), or set "
        f"speculative_config['{SPEC_KEY}']['verification'] to 'fixed'")


def not_applied_on_v2(environ: Mapping[str, str] | None = None, copy: str | None = None) -> str | None:
    """The warning for DSpark environment settings vLLM 0.33's V2 path ignores, or None when none is set.

    On V2 upstream's own DSpark speculator drafts and verifies; only the Markov op is
    ours, so none of this table's settings applies there (verification is upstream's
    ``enable_adaptive_verification``, fed by the confidence head). The copy source is on by default,
    so the line says it does not run whenever it is on (``copy``: the resolved setting, when known).
    """
    env = os.environ if environ is None else environ
    ignored = [row.env for row in SETTINGS if row.env and env.get(row.env)]
    copy_on = (copy if copy is not None else env.get("VLLM_DSPARK_COPY", _default("copy"))) != "off"
    copy = ("the copy source (copy: auto, the default) does not run there: upstream's speculator owns the draft"
            if copy_on else "")
    if not ignored:
        return copy or None
    return (f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} not applied on vLLM 0.33's V2 path; "
            "use the speculative config's enable_adaptive_verification (fed by the confidence head)"
            + (f"; {copy}" if copy else ""))


def settings_of(hf_config: Any) -> DSparkSettings:
    """The settings the config patch attached to the draft's HF config (never a default)."""
    raw = getattr(hf_config, ATTR, None)
    if raw is None:
        raise DSparkSettingsError(
            f"the draft config carries no {ATTR}: it was not resolved by vllm_dspark's config patch "
            "(is the plugin registered in this process?)")
    if isinstance(raw, DSparkSettings):
        return raw
    return DSparkSettings.from_dict(raw)


def attach(hf_config: Any, settings: DSparkSettings) -> None:
    setattr(hf_config, ATTR, settings.to_dict())


# ------------------------------------------------------------------ resolving
def resolve_settings(cfg: DSparkConfig, *, draft: str, dflash_config: Mapping[str, Any] | None,
                     spec_options: Mapping[str, Any] | None, num_speculative_tokens: int | None,
                     served_context: int, environ: Mapping[str, str] | None = None) -> DSparkSettings:
    """Resolve every setting of the table from its sources (see the module docstring); all problems at once."""
    env = os.environ if environ is None else environ
    dc = dict(dflash_config or {})
    opts = dict(spec_options or {})
    problems: list[str] = []
    unknown = sorted(set(opts) - set(SPEC_KEYS))
    if unknown:
        problems.append(f"speculative_config['dspark']: unknown keys {unknown}; known: {list(SPEC_KEYS)}")
    sources: dict[str, str] = {}
    values: dict[str, Any] = {}
    # The window's lower bound is the drafter's block (a window must hold at least one block's queries).
    parsers = {"window": tokens_or_off(cfg.block_size + 1)}

    for row in SETTINGS:
        parse = parsers.get(row.name, row.parse)
        if row.name in opts:
            raw, src = opts[row.name], f"speculative_config['{SPEC_KEY}']['{row.name}']"
        elif row.env and env.get(row.env, "") != "":
            raw, src = env[row.env], row.env
            if row.name == "use_markov":  # the variable disables: VLLM_DSPARK_DISABLE_MARKOV=1
                parse = disable_flag
        elif row.dflash_key and dc.get(row.dflash_key) is not None:
            raw, src = dc[row.dflash_key], f"dflash_config.{row.dflash_key}"
        else:
            continue
        try:
            values[row.name] = parse(raw, row.name, src)
        except DSparkSettingsError as exc:
            problems.append(str(exc))
            continue
        sources[row.name] = src

    n_cap = cfg.num_draft_tokens if num_speculative_tokens is None else int(num_speculative_tokens)
    if not 1 <= n_cap <= cfg.num_draft_tokens:
        problems.append(f"num_speculative_tokens: got {n_cap}, but this drafter proposes at most "
                        f"{cfg.num_draft_tokens} tokens per step (block_size {cfg.block_size}, "
                        f"{cfg.query_layout} layout); set 1 <= num_speculative_tokens <= {cfg.num_draft_tokens}")
        n_cap = cfg.num_draft_tokens

    # Defaults that depend on other settings or on the checkpoint.
    threshold = float(values.get("threshold", _default("threshold")))
    verification = values.get("verification")
    if verification is None and "verification" in sources:
        verification = "fixed"  # its parse failed; the problem is reported
    if verification is None:
        if threshold > 0:
            verification = "threshold"
            sources["verification"] = f"implied by the threshold ({sources['threshold']})"
        else:
            verification = "budget" if cfg.enable_confidence_head else "fixed"
    if verification in ("budget", "threshold", "product") and not cfg.enable_confidence_head:
        problems.append(f"verification: {verification!r} needs the drafter's confidence head, which this "
                        "checkpoint does not have (enable_confidence_head false); use 'fixed'")
    if verification in ("threshold", "product") and threshold <= 0:
        problems.append(f"verification: {verification!r} needs a threshold in (0, 1]; set "
                        f"speculative_config['{SPEC_KEY}']['threshold'] or {BY_NAME['threshold'].env}")

    trained = cfg.max_position_embeddings
    if "window" in sources:
        window = values.get("window")
    elif dc.get("use_swa") is False:
        window, sources["window"] = None, "dflash_config.use_swa"
    elif dc.get("use_swa") and dc.get("swa_window_size"):
        try:
            window = parsers["window"](dc["swa_window_size"], "window", "dflash_config.swa_window_size")
        except DSparkSettingsError as exc:
            problems.append(str(exc))
            window = None
        sources["window"] = "dflash_config.swa_window_size"
    else:
        window = trained if trained < served_context else None
        if window is not None:
            sources["window"] = "default: the drafter's trained context (max_position_embeddings)"

    trust = {name: values.get(name, _default(name)) for name in TRUST_NAMES}
    if int(trust["probe_max_period"]) < int(trust["probe_period"]):
        problems.append(f"probe_max_period ({sources.get('probe_max_period', 'default')}): got "
                        f"{trust['probe_max_period']}, below probe_period {trust['probe_period']}; set it to at "
                        f"least probe_period")
    draft_vocab, table = values.get("draft_vocab", _default("draft_vocab")), values.get("draft_vocab_table")
    table_by_default = table is None
    table = str(Path(str(draft)) / FILE_NAME) if table is None else table
    vocab_auto = draft_vocab == "auto"
    if vocab_auto:
        draft_vocab = _auto_draft_vocab(cfg, table)
        sources["draft_vocab"] = (f"auto: {draft_vocab} (a frequency table with the drafter)" if draft_vocab
                                  else "auto: off (no frequency table, or the drafter has its own vocabulary)")
    if draft_vocab is not None:
        if cfg.draft_vocab_size is not None:
            problems.append(f"draft_vocab ({sources['draft_vocab']}): this drafter already has a draft vocabulary "
                            f"({cfg.draft_vocab_size} tokens, its own d2t); unset draft_vocab")
        elif draft_vocab >= cfg.vocab_size:
            problems.append(f"draft_vocab ({sources['draft_vocab']}): got {draft_vocab}, but the vocabulary has "
                            f"{cfg.vocab_size} tokens; set 1 <= draft_vocab < {cfg.vocab_size}, or 'off'")
        if table_by_default:
            sources["draft_vocab_table"] = "default: the drafter's directory"
    if problems:
        raise DSparkSettingsError("DSpark settings cannot be served:\n  - " + "\n  - ".join(problems), problems)
    return DSparkSettings(
        draft=str(draft), block_size=cfg.block_size, num_draft_tokens=cfg.num_draft_tokens,
        max_draft_tokens=n_cap, query_layout=cfg.query_layout, has_confidence_head=cfg.enable_confidence_head,
        verification=verification, threshold=threshold, window=window,
        max_draft_context=values.get("max_draft_context"),
        draft_sampling=values.get("draft_sampling", _default("draft_sampling")),
        use_markov=bool(values.get("use_markov", _default("use_markov"))), trained_context=trained,
        served_context=int(served_context), trace_path=values.get("trace"),
        stats_interval_s=float(values.get("stats_interval", _default("stats_interval"))),
        costs=values.get("costs"), profile_cache=values.get("profile_cache", _default("profile_cache")),
        prior_strength=float(trust["prior_strength"]), prior_acceptance=float(trust["prior_acceptance"]),
        probe_tokens=int(trust["probe_tokens"]), probe_period=int(trust["probe_period"]),
        probe_max_period=int(trust["probe_max_period"]), reject_run=int(trust["reject_run"]),
        draft_vocab=draft_vocab, draft_vocab_table=table if draft_vocab is not None else None,
        draft_vocab_auto=vocab_auto,
        copy=values.get("copy", _default("copy")),
        copy_min_match=int(values.get("copy_min_match", _default("copy_min_match"))),
        copy_shared=values.get("copy_shared"),
        sources=tuple(sorted(sources.items())))

