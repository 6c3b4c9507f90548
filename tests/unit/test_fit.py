"""fit_budget(): the fastest plan whose estimated peak fits a budget; levers only where they lower the peak."""
import dataclasses
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from models import TimeLoop, leaky
from torch import nn

from snn_explorer import (
    DistributedFeatureSet,
    PlanOptions,
    analyze,
    find_time_step_module,
    fit_budget,
    plan,
    plan_estimator,
    zoo,
)
from snn_explorer.cli import main
from snn_explorer.core.levers import (
    choose_blocks,
    choose_chunks,
    copy_without_levers,
    fsdp_offload_variants,
    lever_variants,
    remembered,
    spike_compression_variants,
)
from snn_explorer.estimator import FitOutcome, budget_fit, estimate, hardware_profile, model_profile
from snn_explorer.estimator.budget_fit import FIT_FEATURES, _chunk_rows, lever_floor
from snn_explorer.estimator.enumerate import enumerate_plans

HARDWARE_NAME = "H100-SXM"  # a built-in datasheet profile: no calibration run
#: The fit's logic checked on the operator-count model (a CPU-device twin of that profile): every lever is
#: estimated there, where a GPU profile leaves host-memory levers out of its search
HARDWARE = dataclasses.replace(hardware_profile(HARDWARE_NAME), device="cpu", kernel_model=False)
ZOO = ("mlp", "mlp_all_steps", "mlp_tutorial", "vgg", "spikformer")
FEATURES = DistributedFeatureSet(allow_activation_checkpointing=True)
ALL_GATES = DistributedFeatureSet(allow_activation_checkpointing=True, allow_spike_compression=True)
#: The cases the planner's memory objective is checked on below, one per kind of time loop: the model's own loop
#: (mlp_tutorial), all steps per call (mlp_all_steps: blocks chosen one by one), a convolutional step (vgg) and a
#: random per-step chain. The zoo mlp and the other chains step as chain0 does; the spikformer's memory objective,
#: its lever search the slowest to repeat here (20 s): test_explorer_levers.
MEMORY_OBJECTIVE_CASES = ("mlp_tutorial", "mlp_all_steps", "vgg", "chain0")


def _random_chain(seed: int):
    """A per-time-step Linear/Leaky chain of random depth and widths, and its input [T, N, F]."""
    g = torch.Generator().manual_seed(seed)
    widths = [int(w) for w in torch.randint(8, 96, (int(torch.randint(2, 5, (1,), generator=g)) + 1,), generator=g)]
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), leaky()]
    torch.manual_seed(seed)
    model = TimeLoop(nn.Sequential(*layers, nn.Linear(widths[-1], 4)))
    x = (torch.rand(int(torch.randint(2, 9, (1,), generator=g)), 4, widths[0], generator=g) < 0.5).float()
    return model, x, None


def _cases():
    for name in ZOO:
        z = zoo.build(name)
        yield name, z.model, z.example_input, z.labels
    for seed in range(3):
        yield (f"chain{seed}",) + _random_chain(seed)


def _check_choice(model, x, labels, result, profiles):
    """The chosen plan fits, is the fastest fitting row, and its peak is not above the same plan's without levers.
    ``profiles``: the model's profile per data layout, made once per model (its budgets share it)."""
    chosen = result.estimate
    assert chosen.peak_bytes <= result.memory_budget
    layout = chosen.data_layout
    if layout not in profiles:
        profiles[layout] = model_profile(model, x, labels, layout=layout)
    unlevered = estimate(model, copy_without_levers(result.plan), example_input=x, labels=labels,
                         profile=profiles[layout], hardware=HARDWARE, layout=layout)
    assert chosen.peak_bytes <= unlevered.peak_bytes
    fitting = result.table[result.table["fits"]]
    assert chosen.step_time_s == pytest.approx(fitting["step_time_s"].min())
    assert (result.table["outcome"] == FitOutcome.CHOSEN).sum() == 1
    assert not result.table["plan"].duplicated().any()  # one row per plan (every block = the uniform plan)
    # the pruning rests on this: no lever makes an estimated step faster than its plan without levers
    assert (result.table["lever_time_s"] >= 0).all()
    front = result.pareto
    assert front["step_time_s"].is_monotonic_increasing and front["peak_bytes"].is_monotonic_decreasing
    assert front["step_time_s"].iloc[0] == result.table["step_time_s"].min()
    assert result.table.loc[result.table["outcome"] != FitOutcome.CHOSEN, "why"].str.len().min() > 0


