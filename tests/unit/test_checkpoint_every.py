"""``plan(checkpoint_every=...)``: None (the default) lets the objective size checkpointing by estimate; an explicit
value, 1 included, is kept; a bad value is refused, whether or not checkpointing is chosen by the objective."""
from types import SimpleNamespace

import pytest

import snn_explorer as se
from snn_explorer.zoo import build

GATES = se.DistributedFeatureSet(allow_activation_checkpointing=True)


def _stand_in(p):
    """Every lever lowers the peak, the more the larger k (up to one chunk of the 8 steps); larger k cost time."""
    if p.activation_checkpointing == "none":
        return SimpleNamespace(peak_bytes=1000, step_time_s=1.0)
    k = min(p.checkpoint_every, 8)
    return SimpleNamespace(peak_bytes=1000 - 50 * k, step_time_s=1.0 + 0.1 * k)


def _plan(time_step_module="net", objective="memory", peak_estimate=_stand_in, **kw):
    return se.plan(analysis=se.analyze(build("mlp").model), objective=objective, topology={"dp": 2},
                   batch_size=8, mode="dp", features=GATES, options=se.PlanOptions(time_step_module=time_step_module, peak_estimate=peak_estimate, **kw))


def test_an_explicit_k_of_1_is_kept_and_none_is_chosen_by_estimate():
    chosen = _plan()
    assert (chosen.activation_checkpointing, chosen.checkpoint_every) == ("time_chunks", 8)  # one chunk: lowest
    kept = _plan(checkpoint_every=1)
    assert kept.activation_checkpointing != "none" and kept.checkpoint_every == 1
    assert _plan(checkpoint_every=2).checkpoint_every == 2
    explicit = _plan(None, activation_checkpointing="blocks")  # no search: the default k is 1
    assert (explicit.activation_checkpointing, explicit.checkpoint_every) == ("blocks", 1)


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "2"])
@pytest.mark.parametrize("granularity", [None, "blocks"])
def test_a_bad_k_is_refused_by_name(bad, granularity):
    with pytest.raises(ValueError, match=rf"checkpoint_every={bad!r} must be an int >= 1"):
        _plan(None if granularity else "net", checkpoint_every=bad, activation_checkpointing=granularity)


def test_an_explicit_k_without_checkpointing_says_it_is_unused():
    """An explicit k that no checkpointing uses is said in the plan's notes, with why; the default says nothing."""
    unused = [n for n in _plan(checkpoint_every=3, objective="speed").notes if "checkpoint_every" in n]
    assert unused == ["checkpoint_every=3 unused: this plan checkpoints nothing (the speed objective takes no "
                      "memory lever)"]
    none_lower = _plan(checkpoint_every=3, peak_estimate=lambda p: SimpleNamespace(
        peak_bytes=1000 if p.activation_checkpointing == "none" else 2000, step_time_s=1.0))
    assert none_lower.activation_checkpointing == "none"
    assert any("unused" in n and "no checkpointing lowered the estimated peak" in n for n in none_lower.notes)
    assert not any("checkpoint_every" in n for n in _plan(objective="speed").notes)
