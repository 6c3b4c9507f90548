"""The memory chart defines its words and clips nothing: 'transient' and the peak marker say what they are
(the stack adds parts never all alive at once, so it may reach above the peak), the y range holds every bar."""
import snn_explorer as se
from snn_explorer.estimator import estimate
from snn_explorer.explorer.charts import memory_chart
from snn_explorer.zoo import build


def test_the_legend_defines_transient_and_the_peak_and_no_bar_is_clipped():
    zoo = build("mlp")
    analysis = se.analyze(zoo.model)
    plans = [se.plan(analysis=analysis, objective=o, topology={"dp": 2}, batch_size=8, mode=m)
             for o, m in (("speed", "dp"), ("memory", "fsdp2"))]
    ests = [estimate(zoo.model, p, example_input=zoo.example_input, labels=zoo.labels) for p in plans]
    ax = memory_chart(ests).axes[0]
    words = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(w.startswith("transient (") and "one phase only" in w for w in words)
    assert any(w.startswith("peak: ") and "above the peak" in w for w in words)
    tops = [bar.get_y() + bar.get_height() for bar in ax.patches]
    peaks = [y for coll in ax.collections for _, y in coll.get_offsets()]
    assert ax.get_ylim()[1] > max(tops + peaks)