def _check_memory_objective(name, model, x, labels, outcomes):
    """plan(objective="memory") with the estimator injected: its estimated peak is not above the same plan's
    without levers, nor above any other lever combination of that plan (each lever alone included)."""
    analysis = analyze(model, example_input=x, labels=labels)
    estimate_of = remembered(plan_estimator(model, x, labels, hardware=HARDWARE))  # the planner's, then the checks'
    step_module = find_time_step_module(model, x)  # one probing forward for both topologies and the checks
    for topology in ({"dp": 2}, {"tp": 2}):
        try:
            chosen = plan(analysis=analysis, objective="memory", topology=topology, features=ALL_GATES,
                          batch_size=analysis.data_layout.samples(x), options=PlanOptions(peak_estimate=estimate_of, time_step_module=step_module))
        except ValueError:  # no TP candidates
            continue
        base = copy_without_levers(chosen)
        peak = estimate_of(chosen).peak_bytes
        others = [estimate_of(v).peak_bytes for v in lever_variants(base, step_module)]
        assert others, name
        assert peak <= estimate_of(base).peak_bytes and peak <= min(others), (name, topology)
        assert any(note.startswith("memory levers: ") for note in chosen.notes), name
        outcomes.add(("memory objective", "levered" if chosen != base else "plain"))
        if chosen.checkpoint_blocks:
            outcomes.add(("memory objective", "per-block"))


@pytest.mark.timeout(900)
def test_the_chosen_plan_never_has_a_higher_peak_than_without_its_levers():
    """fit_budget over the zoo and random chains, at the unlevered optimum's peak and 85 % and 65 % of it;
    and the planner's memory objective on MEMORY_OBJECTIVE_CASES, its levers chosen by the injected estimate
    (blocks chosen one by one included)."""
    outcomes = set()
    for name, model, x, labels in _cases():
        if name in MEMORY_OBJECTIVE_CASES:
            _check_memory_objective(name, model, x, labels, outcomes)
        top = fit_budget(model, x, 10 ** 12, 2, labels=labels, hardware=HARDWARE, features=FEATURES)
        assert top.plan == copy_without_levers(top.plan), name  # no budget pressure: no lever
        profiles = {}
        for share in (1.0, 0.85, 0.65):
            budget = int(top.estimate.peak_bytes * share)
            try:
                result = fit_budget(model, x, budget, 2, labels=labels, hardware=HARDWARE, features=FEATURES)
            except ValueError as exc:
                assert "no plan for world_size=2 fits" in str(exc), (name, share)
                continue
            _check_choice(model, x, labels, result, profiles)
            outcomes |= set(result.table["outcome"])
            outcomes.add(("levered" if result.plan != copy_without_levers(result.plan) else "plain", name))
            if result.plan.checkpoint_blocks:
                outcomes.add(("per-block", "fit"))
    # the property was exercised both ways: levers chosen somewhere, and dropped where they did not help
    assert ("levered", "spikformer") in outcomes
    assert ("memory objective", "levered") in outcomes  # kept-without-levers: test_memory_levers (injected estimate)
    # checkpointing chosen block by block (core.block_choice) is among the candidates of both, and wins somewhere
    assert ("memory objective", "per-block") in outcomes and ("per-block", "fit") in outcomes
    assert FitOutcome.LEVER_NO_GAIN in outcomes and FitOutcome.PRUNED in outcomes


