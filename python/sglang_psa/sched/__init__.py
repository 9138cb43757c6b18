"""Scheduler logic, pure Python: working sets and HBM admission.

plugin/ calls these from SGLang's scheduler; nothing here touches SGLang or a GPU.
"""

from sglang_psa.sched.admission import (
    AdmissionController,
    AdmissionStats,
    AdmitResult,
    Candidate,
    CannotFit,
)
from sglang_psa.sched.estimates import WorkingSetTracker, always_attended_units

__all__ = [
    "AdmissionController",
    "AdmissionStats",
    "AdmitResult",
    "Candidate",
    "CannotFit",
    "WorkingSetTracker",
    "always_attended_units",
]
