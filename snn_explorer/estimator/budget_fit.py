"""fit_budget(): the fastest plan whose estimated peak fits a memory budget, levers chosen by their effect.

Every plan :func:`~.enumerate.enumerate_plans` accepts for the world size is estimated without memory
levers, and with each lever combination its gates allow (activation checkpointing by blocks, every 1st or 2nd
block; spike compression, :mod:`~snn_explorer.core.levers.spike_compression`; both together:
:func:`~snn_explorer.core.levers.memory_levers.lever_variants`; time chunks sized by estimate,
:func:`~snn_explorer.core.levers.chunk_choice.choose_chunks`, the fastest size that fits), all from one shared
:class:`~.profile.ModelProfile`. A lever stays in a plan only where the estimate says it lowers that
plan's peak; a lever the estimate says raises the peak (a model whose memory is mostly parameters) is
dropped and the table says by how much. Checkpointing is also chosen block by block
(:func:`~snn_explorer.core.levers.block_choice.choose_blocks`: blocks ordered by saved bytes freed per recompute second,
added until the budget fits or the peak stops falling; one row per set tried). On a hardware profile with a host link (the GPU datasheet
profiles) activation offload (:mod:`~snn_explorer.core.levers.activation_offload`) is searched too, alone, and FSDP2's CPU
offload of its shards (``cpu_offload``, :mod:`.memory.fsdp_offload`; where the profile states the host's Adam
rate), alone and with each checkpointing variant and spike compression.
"""
from __future__ import annotations

import dataclasses
import html
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import pandas as pd
import torch
from torch import nn

from ..core import DistributedFeatureSet, SNNDistributedPlan, analyze
from ..core.common import Checkpointing, Vocabulary, positive_int, positive_number
from ..core.levers import (
    block_choice_applies,
    choose_blocks,
    choose_chunks,
    chunk_choice_applies,
    chunked,
    copy_without_levers,
    find_time_step_module,
    fsdp_offload_variants,
    lever_label,
    lever_variants,
    remembered,
    spike_compression_variants,
    with_blocks,
)
from .calibration import resolve_hardware
from .enumerate import enumerate_plans
from .memory.fsdp_offload import HOST_OPTIMIZERS
from .plan_estimate import PlanEstimate, estimate
from .profile import model_profile

#: The columns of :attr:`FitResult.table`, one row per candidate plan.
FIT_COLUMNS = ("plan", "levers", "peak_bytes", "unlevered_peak_bytes", "step_time_s", "lever_time_s", "fits",
               "outcome", "why")


class FitOutcome(Vocabulary):
    """What became of one candidate of :func:`fit_budget`."""

    CHOSEN = "chosen"
    SLOWER = "slower"                    # fits, but a faster plan fits too
    OVER_BUDGET = "over_budget"          # estimated peak above the budget
    LEVER_NO_GAIN = "lever_no_gain"      # the lever does not lower the plan's peak: dropped
    PRUNED = "pruned"                    # not estimated: it cannot beat the chosen plan


@dataclass(frozen=True)
class FitResult:
    """The plan :func:`fit_budget` chose (``plan``, ``estimate``), the budget, and every candidate (``table``:
    one row per plan, :data:`FIT_COLUMNS`, the chosen first, then the fitting ones fastest first)."""

    plan: SNNDistributedPlan
    estimate: PlanEstimate
    memory_budget: int
    table: pd.DataFrame
    search_s: float
    #: the enumerated candidates the core refused, and why (from :func:`enumerate_plans`)
    infeasible: Dict[str, str] = dataclasses.field(default_factory=dict)
    #: what the search did otherwise than its docstring says (a lever estimated to speed a step: no pruning by time)
    notes: Tuple[str, ...] = ()

    @property
    def runners_up(self) -> pd.DataFrame:
        """The candidates that lost, each with why."""
        return self.table[self.table["outcome"] != FitOutcome.CHOSEN].reset_index(drop=True)

    @property
    def pareto(self) -> pd.DataFrame:
        """The estimated candidates no other beats on both peak and step time, fastest first."""
        rows = self.table.dropna(subset=["peak_bytes"]).sort_values(["step_time_s", "peak_bytes"])
        front, lowest = [], float("inf")
        for index, peak in rows["peak_bytes"].items():
            if peak < lowest:
                front.append(index)
                lowest = peak
        return rows.loc[front].reset_index(drop=True)

    def _repr_html_(self) -> str:
        head = (f"<p><b>{self.table['plan'].iloc[0]}</b>: peak {self.estimate.peak_bytes / 2 ** 20:.2f} MiB of a "
                f"{self.memory_budget / 2 ** 20:.2f} MiB budget, {self.estimate.step_time_s * 1e3:.3f} ms per step; "
                f"searched {len(self.table)} candidates in {self.search_s:.2f} s</p>")
        notes = "".join(f"<p>note: {html.escape(n)}</p>" for n in self.notes)
        return head + notes + self.table.to_html(index=False)


