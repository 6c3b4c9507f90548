"""The estimator's progress hook: ``on_progress(done, total, label)`` after each piece of a long wait.

``label`` names the phase (calibrating, profiling); ``done`` of ``total`` counts its pieces and starts
again at 0 when the label's phase changes. The hook only observes: it returns nothing and what it
raises propagates. ``None`` everywhere means no reports.
"""
from __future__ import annotations

from typing import Callable, Optional

#: ``on_progress(done, total, label)``.
ProgressHook = Callable[[int, int, str], None]


def check_hook(on_progress: Optional[ProgressHook]) -> Optional[ProgressHook]:
    """``on_progress`` itself; TypeError when it is neither None nor callable."""
    if on_progress is not None and not callable(on_progress):
        raise TypeError(f"on_progress must be None or a callable (done, total, label), got {on_progress!r}")
    return on_progress


def tell(on_progress: Optional[ProgressHook], done: int, total: int, label: str) -> None:
    """``on_progress(done, total, label)`` unless it is None."""
    if on_progress is not None:
        on_progress(done, total, label)
