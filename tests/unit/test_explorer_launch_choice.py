"""The Launch tab offers the plan on screen: after pinning #1 and moving the controls to another plan, the
plan to launch is the one the controls show, not pinned plan #1."""
import os

os.environ.setdefault("MPLBACKEND", "Agg")

from snn_explorer.explorer import Explorer  # noqa: E402
from snn_explorer.zoo import build  # noqa: E402


def test_the_launch_choice_follows_the_plan_on_screen():
    ui = Explorer.from_zoo(build("mlp")).ui
    ui.world_size.value = 2
    first = ui.pin()
    assert ui.launcher.plan.value == first
    ui.mode.value = "fsdp2"  # another layout on screen, #1 still pinned
    assert ui.current != first and ui.launcher.plan.value == ui.current
    ui.launcher.plan.value = first  # the user's own choice stays while the screen does not move
    ui.launcher.sync()
    assert ui.launcher.plan.value == first
    ui.mode.value = "dp"  # back to #1's layout: the pinned plan of it is the one on screen
    assert ui.launcher.plan.value == first