def _name(plan: SNNDistributedPlan) -> str:
    """The plan's label, as Compare and the charts show it (resharding and levers included)."""
    return plan.label


def _row(plan, est: Optional[PlanEstimate], base: Optional[PlanEstimate], budget: int, outcome, why: str) -> dict:
    peak = est.peak_bytes if est is not None else None
    step = est.step_time_s if est is not None else None
    levered = base is not None and base is not est
    return dict(plan=_name(plan), levers=lever_label(plan) or "-", peak_bytes=peak,
                unlevered_peak_bytes=base.peak_bytes if base is not None else None, step_time_s=step,
                lever_time_s=(step - base.step_time_s) if levered and step is not None else 0.0,
                fits=peak is not None and peak <= budget, outcome=outcome, why=why)


#: The gates :func:`fit_budget` opens when ``features`` is None: every lever the estimator can estimate.
FIT_FEATURES = DistributedFeatureSet(allow_activation_checkpointing=True, allow_spike_compression=True,
                                     allow_cpu_offload=True)


def plan_estimator(model: nn.Module, example_input: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                   hardware=None, optimizer: str = "adam", layout=None) -> Callable[[SNNDistributedPlan], PlanEstimate]:
    """A callable plan -> :func:`estimate` of it for ``model``, every call sharing one profile (measured once).

    It is what ``snn_explorer.plan(..., peak_estimate=...)`` takes: the core's planner cannot import the
    estimator, so the ``memory`` objective gets its lever estimates injected."""
    hardware = resolve_hardware(hardware)
    layout = layout if layout is not None else analyze(model, example_input=example_input, labels=labels).data_layout
    profile = model_profile(model, example_input, labels, layout=layout)

    def estimate_of(p: SNNDistributedPlan) -> PlanEstimate:
        return estimate(model, p, example_input=example_input, labels=labels, optimizer=optimizer, profile=profile,
                        hardware=hardware, layout=layout)

    return estimate_of


