"""Load or recompute: what a request's found prefix costs to load from each tier against
recomputing it, from figures measured online (`estimates`), and the decision (`decision`)."""

from kvtier.costmodel.decision import (
    DECISIONS,
    LOAD_POLICIES,
    CostSnapshot,
    LoadChoice,
    choose_load,
)
from kvtier.costmodel.estimates import (
    PRIOR_PREFILL_TOKENS_PER_S,
    READ_PRIORS,
    PrefillRate,
    ReadEstimate,
    TransferRate,
    read_prior,
)

__all__ = [
    "DECISIONS",
    "LOAD_POLICIES",
    "PRIOR_PREFILL_TOKENS_PER_S",
    "READ_PRIORS",
    "CostSnapshot",
    "LoadChoice",
    "PrefillRate",
    "ReadEstimate",
    "TransferRate",
    "choose_load",
    "read_prior",
]
