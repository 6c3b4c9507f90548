"""The peak of one training step of the model one rank runs, FSDP2's buffers replayed on it."""
from __future__ import annotations

from typing import Mapping, Optional, Tuple

from ..profile.profiling import ModelProfile
from .fsdp_timeline import FsdpTimeline, replay_fsdp


def dynamic_peak(profile: ModelProfile, n: int, t: int, tp_plan: Optional[Mapping[str, str]] = None,
                 tp: int = 1, fsdp: Optional[FsdpTimeline] = None) -> Tuple[int, int, int, int]:
    """Bytes above the memory at the start of a forward + backward of ``n`` samples and ``t``
    steps: (peak of the forward, peak of the backward beside the gradients, left after the
    backward beside the gradients). With ``tp > 1``: of one TP rank under ``tp_plan``
    (:func:`~..profile.tp_replica.tp_replica`). With ``fsdp``: FSDP2's own buffers replayed on the
    same run (:mod:`.fsdp_timeline`), the backward's and what is left include the gradients
    FSDP2 keeps, and a fourth value is the most FSDP2's buffers held at once (else 0). Cached on
    the profile."""
    key = (n, t) + profile.rank_model(tp_plan, tp)[0]
    if (key, fsdp) not in profile.peaks:
        units = {u.path for u in fsdp.units if u.path} if fsdp else set()
        run = profile.logged_run(n, t, tp_plan, tp, units)
        fwd, bwd, after, held = replay_fsdp(run["log"], run["entry"], fsdp)
        grads = 0 if fsdp else run["grads"]
        profile.peaks[(key, fsdp)] = (fwd, bwd - grads, after - grads, held)
    return profile.peaks[(key, fsdp)]