def test_a_lever_that_raises_the_peak_is_dropped_and_stated():
    """The zoo mlp's memory is mostly parameters: checkpointing raises each plan's estimated peak, so a budget
    just under the fastest plan's peak is met by another plan, never by a levered one."""
    z = zoo.build("mlp")
    top = fit_budget(z.model, z.example_input, 10 ** 12, 2, labels=z.labels, hardware=HARDWARE, features=FEATURES)
    result = fit_budget(z.model, z.example_input, top.estimate.peak_bytes - 1, 2, labels=z.labels, hardware=HARDWARE,
                 features=FEATURES)
    dropped = result.table[result.table["outcome"] == FitOutcome.LEVER_NO_GAIN]
    assert len(dropped) > 0
    assert (dropped["peak_bytes"] >= dropped["unlevered_peak_bytes"]).all()
    assert result.plan == copy_without_levers(result.plan)
    assert "<table" in result._repr_html_()


def test_no_fitting_plan_names_the_lowest_peak():
    z = zoo.build("vgg")
    with pytest.raises(ValueError, match=r"memory_budget=1000 B .* lowest estimated peak is \d+ B"):
        fit_budget(z.model, z.example_input, 1000, 2, labels=z.labels, hardware=HARDWARE)
    with pytest.raises(ValueError, match="memory_budget"):
        fit_budget(z.model, z.example_input, -5, 2, labels=z.labels, hardware=HARDWARE)


