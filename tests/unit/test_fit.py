"""fit_budget(): the fastest plan whose estimated peak fits a budget; levers only where they lower the peak."""
import dataclasses
from types import SimpleNamespace

import pandas as pd
import pytest

from snn_explorer import (
    DistributedFeatureSet,
    analyze,
    find_time_step_module,
    fit_budget,
    plan,
    zoo,
)
from snn_explorer.cli import main
from snn_explorer.core.levers import (
    copy_without_levers,
    lever_variants,
)
from snn_explorer.estimator import FitOutcome, budget_fit, hardware_profile
from snn_explorer.estimator.budget_fit import FIT_FEATURES, _chunk_rows
from snn_explorer.estimator.enumerate import enumerate_plans

HARDWARE_NAME = "H100-SXM"  # a built-in datasheet profile: no calibration run
#: The fit's logic checked on the operator-count model (a CPU-device twin of that profile): every lever is
#: estimated there, where a GPU profile leaves host-memory levers out of its search
HARDWARE = dataclasses.replace(hardware_profile(HARDWARE_NAME), device="cpu", kernel_model=False)
FEATURES = DistributedFeatureSet(allow_activation_checkpointing=True)


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