def fit_budget(model: nn.Module, example_input: torch.Tensor, memory_budget: int, world_size: int, *,
        labels: Optional[torch.Tensor] = None, hardware=None, batch_size: Optional[int] = None,
        features: Optional[DistributedFeatureSet] = None, optimizer: str = "adam") -> FitResult:
    """The fastest plan for ``world_size`` ranks whose estimated per-rank peak fits ``memory_budget`` bytes.

    Searches modes, meshes (dp x tp, pp x dp, ZeRO) and memory levers together; ``features`` are the gates
    (default :data:`FIT_FEATURES`: activation checkpointing and spike compression allowed). ``batch_size`` is the global batch
    (default: the example input's). ``hardware`` is where step times are predicted (as for :func:`estimate`).
    The lever combinations of each plan are :func:`~snn_explorer.core.levers.memory_levers.lever_variants`
    (checkpointing by blocks, every 1st or 2nd block, and time chunks sized by estimate,
    :func:`~snn_explorer.core.levers.chunk_choice.choose_chunks`; spike compression; both).

    How the search prunes: the plans without levers are estimated first (one profile for all of them:
    each per-rank batch and TP layout runs the model once) and walked fastest first. A lever never makes a
    step faster in the estimator's time model (recomputation, packing and unpacking only add work), so the first unlevered plan
    that fits ends the search: the lever variants of every plan at least as slow are not estimated
    (``pruned``), and neither are those of a plan that fits already. A lever variant is estimated only for
    an unlevered plan that does not fit and is faster than the best fitting plan found so far, and only if
    it can fit at all: a variant whose rank holds more than the budget in what its levers leave as they are
    (parameters, optimizer state and buffers for checkpointing and spike compression, :func:`lever_floor`,
    read off the unlevered estimate) is ``pruned`` unestimated. Time chunks: every size, and each with spike
    compression and FSDP2's CPU offload, fastest first until no size can beat the fastest fitting plan
    (:func:`_chunk_rows`, :func:`_chunk_combinations`). Each lever variant's profile (checkpointed,
    compressed) is measured once per rank model and shared by the plans that use it; on a model of repeated
    blocks its runs are cut to a few of them and composed (:mod:`.profile.repeats_totals`, exact, else the
    whole model runs), and every plan is estimated once (:func:`~snn_explorer.core.levers.memory_levers.remembered`,
    the memo the planner's ``memory`` objective uses too). A variant is kept
    only if its estimated peak is below its unlevered plan's (else ``lever_no_gain``). So the chosen
    plan's estimated peak is never above the same plan's without levers. Raises ValueError when no plan fits,
    naming the lowest estimated peak found.

    The pruning by step time is checked as the search goes (:func:`_pruning_checked`): a levered plan estimated
    faster than its plan without levers (or a time-chunked plan faster than the same without the compression or
    offload added to it) voids it, and the search is run again
    without pruning by step time (every lever variant that can fit estimated; ``notes`` says which plan did it).
    """
    started = time.perf_counter()
    budget = int(positive_number("memory_budget", memory_budget, what="bytes per device"))
    world_size = positive_int("world_size", world_size, what="the number of ranks")
    analysis = analyze(model, example_input=example_input, labels=labels)
    layout = analysis.data_layout
    batch_size = layout.samples(example_input) if batch_size is None else positive_int("batch_size", batch_size)
    step_module = find_time_step_module(model, example_input)
    plans = enumerate_plans(analysis, world_size=world_size, batch_size=batch_size,
                            features=FIT_FEATURES if features is None else features)
    hardware = resolve_hardware(hardware)
    # what the estimate models: the host-memory levers are not in the GPU trace yet, so a GPU profile does not offer
    # them (their estimate, on the operator-count model, would be compared with traced plans)
    offload = hardware.host_link_bytes_per_s is not None and not hardware.kernel_model
    shard_offload = offload and hardware.host_adam_params_per_s is not None and optimizer in HOST_OPTIMIZERS
    estimate_of = remembered(plan_estimator(model, example_input, labels, hardware=hardware, optimizer=optimizer,
                                            layout=layout))  # the block and chunk choices ask for some variants again
    variants = {base: lever_variants(base, step_module, offload=offload, shard_offload=shard_offload, chunk_every=())
                for base in dict.fromkeys(copy_without_levers(p) for p in plans)}  # time chunks: sized in _chunk_rows
    bases = sorted(((b, estimate_of(b)) for b in variants), key=lambda be: be[1].step_time_s)
    notes: Tuple[str, ...] = ()
    try:
        rows, best = _search(bases, variants, _pruning_checked(estimate_of, bases), budget,
                             analysis.fsdp_unit_names, (step_module, shard_offload))
    except LeverSpeedsStep as exc:  # the pruning's premise is false for this model: search without it
        notes = (f"{exc}; the search ran again without pruning by step time",)
        rows, best = _search(bases, variants, estimate_of, budget, analysis.fsdp_unit_names,
                             (step_module, shard_offload), prune=False)
    if best is None:
        lowest = min((r for r in rows if r["peak_bytes"] is not None), key=lambda r: r["peak_bytes"])
        floored = sum(r["outcome"] == FitOutcome.PRUNED for r in rows)
        raise ValueError(f"no plan for world_size={world_size} fits memory_budget={budget} B per rank: the lowest "
                         f"estimated peak is {lowest['peak_bytes']} B ({lowest['plan']})"
                         + (f"; {floored} lever variant(s) not estimated hold more than the budget in parameters, "
                            "optimizer state and buffers" if floored else "")
                         + "; raise the budget or the world size, or open more levers in features")
    table = _ranked(rows, best[0])
    return FitResult(plan=best[0], estimate=best[1], memory_budget=budget, table=table,
                     search_s=time.perf_counter() - started, notes=notes,
                     infeasible=dict(plans.infeasible, **_unsearched_offload(offload, shard_offload, hardware, optimizer)))


