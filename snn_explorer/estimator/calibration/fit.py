"""From every rank's calibration timings to a :class:`HardwareProfile`: alpha-beta fits of each
collective, the wrappers' and pipeline schedules' own costs, the median over fresh worlds."""
from __future__ import annotations

import datetime
import socket
import statistics
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

from ...core.common import Collective
from ..timing.hardware import KINDS, HardwareProfile
from ..timing.pipeline_time import BACKWARD_SHARE, replay_plan
from .probes import BURST, SIZES_BYTES

MIN_BETA = 1e-13


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> Tuple[float, float]:
    """Least-squares ``seconds = alpha + beta * nbytes`` in relative error (weights ``1 / seconds**2``);
    alpha clamped at 0 (then beta refitted through 0).
    Times that do not grow with the size give their smallest as alpha and :data:`MIN_BETA` or more."""
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ValueError(f"need timings at two or more distinct sizes, got sizes {list(nbytes)}")
    n = len(nbytes)
    w = [1.0 / max(y, 1e-12) ** 2 for y in seconds]  # relative errors: the small sizes fix alpha
    sw = sum(w)
    mx, my = sum(wi * x for wi, x in zip(w, nbytes)) / sw, sum(wi * y for wi, y in zip(w, seconds)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, nbytes))
    beta = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, nbytes, seconds)) / sxx
    alpha = my - beta * mx
    if alpha < 0:
        alpha = 0.0
        beta = sum(wi * x * y for wi, x, y in zip(w, nbytes, seconds)) / sum(wi * x * x for wi, x in zip(w, nbytes))
    if beta <= MIN_BETA:  # latency-bound over every size (or noise hid the slope): the level and the largest size
        alpha = min(seconds)
        big = max(range(n), key=lambda i: nbytes[i])
        beta = max(MIN_BETA, (seconds[big] - alpha) / nbytes[big])
    return alpha, beta


def wrapper_costs(values: List[dict], table: Dict[str, Tuple[float, float]]) -> Dict[str, float]:
    """Per TP-sharded module call, per FSDP2 collective, per DDP step and per ZeRO step: what the
    slowest rank's wrapped step (:func:`wrapped_step_times`) takes beyond the plain one and beyond
    the collectives it made, as fitted (``table``: kind -> alpha, beta), ZeRO's broadcasts at the
    fixed cost of one in a burst (``broadcast_in_burst``, from :func:`broadcast_burst`); per
    action and per transfer of each pipeline schedule (:func:`pipeline_costs`)."""
    times = {k: max(v["framework"][k] for v in values) for k in ("plain", "tp", "fsdp", "ddp", "adam", "zero")}
    made = values[0]["framework"]["collectives"]
    costs = {}
    if "broadcast_burst" in values[0]["framework"]:  # the slowest rank's median, per broadcast
        burst = statistics.median(max(ts) for ts in zip(*(v["framework"]["broadcast_burst"] for v in values)))
        costs["broadcast_in_burst"] = max(burst / BURST - table[Collective.BROADCAST][1] * 1024, 0.0)
    alpha = {kind: table[kind][0] for kind in KINDS}
    # ZeRO's broadcasts go out back to back
    alpha_of = lambda name, kind: (costs.get("broadcast_in_burst", alpha[kind]) if (name, kind) == ("zero", Collective.BROADCAST)
                                   else alpha[kind])
    comm = {name: sum(alpha_of(name, kind) + table[kind][1] * nbytes for kind, nbytes in rows)
            for name, rows in made.items()}
    beyond = lambda name, base: max(0.0, times[name] - times[base] - comm[name])
    return {"tp_module": beyond("tp", "plain") / values[0]["framework"]["tp_calls"],
            "fsdp_collective": beyond("fsdp", "plain") / max(1, len(made["fsdp"])),
            "ddp_step": beyond("ddp", "plain"), "zero_step": beyond("zero", "adam"),
            **costs,
            **{key: cost for name in values[0]["framework"].get("pipeline", {})
               for key, cost in pipeline_costs(name, [v["framework"]["pipeline"][name] for v in values],
                                                table).items()}}


def probe_costs(values: List[dict], per_action: float = 0.0) -> Dict[Tuple[str, int], float]:
    """Seconds of each ``(action kind, stage)`` of a pipeline probe (every rank's values): its block's
    own time (the slowest rank's), plus ``per_action``."""
    pp_plan, heavy = values[0]["plan"], values[0]["heavy"]
    first = pp_plan.pp_schedule_spec.rank_stages(0, pp_plan.pp_size, pp_plan.pp_virtual_stages)
    block = lambda s, phase: max(v[f"{'heavy' if s in first and heavy > 1 else 'light'}_{phase}"] for v in values)
    return {(kind, s): per_action + (block(s, "F") if kind == "F" else share * block(s, "B"))
            for s in range(pp_plan.pp_stages) for kind, share in (("F", 1.0), *BACKWARD_SHARE.items())}