def test_cli_fit_prints_the_chosen_plan_and_the_runners_up(capsys):
    """On the zoo mlp (fit_budget's search on the larger models: the property test above): a budget between its
    plans' peaks (0.13-0.25 MiB) leaves faster plans over it and slower ones fitting; one under them all is refused."""
    assert main(["fit", "zoo:mlp", "--world-size", "2", "--memory-budget", "0.18", "--hardware", HARDWARE_NAME]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("chosen: ") and "of 0.180 MiB" in first
    assert "over_budget" in out and "slower" in out
    assert main(["fit", "zoo:mlp", "--world-size", "2", "--memory-budget", "0.01", "--hardware", HARDWARE_NAME]) == 2
    assert "lowest estimated peak" in capsys.readouterr().err



def _brute_force(model, x, labels, budget, estimate_of):
    """Every plan fit_budget enumerates, and every lever variant of each, estimated by ``estimate_of``: the fastest
    fitting one whose levers lower its plan's peak (None when none fits), and per variant (its plan, the plan's
    estimate, its own)."""
    analysis = analyze(model, example_input=x, labels=labels)
    plans = enumerate_plans(analysis, world_size=2, batch_size=analysis.data_layout.samples(x), features=FIT_FEATURES)
    best, variants = None, {}
    for base in dict.fromkeys(copy_without_levers(p) for p in plans):
        base_est = estimate_of(base)
        options = [base_est] if base_est.peak_bytes <= budget else []
        by_block = choose_blocks(base, analysis.fsdp_unit_names, estimate_of, budget)  # the search's greedy sets
        tried = [v for v, _ in by_block.tried] if by_block is not None else []
        step = find_time_step_module(model, x)
        by_chunk = choose_chunks(base, step, estimate_of, budget)  # every power-of-two size, each one
        sizes = [v for v, _ in by_chunk.tried] if by_chunk is not None else []  # alone, compressed, offloaded, both
        compressed = spike_compression_variants(sizes)
        tried += sizes + compressed + fsdp_offload_variants(sizes + compressed)
        for v in lever_variants(base, step, offload=True, chunk_every=()) + tried:  # H100: a host link
            variants[v] = (base, base_est, estimate_of(v))
            if variants[v][2].peak_bytes < base_est.peak_bytes:
                options += [variants[v][2]] if variants[v][2].peak_bytes <= budget else []
        best = min([best] * (best is not None) + options, key=lambda e: e.step_time_s, default=None)
    return best, variants


def test_pruning_lever_variants_by_what_they_leave_alone_changes_no_choice():
    """The search leaves a lever variant unestimated where its plan's parameters, optimizer state and buffers
    alone exceed the budget: each such variant's own estimate is over the budget (those columns equal its
    plan's), and the plan chosen (or the refusal) equals that of estimating every variant."""
    z = zoo.build("mlp")  # memory mostly parameters: the dp plans' variants cannot fit at half the peak
    top = fit_budget(z.model, z.example_input, 10 ** 12, 2, labels=z.labels, hardware=HARDWARE)
    seen = set()
    # a plan's estimate does not depend on the budget: each is made once for the three budgets' brute force
    estimate_of = remembered(plan_estimator(z.model, z.example_input, z.labels, hardware=HARDWARE))
    for share in (0.7, 0.5, 0.3):
        budget = int(top.estimate.peak_bytes * share)
        expected, variants = _brute_force(z.model, z.example_input, z.labels, budget, estimate_of)
        try:
            result = fit_budget(z.model, z.example_input, budget, 2, labels=z.labels, hardware=HARDWARE)
        except ValueError as exc:
            pruned = any(lever_floor(base, base_est, v) > budget for v, (base, base_est, _) in variants.items())
            assert expected is None and ("not estimated hold more than the budget" in str(exc)) == pruned, share
            seen.add("none fits")
        else:
            assert (result.plan, result.estimate.peak_bytes) == (expected.plan, expected.peak_bytes), share
            assert result.estimate.step_time_s == expected.step_time_s
            seen.add("levered" if result.plan != copy_without_levers(result.plan) else "plain")
        for v, (base, base_est, est) in variants.items():
            floor = lever_floor(base, base_est, v)
            columns = ["params_bytes", "optimizer_bytes", "buffers_bytes"]
            assert est.per_rank[columns].equals(base_est.per_rank[columns]), v  # (CPU offload: in host memory)
            # the levers that move memory to the host prune by buffers only (cpu_offload) or not at all
            assert est.peak_bytes >= floor and (floor > 0 or v.cpu_offload or v.activation_offload), v
            seen |= {"floored"} if floor > budget else set()
    assert {"floored", "levered", "none fits"} <= seen


def _chunk_stand_in(p):
    """A stand-in estimate of T = 8 steps: 600 B of parameters and optimizer state on the rank unless FSDP2 offloads
    them, activations of 1000 B less 100 B per step of a chunk, halved by spike compression; each lever adds time
    (0.1 s per chunk step, 0.5 s compression, 1 s offload)."""
    k = p.checkpoint_every if p.activation_checkpointing == "time_chunks" else 0
    acts = (1000 - 100 * k) // (2 if p.spike_compression else 1)
    per_rank = pd.DataFrame({"params_bytes": [300], "optimizer_bytes": [300], "buffers_bytes": [0]})
    return SimpleNamespace(peak_bytes=acts + (0 if p.cpu_offload else 600), time_steps=8, per_rank=per_rank,
                           step_time_s=1 + 0.1 * k + 0.5 * p.spike_compression + 1.0 * p.cpu_offload)


def test_time_chunks_are_combined_with_compression_and_offload_at_every_size():
    """Every chunk size is tried with compression and FSDP2 offload, not only the size that fits alone; and where
    the parameters and optimizer state alone are over the budget, the chunks are sized with them offloaded. The
    expected plans are read off the stand-in's formulas by hand."""
    z = zoo.build("mlp")
    base = copy_without_levers(plan(analysis=analyze(z.model), objective="speed", topology={"dp": 2}, mode="fsdp2",
                                    batch_size=8, features=FIT_FEATURES))
    for budget, (k, compressed, offloaded) in (
            (1000, (2, True, False)),  # k=8 alone fits (200+600 B, 1.8 s); k=2 compressed (400+600 B) takes 1.7 s
            (550, (1, True, True))):  # over the 600 B floor: offloaded, k=1 compressed (450 B, 2.6 s) is fastest
        rows = []
        best = _chunk_rows(base, _chunk_stand_in(base), ("net", True), _chunk_stand_in, budget, rows, None)
        assert best is not None, budget
        chosen = best[0]
        assert (chosen.checkpoint_every, chosen.spike_compression, chosen.cpu_offload) == (k, compressed, offloaded)
        assert len({r["plan"] for r in rows}) == len(rows)  # one row per plan


def _speeding_stand_in(p, speeds: bool):
    """A stand-in estimate: 1600 B without levers; checkpointing takes 700 B off, spike compression 200 B (dp) or
    600 B (other modes), FSDP2 and activation offload nothing; each lever adds 0.2 s to a step of 1 s (dp), 1.3 s
    (fsdp2) or more, but where ``speeds`` compression without checkpointing takes 0.35 s off instead."""
    checkpoints = p.activation_checkpointing != "none"
    per_rank = pd.DataFrame({"params_bytes": [300], "optimizer_bytes": [300], "buffers_bytes": [0]})
    peak = 1600 - 700 * checkpoints - (200 if p.mode == "dp" else 600) * p.spike_compression
    step = {"dp": 1.0, "fsdp2": 1.3, "tp": 1.35}.get(p.mode, 1.4) + 0.02 * p.uses_zero
    step += 0.2 * (checkpoints + p.cpu_offload + p.activation_offload)
    step += -0.35 if speeds and p.spike_compression and not checkpoints else 0.2 * p.spike_compression
    return SimpleNamespace(peak_bytes=peak, time_steps=8, per_rank=per_rank, step_time_s=step)


@pytest.mark.parametrize("speeds", [False, True])
def test_a_lever_estimated_to_speed_a_step_turns_the_pruning_off(monkeypatch, speeds):
    """fit_budget's pruning assumes no lever speeds a step. With a stand-in estimator where spike compression does,
    the search notices (dp compressed, over the budget, is estimated faster than dp), says so in ``notes`` and
    searches again without pruning by step time: it then finds fsdp2 compressed (1.15 s), which the pruned search
    never estimates (fsdp2's 1.3 s without levers is slower than dp checkpointed, 1.2 s, which fits). Its choice is
    the fastest fitting plan by brute force over every plan and lever variant. Where no lever speeds a step the
    search prunes, notes nothing and chooses dp checkpointed, as brute force does."""
    z = zoo.build("mlp")
    monkeypatch.setattr(budget_fit, "plan_estimator", lambda *a, **k: lambda p: _speeding_stand_in(p, speeds))
    budget = 1300
    result = fit_budget(z.model, z.example_input, budget, 2, labels=z.labels, hardware=HARDWARE)
    assert bool(result.notes) == speeds and all("faster" in n and "without pruning" in n for n in result.notes)
    step = find_time_step_module(z.model, z.example_input)
    candidates = [v for p in enumerate_plans(analyze(z.model), world_size=2, batch_size=8, features=FIT_FEATURES)
                  for v in [copy_without_levers(p)] + lever_variants(copy_without_levers(p), step, offload=True,
                                                                   chunk_every=(1, 2, 4, 8))]
    fitting = [(e.step_time_s, e.peak_bytes) for e in map(lambda v: _speeding_stand_in(v, speeds), candidates)
               if e.peak_bytes <= budget]
    assert (result.estimate.step_time_s, result.estimate.peak_bytes) == min(fitting)
    chosen = result.plan
    assert (chosen.mode, chosen.spike_compression, chosen.activation_checkpointing != "none") == (
        ("fsdp2", True, False) if speeds else ("dp", False, True))