def _unsearched_offload(offload: bool, shard_offload: bool, hardware, optimizer: str) -> Dict[str, str]:
    """Why FSDP2's CPU offload was not searched on a profile that offloads otherwise, and why neither offload was on a
    GPU profile ({} where they were, or where the profile has no host link)."""
    if hardware.kernel_model and hardware.host_link_bytes_per_s is not None:
        why = f"the host-memory levers are not in {hardware.name!r}'s GPU trace yet"
        return {"+offload (FSDP2 CPU offload)": f"not searched: {why}",
                "+offload (activations to host)": f"not searched: {why}"}
    if not offload or shard_offload:
        return {}
    why = (f"optimizer={optimizer!r}: the host step is timed for {HOST_OPTIMIZERS} only"
           if optimizer not in HOST_OPTIMIZERS else
           f"hardware {hardware.name!r} states no host Adam rate (host_adam_params_per_s=None)")
    return {"+offload (FSDP2 CPU offload)": f"not searched: {why}"}


class LeverSpeedsStep(RuntimeError):
    """A levered plan was estimated faster than a plan the search's pruning assumes it no faster than
    (:func:`_pruned_on`): pruning by step time would be unsound for this search."""


def _pruned_on(plan: SNNDistributedPlan) -> List[SNNDistributedPlan]:
    """The plans the search's pruning assumes ``plan`` is no faster than: the same plan without levers
    (:func:`_search`), and for time chunks the same plan without spike compression and without FSDP2's CPU offload,
    the levers :func:`_chunk_combinations` adds to a chunk size."""
    if plan == copy_without_levers(plan):
        return []
    out = [copy_without_levers(plan)]
    if plan.activation_checkpointing == Checkpointing.TIME_CHUNKS:
        out += [dataclasses.replace(plan, **{f: False}) for f in ("spike_compression", "cpu_offload") if getattr(plan, f)]
    return out


def _pruning_checked(estimate_of: Callable[[SNNDistributedPlan], PlanEstimate], estimated=()):
    """``estimate_of`` checking the premise of the search's pruning by step time (no lever speeds a step): each
    plan's estimate is compared with those of the plans the pruning assumes it no faster than (:func:`_pruned_on`)
    already estimated (by it, or in ``estimated``: (plan, estimate) pairs, the plans without levers); raises
    :class:`LeverSpeedsStep` where it is faster. Only what the search estimates is checked: a variant pruned unestimated
    (every variant of a plan that fits without levers) is not. (Checkpointing may well speed a compressed plan, which
    packs fewer saved tensors then: no pruning assumes otherwise.)"""
    seen: Dict[SNNDistributedPlan, PlanEstimate] = dict(estimated)

    def checked(plan: SNNDistributedPlan) -> PlanEstimate:
        est = estimate_of(plan)
        for fewer in _pruned_on(plan):
            if fewer in seen and est.step_time_s < seen[fewer].step_time_s:
                raise LeverSpeedsStep(f"{_name(plan)} was estimated faster ({est.step_time_s * 1e3:.3f} ms per step) "
                                      f"than {_name(fewer)} ({seen[fewer].step_time_s * 1e3:.3f} ms)")
        seen[plan] = est
        return est

    return checked


def _search(bases, variants, estimate_of, budget: int, blocks=(), chunks=(None, False), prune: bool = True):
    """The candidate rows and the fastest fitting (plan, estimate), walking ``bases`` fastest first (``blocks``: the
    model's blocks, for the block-by-block checkpointing choice, :func:`_block_rows`; ``chunks``: the module stepped
    once per time step and whether FSDP2's CPU offload is searched, for the time chunks, :func:`_chunk_rows`;
    ``prune``: leave out what cannot beat the fastest fitting plan, as no lever speeds a step; the floors of
    :func:`lever_floor` prune either way)."""
    rows, best = [], None
    for base, base_est in bases:
        levered = variants[base]
        fits = base_est.peak_bytes <= budget
        if fits and (best is None or base_est.step_time_s < best[1].step_time_s):
            best = (base, base_est)
        rows.append(_row(base, base_est, base_est, budget, FitOutcome.OVER_BUDGET if not fits else FitOutcome.SLOWER,
                         "" if fits else f"peak {base_est.peak_bytes} B > budget {budget} B"))
        if prune and (fits or (best is not None and base_est.step_time_s >= best[1].step_time_s)):
            why = ("its plan fits without levers, and levers only add time" if fits else
                   "its plan without levers is no faster than a fitting plan, and levers only add time")
            rows += [_row(v, None, base_est, budget, FitOutcome.PRUNED, why) for v in levered]
            continue
        seen = {base}  # this plan and its variants with a row, which the block-by-block choice does not repeat
        for v in levered:
            floor = lever_floor(base, base_est, v)
            if floor > budget:
                rows.append(_row(v, None, base_est, budget, FitOutcome.PRUNED,
                                 f"cannot fit: {floor} B per rank that its levers do not lower (parameters, "
                                 f"optimizer state, buffers) > budget {budget} B"))
                continue
            seen.add(v)
            best = _levered_row(rows, v, estimate_of(v), base_est, budget, best)
        best = _block_rows(base, base_est, blocks, estimate_of, budget, rows, best, seen=seen)
        best = _chunk_rows(base, base_est, chunks, estimate_of, budget, rows, best, prune)
    return rows, best


