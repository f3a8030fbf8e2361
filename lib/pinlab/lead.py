"""Claims that need the host ahead of the GPU: a race, a pending copy or a stale read shown in this run.

A race shows only where the host runs ahead of the GPU: the lessons keep the GPU milliseconds behind a host
that needs microseconds per step, a wide lead on any CUDA GPU, quiet or shared. One setting removes it on every
GPU: ``CUDA_LAUNCH_BLOCKING=1``, which a learner sets to debug. Every launch and copy then waits until the GPU
has run it, nothing is ever pending, and the race cannot happen, though the code is as wrong as before (the
heisenbug of lesson 03, whose order verdict names it anyway).

:func:`claim` asserts such an effect. It prints a ``[measured]`` line (:func:`pinlab.observe`'s: the count is
this run's timing) and raises :class:`pinlab.ClaimError`, as :func:`pinlab.claim` does, where the effect did
not show; under ``CUDA_LAUNCH_BLOCKING=1`` (:func:`pinlab.probe.launch_blocking`) it does not raise, and the line
says the launches blocked::

    from pinlab import lead
    lead.claim("the reused pinned buffer delivered another step's data at least once", len(wrong) >= 1,
               value=f"{len(wrong)} of 200", why=l03.WHY.host_ahead)

A claim that must hold whatever the timing (0 corrupted steps with a fix, the order verdict's count) stays a
:func:`pinlab.claim`.

(A module of its own, not a keyword of :func:`pinlab.claim`: ``claims.py`` is imported by every notebook, so a
change there renews every notebook's recorded run; these claims are made only by the race lessons, 03, 04, 08 and
09, each as it passes adverse condition (f), ``CUDA_LAUNCH_BLOCKING=1``: tools/evidence.py's EXTRA_CONDITIONS.)
"""
from __future__ import annotations

from .claims import ClaimError, _truth, _why, failure_message, observe
from .probe import launch_blocking

__all__ = ["claim"]


def claim(text: str, holds, *, value=None, why: str | None = None) -> None:
    """Assert an effect that needs the host ahead of the GPU; under ``CUDA_LAUNCH_BLOCKING=1`` only observe it.

    ``holds``: whether the effect showed in this run (a bool); ``value``: what this run measured; ``why``: what
    else may hide it (a name of the lesson's :class:`pinlab.Reasons` table). Prints ``[measured] text: yes
    (value)``, or ``text: not in this run (value)`` with the reason. Raises :class:`pinlab.ClaimError` with the
    claim, the value, the reason and this machine where it did not hold, unless launches block. Returns nothing,
    as :func:`pinlab.claim`.
    """
    ok, why = _truth("holds", holds), _why(why) or None
    observe(text, ok, value=value, why=why)
    if not ok and not launch_blocking():
        raise ClaimError(failure_message(text, value, why))
