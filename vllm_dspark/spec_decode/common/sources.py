"""The names of the draft sources (plain strings: they cross the TP broadcast, the trace and the report).

Kept apart from ``drafts.py`` so that the budget's pure-numpy policy can key its
calibration and costs by source without importing torch.
"""

MODEL_SOURCE = "dspark"  # the drafter's own drafts (the Markov stage)
COPY_SOURCE = "copy"  # continuations copied from the request's own text (copy_source.py)
