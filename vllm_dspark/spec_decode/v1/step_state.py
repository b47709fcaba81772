"""What V1's proposer decides at the start of a step, and what it carries between its entry points."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_dspark.spec_decode.common.budget import Plan
from vllm_dspark.spec_decode.v1.sources import Offer


@dataclass(frozen=True)
class Decision:
    """What the start of a step decided (``DSparkProposer._decide``)."""

    t1: float  # the plan was made (the step's feedback and plan are timed up to here)
    batch: int
    req_ids: list[str]
    cap: int  # the scheduler's draft cap for this step
    caps: list[int]  # per request: the cap, or 0 past max_draft_context
    sampled: np.ndarray  # [batch] bool
    plan: Plan
    offers: dict[str, Offer] = field(default_factory=dict)  # the text sources' drafts, by source (copy: auto)
    t0: float = 0.0  # the step's propose began (feedback, offers and plan are timed from here)


@dataclass
class StepState:
    """What the proposer carries between its entry points: the runner's ``mark_step_start``,
    ``propose_before_glue`` (a step decided before the draft glue) and ``propose``."""

    last_end: float | None = None  # when the previous propose returned
    step_start: float | None = None  # when the runner's execute_model began (None: no runner patch)
    decided: Decision | None = None  # made by propose_before_glue, used by the step's propose
    hold_ok: bool = True  # steps without drafts may hold their context (context_kv)
    hold_checked: bool = False  # the first hold checked the runner's slot layout
    step_marks: int = 0
    before_glue_steps: int = 0
    copy_steps_held: int = 0  # steps only the copy drafted in whose accepted context rows were held
    copy_steps_before_glue: int = 0  # of which planned and sent before the runner's draft glue
    verify_steps_held: int = 0  # verify steps sending nothing whose accepted context rows were held
    copy_only_steps: int = 0  # steps only the copy drafted in, and the proposer's seconds on them (item 4's
    copy_only_s: float = 0.0  # measure: what a copy step costs beside the target's verify)
    rejected_rows_dropped: int = 0  # verify steps' rejected context rows the layout left out (accepted_context)
    probe_blocks_cut: int = 0  # probes whose block forward ran on the probed requests alone (probe_block)

    def take_decision(self) -> Decision | None:
        d, self.decided = self.decided, None
        return d