def _levered_row(rows: List[dict], v, est: PlanEstimate, base_est: PlanEstimate, budget: int, best):
    """Append levered plan ``v``'s row (no gain, over budget, or fitting) to ``rows``; returns the fastest
    fitting (plan, estimate) of ``best`` and ``v``."""
    if est.peak_bytes >= base_est.peak_bytes:
        rows.append(_row(v, est, base_est, budget, FitOutcome.LEVER_NO_GAIN,
                         f"peak {est.peak_bytes} B >= {base_est.peak_bytes} B without the lever"))
        return best
    fits = est.peak_bytes <= budget
    rows.append(_row(v, est, base_est, budget, FitOutcome.SLOWER if fits else FitOutcome.OVER_BUDGET,
                     "" if fits else f"peak {est.peak_bytes} B > budget {budget} B"))
    return (v, est) if fits and (best is None or est.step_time_s < best[1].step_time_s) else best


def _block_rows(base, base_est: PlanEstimate, blocks, estimate_of, budget: int, rows: List[dict], best, seen=()):
    """Checkpointing chosen block by block for ``base`` (:func:`~snn_explorer.core.levers.block_choice.choose_blocks`, greedy
    until the budget fits or the peak stops falling): a row per set of blocks tried, appended to ``rows``, but for the
    plans of ``seen`` (rows already: the every-block set is the uniform variant); returns the fastest fitting (plan,
    estimate) so far. Not tried where the blocks' floor (parameters, optimizer state, buffers) is over the budget."""
    if not block_choice_applies(base, blocks) or lever_floor(base, base_est, with_blocks(base, blocks[:1])) > budget:
        return best
    choice = choose_blocks(base, blocks, estimate_of, budget)
    for v, est in choice.tried:  # choose_blocks applies: checked above
        if v not in seen:
            best = _levered_row(rows, v, est, base_est, budget, best)
    return best


def _chunk_rows(base, base_est: PlanEstimate, chunks, estimate_of, budget: int, rows: List[dict], best,
                prune: bool = True):
    """Time chunks of ``base`` sized by estimate (:func:`~snn_explorer.core.levers.chunk_choice.choose_chunks`: every power of
    two up to one chunk), a row per size tried, then each size with spike compression and (``chunks[1]``) FSDP2's
    CPU offload (:func:`_chunk_combinations`). Returns the fastest fitting (plan, estimate) so far.

    Where ``base``'s parameters, optimizer state and buffers alone (:func:`lever_floor`) are over the budget, time
    chunks alone or compressed cannot fit and are not tried: with FSDP2's CPU offload searched, which moves
    parameters and optimizer state to the host, the chunks are sized on ``base`` offloaded instead (its floor:
    buffers), else none is tried."""
    step_module, shard_offload = chunks
    if not chunk_choice_applies(base, step_module):
        return best
    sized_on = base
    if lever_floor(base, base_est, chunked(base, step_module, 1)) > budget:
        offloaded = fsdp_offload_variants([base]) if shard_offload else []
        if not offloaded or lever_floor(base, base_est, chunked(offloaded[0], step_module, 1)) > budget:
            return best
        sized_on = offloaded[0]
    choice = choose_chunks(sized_on, step_module, estimate_of, budget)
    for v, est in choice.tried:
        best = _levered_row(rows, v, est, base_est, budget, best)
    return _chunk_combinations(choice.tried, base_est, shard_offload, estimate_of, budget, rows, best, prune)


