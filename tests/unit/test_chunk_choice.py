"""Time chunks sized by estimate (core/levers/chunk_choice.py): every power-of-two size up to one chunk is estimated;
the size measured on gloo ranks is the estimator's choice (test_memory_levers' time-chunk case);
without a budget the lowest peak wins (ties: the faster), with one the fastest that fits; the memory objective and
fit_budget take the size so chosen, and the plan's note states every size's peak and step time."""
from types import SimpleNamespace

import snn_explorer as se
from snn_explorer.core.levers import choose_chunks, copy_without_levers
from snn_explorer.zoo import build

GATES = se.DistributedFeatureSet(allow_activation_checkpointing=True)
T = 8


def _base():
    zoo = build("mlp")
    return copy_without_levers(se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 2},
                                       batch_size=8, mode="dp", features=GATES))


def _stand_in(p):
    """Peak falls with fewer state copies up to one chunk of the T steps, then stays; each size's replay costs
    time; k = 1 is above the plan's own peak (a copy per step)."""
    if p.activation_checkpointing == "none":
        return SimpleNamespace(peak_bytes=1000, step_time_s=1.0)
    k = min(p.checkpoint_every, T)
    return SimpleNamespace(peak_bytes=1100 if k == 1 else 1000 - 50 * k, step_time_s=1.0 + 0.1 * k)


def test_every_power_of_two_up_to_one_chunk_is_estimated_and_the_rule_picks():
    base = _base()
    lowest = choose_chunks(base, "net", _stand_in)
    assert [p.checkpoint_every for p, _ in lowest.tried] == [1, 2, 4, 8]  # 16 estimates as 8: one chunk
    assert lowest.plan.checkpoint_every == 8 and lowest.estimate.peak_bytes == 600
    fitting = choose_chunks(base, "net", _stand_in, budget=850)  # 4 (800 B) and 8 fit: 4 is faster
    assert fitting.plan.checkpoint_every == 4
    assert "fastest whose peak fits 850 B" in fitting.note(1000) and "1: 1100 B / 1100.000 ms" in fitting.note(1000)
    flat = lambda p: SimpleNamespace(peak_bytes=_stand_in(p).peak_bytes, step_time_s=1.0)  # noqa: E731
    assert choose_chunks(base, "net", flat, budget=850).plan.checkpoint_every == 4  # equal times: the smaller k
    over = choose_chunks(base, "net", _stand_in, budget=100)  # none fits: the lowest peak, for the row
    assert over.plan.checkpoint_every == 8 and "lowest estimated peak" in over.note(1000)
    none = choose_chunks(base, "net", lambda p: SimpleNamespace(peak_bytes=1000 + p.checkpoint_every, step_time_s=1.0))
    assert none.plan is None and "no size lowers the estimated peak of 1000 B" in none.note(1000)
    assert choose_chunks(base, None, _stand_in) is None  # no module stepped once per time step
    stated = choose_chunks(base, "net", lambda p: SimpleNamespace(time_steps=6, **vars(_stand_in(p))))
    assert [p.checkpoint_every for p, _ in stated.tried] == [1, 2, 4, 6]  # estimates that state T: up to one chunk


def test_the_memory_objective_takes_the_size_the_real_estimate_chooses():
    """zoo mlp (T = 8 steps through module 'net'), the H100 profile's estimate: the chosen size has the lowest
    estimated peak of all sizes tried (the fastest among equals), below the plan's own, and the note lists them."""
    zoo = build("mlp")
    assert zoo.example_input.shape[0] == T
    estimate_of = se.plan_estimator(zoo.model, zoo.example_input, zoo.labels, hardware="H100-SXM")
    choice = choose_chunks(_base(), "net", estimate_of)
    assert [p.checkpoint_every for p, _ in choice.tried] == [1, 2, 4, 8]  # the estimate states T = 8
    peaks = {p.checkpoint_every: e for p, e in choice.tried}
    low = min(e.peak_bytes for e in peaks.values())
    assert choice.estimate.peak_bytes == low < estimate_of(_base()).peak_bytes
    assert choice.estimate.step_time_s == min(e.step_time_s for e in peaks.values() if e.peak_bytes == low)
    plan = se.plan(analysis=se.analyze(zoo.model), objective="memory", topology={"dp": 2}, batch_size=8, mode="dp",
                   features=GATES, options=se.PlanOptions(time_step_module="net", peak_estimate=estimate_of))
    note = next(n for n in plan.notes if n.startswith("time chunks of"))
    assert f"time chunks of {choice.plan.checkpoint_every} steps chosen by estimate" in note
    # on this model time chunks have the lowest peak of all levers (blocks: above the plan's own, test_fit)
    assert (plan.activation_checkpointing, plan.checkpoint_every) == ("time_chunks", choice.plan.checkpoint_every)


def test_the_chunk_size_note_is_only_on_a_plan_that_chunks():
    """A stand-in estimate under which checkpointing every block has the lowest peak: the memory objective chooses
    blocks, and its notes say nothing of a time-chunk size it did not take."""
    blocky = lambda p: (SimpleNamespace(peak_bytes=100, step_time_s=2.0)  # noqa: E731
                        if p.activation_checkpointing == "blocks" else _stand_in(p))
    plan = se.plan(analysis=se.analyze(build("mlp").model), objective="memory", topology={"dp": 2}, batch_size=8,
                   mode="dp", features=GATES, options=se.PlanOptions(time_step_module="net", peak_estimate=blocky))
    assert plan.activation_checkpointing == "blocks"
    assert not any(n.startswith("time chunks") for n in plan.notes), plan.notes
