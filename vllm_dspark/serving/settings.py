"""How a DSpark draft is served: every runtime setting, resolved once into one frozen object.

Sources, highest precedence first:

1. the speculative config's ``"dspark"`` block, e.g.
   ``--speculative-config '{"method": "dspark", "model": DIR, "dspark": {"window": 4096}}'``;
2. environment variables (``VLLM_DSPARK_*``, below), for operators;
3. the draft checkpoint's ``dflash_config`` (``confidence_threshold``,
   ``verification``, ``use_swa`` / ``swa_window_size``, ``max_draft_context``);
4. defaults.

=====================  ===========================  =====================================================
setting                environment                  meaning (default)
=====================  ===========================  =====================================================
``verification``       VLLM_DSPARK_VERIFICATION     which drafts the target verifies each step:
                                                    ``budget`` (default with a confidence head): rank
                                                    (request, position) slots by survival probability
                                                    and admit those that pay for their verify cost;
                                                    ``threshold``: the DSpark reference rule, cut at the
                                                    first position whose confidence < ``threshold``;
                                                    ``product``: the project's earlier rule, the longest
                                                    prefix whose running product >= ``threshold``;
                                                    ``fixed``: verify min(N, num_speculative_tokens)
                                                    (default without a confidence head)
``threshold``          VLLM_DSPARK_CONFIDENCE_...   the threshold of ``threshold``/``product`` (0);
                       ..._THRESHOLD                 a threshold > 0 with no verification set selects
                                                    ``threshold``
``window``             VLLM_DSPARK_WINDOW           draft attention window in tokens (the drafter's
                                                    trained context when it is shorter than the
                                                    target's max_model_len, else off); 0 or "off": off
``max_draft_context``  VLLM_DSPARK_MAX_DRAFT_...    past this context length a request decodes without
                       ..._CONTEXT                   drafts (off)
``draft_sampling``     VLLM_DSPARK_DRAFT_SAMPLING   ``auto``: requests with temperature > 0 draft by
                                                    sampling (honouring top-k/top-p) and hand the exact
                                                    draft distribution to the rejection sampler; greedy
                                                    requests draft greedily. ``greedy``: every draft is
                                                    an argmax (auto)
``trace``              VLLM_DSPARK_TRACE            JSONL file, one record per request and draft step
``stats_interval``     VLLM_DSPARK_STATS_INTERVAL   seconds between verification log lines (30; 0 off)
``use_markov``         VLLM_DSPARK_DISABLE_MARKOV   1 drafts without the Markov bias (ablation; off)
``costs``              (speculative config only)    the budget's cost table, ``{"verify": [[tokens, s],
                                                    ...], "draft": [[requests, s], ...]}``, instead of
                                                    the start-up profile (profiled and cached)
``prior_strength``     VLLM_DSPARK_PRIOR_STRENGTH   budget: pseudo-observations of the pessimistic prior
                                                    on the drafter's acceptance (4; 0: data only)
``prior_acceptance``   VLLM_DSPARK_PRIOR_ACCEPTANCE budget: the acceptance that prior assumes at the
                                                    first position, before any is measured (0.1)
``probe_tokens``       VLLM_DSPARK_PROBE_TOKENS     budget: drafts a probe verifies for each of a few
                                                    requests while drafting is unproven (2; 0: none)
``probe_period``       VLLM_DSPARK_PROBE_PERIOD     budget: steps without drafting before a probe; the
                                                    wait doubles after each rejected probe (1)
``probe_max_period``   VLLM_DSPARK_PROBE_MAX_PERIOD budget: the longest wait between probes (256)
``reject_run``         VLLM_DSPARK_REJECT_RUN       budget: drafting steps in a row with every draft
                                                    rejected that stop admitting drafts (3; 0: never)
=====================  ===========================  =====================================================

:func:`resolve_settings` builds a :class:`DSparkSettings` (every problem is
reported at once, naming the setting, its source, the value and the fix);
the config patch attaches it to the draft's Hugging Face config as one
attribute (``dspark_settings``, a plain dict so vLLM can pickle and hash the
config) and :func:`settings_of` turns it back into the frozen object, refusing
a missing or malformed one. No vLLM imports here.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_dspark.config import DSparkConfig

VERIFICATION_MODES = ("budget", "threshold", "product", "fixed")
DRAFT_SAMPLING_MODES = ("auto", "greedy")
ATTR = "dspark_settings"
SPEC_KEY = "dspark"

ENV = {
    "verification": "VLLM_DSPARK_VERIFICATION",
    "threshold": "VLLM_DSPARK_CONFIDENCE_THRESHOLD",
    "window": "VLLM_DSPARK_WINDOW",
    "max_draft_context": "VLLM_DSPARK_MAX_DRAFT_CONTEXT",
    "draft_sampling": "VLLM_DSPARK_DRAFT_SAMPLING",
    "trace": "VLLM_DSPARK_TRACE",
    "stats_interval": "VLLM_DSPARK_STATS_INTERVAL",
    "disable_markov": "VLLM_DSPARK_DISABLE_MARKOV",
    "prior_strength": "VLLM_DSPARK_PRIOR_STRENGTH",
    "prior_acceptance": "VLLM_DSPARK_PRIOR_ACCEPTANCE",
    "probe_tokens": "VLLM_DSPARK_PROBE_TOKENS",
    "probe_period": "VLLM_DSPARK_PROBE_PERIOD",
    "probe_max_period": "VLLM_DSPARK_PROBE_MAX_PERIOD",
    "reject_run": "VLLM_DSPARK_REJECT_RUN",
}
# The budget's trust settings: (name, default, kind, lower bound, upper bound, what it means).
TRUST_SETTINGS: tuple[tuple[str, float, type, float, float, str], ...] = (
    ("prior_strength", 4.0, float, 0.0, math.inf, "pseudo-observations of the pessimistic acceptance prior"),
    ("prior_acceptance", 0.1, float, 0.0, 1.0, "the acceptance the prior assumes at the first position"),
    ("probe_tokens", 2, int, 0, math.inf, "drafts a probe verifies per probed request (0: no probes)"),
    ("probe_period", 1, int, 1, math.inf, "steps without drafting before a probe"),
    ("probe_max_period", 256, int, 1, math.inf, "the longest wait between probes, in steps"),
    ("reject_run", 8, int, 0, math.inf, "all-rejected drafting steps in a row that stop admitting (0: never)"),
)
SPEC_KEYS = ("verification", "threshold", "window", "max_draft_context", "draft_sampling", "trace",
             "stats_interval", "use_markov", "costs", *(t[0] for t in TRUST_SETTINGS))
DFLASH_KEYS = {"verification": "verification", "threshold": "confidence_threshold",
               "max_draft_context": "max_draft_context"}


class DSparkSettingsError(ValueError):
    """A DSpark setting has a value that cannot be served; the message names it and the fix."""


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
    stats_interval_s: float = 30.0
    costs: dict | None = None  # explicit budget cost table (skips the start-up profile)
    prior_strength: float = 4.0  # budget: pseudo-observations of the pessimistic acceptance prior
    prior_acceptance: float = 0.1  # budget: acceptance that prior assumes at the first position
    probe_tokens: int = 2  # budget: drafts a probe verifies per probed request (0: no probes)
    probe_period: int = 1  # budget: steps without drafting before a probe (doubles per rejected probe)
    probe_max_period: int = 256  # budget: the longest wait between probes
    reject_run: int = 8  # budget: all-rejected drafting steps in a row that stop admitting (0: never)
    sources: tuple[tuple[str, str], ...] = field(default=())

    # -------------------------------------------------------------- derived
    @property
    def cuts_drafts(self) -> bool:
        """Whether requests may verify fewer than the block's drafts (needs synchronous scheduling)."""
        return (self.verification != "fixed" or self.max_draft_tokens < self.num_draft_tokens
                or self.max_draft_context is not None)

    def trust(self) -> dict[str, float | int]:
        """The budget's :class:`~vllm_dspark.spec_decode.budget.TrustConfig` arguments (a plain dict:
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


# ------------------------------------------------------------------ parsing
def _num(value: Any, name: str, source: str, *, lo: float, hi: float, kind: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise DSparkSettingsError(f"{name} ({source}): got {value!r}, expected {kind}") from None
    if math.isnan(v) or not lo <= v <= hi:
        raise DSparkSettingsError(f"{name} ({source}): got {value!r}, expected {kind}")
    return v


def parse_threshold(value: Any, source: str) -> float:
    return _num(value, "threshold", source, lo=0.0, hi=1.0,
                kind="a number in [0, 1]: drafts are cut before the first position whose confidence is "
                     "below it (0 keeps every draft)")


def _tokens_or_off(value: Any, name: str, source: str, *, minimum: int) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("off", "none", "")):
        return None
    if isinstance(value, bool):
        raise DSparkSettingsError(f"{name} ({source}): got {value!r}, expected a token count or 'off'")
    try:
        v = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise DSparkSettingsError(f"{name} ({source}): got {value!r}, expected a token count or 'off'") from None
    if v == 0:
        return None
    if v < minimum:
        raise DSparkSettingsError(f"{name} ({source}): got {v}, expected 0/'off' or at least {minimum}")
    return v


def _choice(value: Any, name: str, source: str, choices: tuple[str, ...]) -> str:
    v = str(value).strip().lower()
    if v not in choices:
        raise DSparkSettingsError(f"{name} ({source}): got {value!r}, expected one of {list(choices)}")
    return v


def _flag01(value: Any, name: str) -> bool:
    v = str(value).strip()
    if v not in ("0", "1", ""):
        raise DSparkSettingsError(f"{name}: got {value!r}, expected 0 or 1")
    return v == "1"


def resolve_settings(cfg: DSparkConfig, *, draft: str, dflash_config: Mapping[str, Any] | None,
                     spec_options: Mapping[str, Any] | None, num_speculative_tokens: int | None,
                     served_context: int, environ: Mapping[str, str] | None = None) -> DSparkSettings:
    """Resolve every setting from its sources (see the module docstring); all problems at once."""
    env = os.environ if environ is None else environ
    dc = dict(dflash_config or {})
    opts = dict(spec_options or {})
    problems: list[str] = []
    unknown = sorted(set(opts) - set(SPEC_KEYS))
    if unknown:
        problems.append(f"speculative_config['dspark']: unknown keys {unknown}; known: {list(SPEC_KEYS)}")
    sources: dict[str, str] = {}

    def pick(name: str) -> tuple[Any, str] | None:
        if name in opts:
            return opts[name], f"speculative_config['{SPEC_KEY}']['{name}']"
        env_name = ENV.get(name)
        if env_name and env.get(env_name, "") != "":
            return env[env_name], env_name
        dkey = DFLASH_KEYS.get(name)
        if dkey and dc.get(dkey) is not None:
            return dc[dkey], f"dflash_config.{dkey}"
        return None

    def attempt(fn, *a, **kw):
        try:
            return fn(*a, **kw)
        except DSparkSettingsError as exc:
            problems.append(str(exc))
            return None

    n_cap = cfg.num_draft_tokens if num_speculative_tokens is None else int(num_speculative_tokens)
    if not 1 <= n_cap <= cfg.num_draft_tokens:
        problems.append(f"num_speculative_tokens: got {n_cap}, but this drafter proposes at most "
                        f"{cfg.num_draft_tokens} tokens per step (block_size {cfg.block_size}, "
                        f"{cfg.query_layout} layout); set 1 <= num_speculative_tokens <= {cfg.num_draft_tokens}")
        n_cap = cfg.num_draft_tokens

    threshold = 0.0
    got = pick("threshold")
    if got is not None:
        threshold = attempt(parse_threshold, got[0], got[1]) or 0.0
        sources["threshold"] = got[1]

    got = pick("verification")
    if got is not None:
        verification = attempt(_choice, got[0], "verification", got[1], VERIFICATION_MODES) or "fixed"
        sources["verification"] = got[1]
    elif threshold > 0:
        verification = "threshold"
        sources["verification"] = f"implied by the threshold ({sources['threshold']})"
    else:
        verification = "budget" if cfg.enable_confidence_head else "fixed"
    if verification in ("budget", "threshold", "product") and not cfg.enable_confidence_head:
        problems.append(f"verification: {verification!r} needs the drafter's confidence head, which this "
                        "checkpoint does not have (enable_confidence_head false); use 'fixed'")
    if verification in ("threshold", "product") and threshold <= 0:
        problems.append(f"verification: {verification!r} needs a threshold in (0, 1]; set "
                        f"speculative_config['{SPEC_KEY}']['threshold'] or {ENV['threshold']}")

    trained = cfg.max_position_embeddings
    window: int | None = trained if trained < served_context else None
    got = pick("window")
    if got is not None:
        window = attempt(_tokens_or_off, got[0], "window", got[1], minimum=cfg.block_size + 1)
        sources["window"] = got[1]
    elif dc.get("use_swa") is False:
        window, sources["window"] = None, "dflash_config.use_swa"
    elif dc.get("use_swa") and dc.get("swa_window_size"):
        window = attempt(_tokens_or_off, dc["swa_window_size"], "window", "dflash_config.swa_window_size",
                         minimum=cfg.block_size + 1)
        sources["window"] = "dflash_config.swa_window_size"
    elif window is not None:
        sources["window"] = "default: the drafter's trained context (max_position_embeddings)"

    gate = None
    got = pick("max_draft_context")
    if got is not None:
        gate = attempt(_tokens_or_off, got[0], "max_draft_context", got[1], minimum=1)
        sources["max_draft_context"] = got[1]

    draft_sampling = "auto"
    got = pick("draft_sampling")
    if got is not None:
        draft_sampling = attempt(_choice, got[0], "draft_sampling", got[1], DRAFT_SAMPLING_MODES) or "auto"
        sources["draft_sampling"] = got[1]

    trace = None
    got = pick("trace")
    if got is not None and str(got[0]).strip():
        trace = str(got[0])
    stats_interval = 30.0
    got = pick("stats_interval")
    if got is not None:
        stats_interval = attempt(_num, got[0], "stats_interval", got[1], lo=0.0, hi=math.inf,
                                 kind="seconds >= 0 (0 = off)") or 0.0
    use_markov = True
    if "use_markov" in opts:
        use_markov = bool(opts["use_markov"])
    elif env.get(ENV["disable_markov"]):
        flag = attempt(_flag01, env[ENV["disable_markov"]], ENV["disable_markov"])
        use_markov = not flag

    costs = opts.get("costs")
    if costs is not None:
        ok = (isinstance(costs, Mapping) and all(
            isinstance(costs.get(k), (list, tuple)) and costs.get(k)
            and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in costs[k]) for k in ("verify", "draft")))
        if not ok:
            problems.append("costs (speculative_config['dspark']['costs']): expected {'verify': [[tokens, "
                            "seconds], ...], 'draft': [[requests, seconds], ...]}")
            costs = None
        else:
            costs = {"verify": [list(map(float, p)) for p in costs["verify"]],
                     "draft": [list(map(float, p)) for p in costs["draft"]]}
            sources["costs"] = "speculative_config['dspark']['costs']"

    trust: dict[str, float | int] = {}
    for name, default, kind, lo, hi, meaning in TRUST_SETTINGS:
        trust[name] = default
        got = pick(name)
        if got is None:
            continue
        sources[name] = got[1]
        expected = (f"{'an integer' if kind is int else 'a number'} in [{lo:g}, {hi:g}]: {meaning}"
                    if math.isfinite(hi) else
                    f"{'an integer' if kind is int else 'a number'} >= {lo:g}: {meaning}")
        v = attempt(_num, got[0], name, got[1], lo=lo, hi=hi, kind=expected)
        if v is None:
            continue
        if kind is int:
            if isinstance(got[0], bool) or v != int(v):
                problems.append(f"{name} ({got[1]}): got {got[0]!r}, expected {expected}")
                continue
            v = int(v)
        trust[name] = v
    if int(trust["probe_max_period"]) < int(trust["probe_period"]):
        problems.append(f"probe_max_period ({sources.get('probe_max_period', 'default')}): got "
                        f"{trust['probe_max_period']}, below probe_period {trust['probe_period']}; set it to at "
                        f"least probe_period")

    if problems:
        raise DSparkSettingsError("DSpark settings cannot be served:\n  - " + "\n  - ".join(problems))
    return DSparkSettings(
        draft=str(draft), block_size=cfg.block_size, num_draft_tokens=cfg.num_draft_tokens,
        max_draft_tokens=n_cap, query_layout=cfg.query_layout, has_confidence_head=cfg.enable_confidence_head,
        verification=verification, threshold=threshold, window=window, max_draft_context=gate,
        draft_sampling=draft_sampling, use_markov=use_markov, trained_context=trained,
        served_context=int(served_context), trace_path=trace, stats_interval_s=stats_interval, costs=costs,
        prior_strength=float(trust["prior_strength"]), prior_acceptance=float(trust["prior_acceptance"]),
        probe_tokens=int(trust["probe_tokens"]), probe_period=int(trust["probe_period"]),
        probe_max_period=int(trust["probe_max_period"]), reject_run=int(trust["reject_run"]),
        sources=tuple(sorted(sources.items())))