def _chunk_combinations(tried, base_est: PlanEstimate, shard_offload: bool, estimate_of, budget: int,
                        rows: List[dict], best, prune: bool = True):
    """Each chunk size of ``tried`` ((plan, estimate)) with spike compression, with FSDP2's CPU offload
    (``shard_offload``) and with both, a row for each estimated, appended to ``rows``; returns the fastest fitting
    (plan, estimate) so far.

    How it prunes (a lever only adds step time): the sizes are walked fastest first and the walk stops at the
    first size no faster than the fastest fitting plan found so far (each of its combinations is at least as slow,
    and so are those of the slower sizes); a combination is not estimated where a plan it adds levers to (the size
    alone, compressed, offloaded) is no faster than that plan, so once one combination of a size fits, the ones
    adding a lever to it are skipped. Such skipped combinations get no row. Without ``prune`` every combination is
    estimated."""
    for v, est in sorted(tried, key=lambda pe: (pe[1].step_time_s, pe[0].checkpoint_every)):
        if prune and best is not None and est.step_time_s >= best[1].step_time_s:
            break
        times = {v: est.step_time_s}  # estimated plans of this size: step time, a bound for those adding levers
        compressed = spike_compression_variants([v])
        for w in compressed + (fsdp_offload_variants([v] + compressed) if shard_offload else []):
            bound = max(t for p, t in times.items()
                        if p.spike_compression <= w.spike_compression and p.cpu_offload <= w.cpu_offload)
            if prune and best is not None and bound >= best[1].step_time_s:
                continue
            w_est = estimate_of(w)
            times[w] = w_est.step_time_s
            best = _levered_row(rows, w, w_est, base_est, budget, best)
    return best


#: Per memory lever, the plan fields that switch it on and the per-rank memory columns it leaves as they are
#: (:func:`lever_floor`). A lever that lowers a column must not list it; a lever missing here (a new one)
#: prunes nothing until it is listed.
LEVER_KEEPS = (
    (("activation_checkpointing", "checkpoint_every", "time_step_module", "checkpoint_blocks"),
     ("params_bytes", "optimizer_bytes", "buffers_bytes")),  # recomputes activations, shards nothing
    (("spike_compression",), ("params_bytes", "optimizer_bytes", "buffers_bytes")),  # packs saved 0/1 tensors
    (("cpu_offload",), ("buffers_bytes",)),  # FSDP2's shards, gradients and optimizer state to host memory
)


def lever_floor(base: SNNDistributedPlan, base_est: PlanEstimate, variant: SNNDistributedPlan) -> int:
    """Bytes of some rank that ``variant``'s estimated peak cannot go below: the per-rank columns of ``base``'s
    estimate that every lever ``variant`` adds to ``base`` leaves as they are (:data:`LEVER_KEEPS`; each column
    is a summand of the peak, the rest of which is never negative). 0 where ``variant`` changes a field no
    listed lever names."""
    changed = {f.name for f in dataclasses.fields(base) if getattr(base, f.name) != getattr(variant, f.name)}
    kept = None
    for fields, columns in LEVER_KEEPS:
        if changed & set(fields):
            kept = set(columns) if kept is None else kept & set(columns)
            changed -= set(fields)
    if changed or not kept:
        return 0
    return int(base_est.per_rank[sorted(kept)].sum(axis=1).max())


def _ranked(rows: List[dict], chosen: SNNDistributedPlan) -> pd.DataFrame:
    """The rows, the chosen first, then fitting ones fastest first, each loser saying why it lost."""
    chosen_name = _name(chosen)
    chosen_time = next(r["step_time_s"] for r in rows if r["plan"] == chosen_name)
    for r in rows:
        if r["plan"] == chosen_name:
            r.update(outcome=FitOutcome.CHOSEN, why="the fastest plan whose estimated peak fits the budget")
        elif r["outcome"] == FitOutcome.SLOWER:
            r["why"] = f"fits, but {(r['step_time_s'] - chosen_time) * 1e3:.3f} ms slower per step than the chosen"
    order = {FitOutcome.CHOSEN: 0, FitOutcome.SLOWER: 1, FitOutcome.OVER_BUDGET: 2, FitOutcome.LEVER_NO_GAIN: 3,
             FitOutcome.PRUNED: 4}
    rows = sorted(rows, key=lambda r: (order[r["outcome"]], r["step_time_s"] if r["step_time_s"] is not None
                                       else float("inf")))
    return pd.DataFrame(rows, columns=list(FIT_COLUMNS))
