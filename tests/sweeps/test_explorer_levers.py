"""The Explorer's memory objective keeps a lever only where its own estimate says it lowers the peak."""
from snn_explorer import PlanOptions
from snn_explorer.explorer import Explorer
from snn_explorer.zoo import build


def test_memory_objective_levers_by_the_explorers_estimate():
    zoo = build("spikformer")  # activation-dominated: a checkpointing lever lowers its peak
    ex = Explorer(zoo.model, example_input=zoo.example_input, labels=zoo.labels, model_family=zoo.family,
                  batch_size=zoo.example_input.shape[1])
    plain = ex.make_plan(objective="memory", topology={"dp": 2}, options=PlanOptions(activation_checkpointing="none"))
    levered = ex.make_plan(objective="memory", topology={"dp": 2}, features={"allow_activation_checkpointing": True})
    assert levered.activation_checkpointing != "none", levered.notes
    assert ex.estimate(levered).peak_bytes < ex.estimate(plain).peak_bytes
    assert any("peak" in note for note in levered.notes)  # the note says what the lever buys
