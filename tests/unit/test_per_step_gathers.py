"""FSDP2 on a per-step model: the all-gathers repeated at every time step are named in the estimate's
notes with their count and cost, and FSDP2's resharding choice shows in every label of a plan."""
import pytest

import snn_explorer as se
from snn_explorer.estimator import estimate
from snn_explorer.explorer.compare import compare_table
from snn_explorer.zoo import build


@pytest.fixture(scope="module")
def mlp():
    zoo = build("mlp")
    return zoo, se.analyze(zoo.model)


def _fsdp2(analysis, objective):
    return se.plan(analysis=analysis, objective=objective, topology={"dp": 4}, mode="fsdp2", batch_size=8)


@pytest.mark.parametrize("t", [5, 25])
def test_the_note_counts_the_gathers_each_time_step_adds(mlp, t):
    zoo, analysis = mlp
    x = zoo.example_input[:1].expand(t, *zoo.example_input.shape[1:]).contiguous()
    kept, resharded = (estimate(zoo.model, _fsdp2(analysis, o), example_input=x, labels=zoo.labels)
                       for o in ("speed", "memory"))
    assert not kept.plan.reshard_after_forward and resharded.plan.reshard_after_forward
    # the MLP's 3 Linear units: kept, one forward gather each, then a backward gather per later call of the
    # 2 units whose input needs a gradient; resharded, a gather per call of each unit in the forward, and in the
    # backward per call of those 2 (the first unit's backward runs once: no hook per call without an input gradient)
    assert f"a step runs {3 + 2 * (t - 1)} all-gathers where one call per unit would run 3" in kept.notes[0]
    assert f"a step runs {3 * t + 2 * t + 1} all-gathers where one call per unit would run 6" in resharded.notes[0]
    for est in (kept, resharded):
        gathers = est.collectives.query("kind == 'all_gather'")
        assert f"T={t}" in est.notes[0] and " ms of collective time" in est.notes[0]
        assert int(gathers["count"].sum()) == int(est.notes[0].split("a step runs ")[1].split()[0])
    assert "memopt_level=0" in resharded.notes[0]
    table = compare_table([kept, resharded])
    assert all(est.notes[0] in table.loc["notes", c] for est, c in zip((kept, resharded), table.columns))


def test_a_model_that_calls_each_unit_once_has_no_such_note(mlp):
    zoo = build("mlp_all_steps")
    plan = _fsdp2(se.analyze(zoo.model), "speed")
    est = estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels)
    assert plan.uses_fsdp and est.notes == ()


def test_resharding_shows_in_the_label_fit_and_compare_share(mlp):
    _, analysis = mlp
    kept, resharded = _fsdp2(analysis, "speed"), _fsdp2(analysis, "memory")
    assert kept.label == "fsdp2 dp=4" and resharded.label == "fsdp2+reshard dp=4"
    assert "fsdp2+reshard on dp4" in repr(resharded)
    from snn_explorer.estimator.budget_fit import _name
    from snn_explorer.explorer.compare import plan_label
    assert [_name(p) for p in (kept, resharded)] == [plan_label(p) for p in (kept, resharded)]
