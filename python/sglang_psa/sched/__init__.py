"""Scheduler logic: working sets and HBM admission.

`admission`, `estimates` and `prefill_budget` are pure Python; `serving` is one scheduler
process's admission state and what the hooks ask of it; `process` assembles everything
that process owns (its GPU-side parts through `mem_cache`). plugin/ calls in from
SGLang's scheduler; nothing here imports SGLang.
"""

from sglang_psa.sched.admission import (
    AdmissionController,
    AdmissionStats,
    AdmitResult,
    Candidate,
    CannotFit,
    SharedPrefix,
)
from sglang_psa.sched.estimates import WorkingSetTracker, always_attended_units

__all__ = [
    "AdmissionController",
    "AdmissionStats",
    "AdmitResult",
    "Candidate",
    "CannotFit",
    "SharedPrefix",
    "WorkingSetTracker",
    "always_attended_units",
]