def replayed_step(values: List[dict], table: Dict[str, Tuple[float, float]], per_action: float = 0.0,
                   extra_link: float = 0.0):
    """(seconds of the step, time lines) of a pipeline probe (:func:`pipeline_step_times`, every
    rank's values) as its schedule replays (:func:`~.pipeline_time.replay_plan`): each action
    :func:`probe_costs`, each transfer the fitted latency plus ``extra_link``, then the loss broadcast."""
    pp_plan = values[0]["plan"]
    link = table[Collective.SEND][0] + table[Collective.SEND][1] * values[0]["bytes"] + extra_link
    lines = replay_plan(pp_plan, probe_costs(values, per_action),
                        {(s + d, s + 1 - d): link for s in range(pp_plan.pp_stages - 1) for d in (0, 1)})
    return max(span[-1] for spans in lines.values() for span in spans) + table[Collective.BROADCAST][0], lines


def pipeline_costs(name: str, probes: List[List[dict]], table: Dict[str, Tuple[float, float]]) -> Dict[str, float]:
    """A pipeline schedule's own costs from its probes (``probes``: per rank, its
    :func:`pipeline_step_times` with rank 0's blocks heavy, then with every block alike), neither below 0:

    - ``pp_action:<name>``, per action of a rank (a micro-batch's forward or backward through a
      stage): what the slowest rank (rank 0, heavy) took beyond its actions' compute, its waits for
      transfers and the loss broadcast, per action (a rank that others wait for pays less per
      action than one that waits in turn; a pipeline's step is set by its slowest rank);
    - ``pp_link:<name>``, latency per transfer beyond the fitted send's: what makes the replay of
      the probe with every block alike, with that cost per action, take its measured step."""
    heavy, even = [ranks[0] for ranks in probes], [ranks[1] for ranks in probes]
    rank0 = replayed_step(heavy, table)[1][0]
    costs = probe_costs(heavy)
    own = heavy[0]["step"] - heavy[0]["waited"] - table[Collective.BROADCAST][0] - sum(costs[(k, s)] for k, s, *_ in rank0)
    per_action = max(0.0, own / len(rank0))
    measured = max(v["step"] for v in even)
    step_with = lambda link: replayed_step(even, table, per_action, link)[0]
    low, high = 0.0, (measured if step_with(0.0) < measured else 0.0)
    for _ in range(40):  # bisection: the replayed step grows with the latency
        mid = (low + high) / 2
        low, high = (mid, high) if step_with(mid) < measured else (low, mid)
    return {f"pp_action:{name}": per_action, f"pp_link:{name}": high}


def profile_from(runs: Dict[int, List[dict]], backend: str, name: Optional[str],
                  reference_step: Optional[float] = None) -> HardwareProfile:
    """The profile from every rank's values of the world of each group size ``p`` (``runs[p]``);
    sharing relative to ``reference_step`` (the probe step timed in the calling process, as the
    estimator times a model's step there) or, without it, to rank 0's probe step run alone."""
    alone = next(v[0]["alone"] for v in runs.values() if v[0]["alone"] is not None)
    reference_step = reference_step or alone["step"]
    table: Dict[str, Dict[int, Tuple[float, float]]] = {k: {} for k in KINDS}
    sharing, overheads = {}, {}
    for p, values in runs.items():
        sharing[p] = max(v["shared"] for v in values) / reference_step
        for kind in KINDS:
            medians = [statistics.median(max(ts) for ts in zip(*(v["collectives"][(kind, s)] for v in values)))
                       for s in SIZES_BYTES]
            table[kind][p] = fit_alpha_beta(SIZES_BYTES, medians)
        if "framework" in values[0]:
            overheads[p] = wrapper_costs(values, {kind: table[kind][p] for kind in KINDS})
    host = socket.gethostname()
    device = "cuda" if backend == "nccl" else "cpu"
    return HardwareProfile(name=name or f"{host} ({device}, {backend})", device=device, flops_per_s=alone["flops"],
                           bytes_per_s=alone["bandwidth"], op_overhead_s=alone["overhead"], collectives=table,
                           compute_sharing=sharing, framework_overhead=overheads, efficiency=1.0, host=host,
                           measured_half=alone.get("half", {}),
                           source=f"calibrated on {host} {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
                                  f"({backend}, {max(runs)} ranks)")


def median_profile(profiles: Sequence[HardwareProfile]) -> HardwareProfile:
    """One profile whose every calibrated figure (compute, each alpha and beta, sharing, wrapper
    costs) is the median over ``profiles``, calibrations of the same sizes."""
    first, med = profiles[0], statistics.median
    if len(profiles) == 1:
        return first
    collectives = {kind: {p: tuple(med(pr.collectives[kind][p][i] for pr in profiles) for i in (0, 1))
                          for p in by_size} for kind, by_size in first.collectives.items()}
    sharing = {p: med(pr.compute_sharing[p] for pr in profiles) for p in first.compute_sharing}
    overheads = {p: {key: med(pr.framework_overhead[p][key] for pr in profiles) for key in costs}
                 for p, costs in first.framework_overhead.items()}
    half = {name: {key: med(pr.measured_half[name][key] for pr in profiles) for key in rates}
            for name, rates in first.measured_half.items()}
    return replace(first, flops_per_s=med(pr.flops_per_s for pr in profiles), measured_half=half,
                   bytes_per_s=med(pr.bytes_per_s for pr in profiles),
                   op_overhead_s=med(pr.op_overhead_s for pr in profiles), collectives=collectives,
                   compute_sharing=sharing, framework_overhead=overheads,
                   source=f"{first.source}, median of {len(profiles)} worlds per size")
