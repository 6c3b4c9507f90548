"""Pipeline parallelism (mode 'pp') on real gloo ranks equals one process, for every schedule.

One rank group per world size (2: pp=2; 4: pp=2 x dp=2) runs every schedule on every model for 3
Adam steps in float64 and returns everything; the tests below read those results from
module-scoped fixtures. The 2-rank group also runs 20 back-to-back pipelines (a hang would time
out the group). Each comparison first shows that it is not vacuous: spike rates 2-98 %, outputs
that vary, a loss that changes.
 (The tests on gloo ranks: tests/ranks/test_pipeline.py.)"""
import pytest
import torch
from torch import nn


def test_zero_bubble_stages_hand_on_no_view():
    """A Linear over [T, N, F] returns a view, which torch's zero-bubble input backward cannot detach
    in place; a stage under a zero-bubble schedule hands on a copy instead, with the same values."""
    from snn_explorer.compat import is_view
    from snn_explorer.core.parallelize.pipeline import PipelineStageModule

    x = torch.rand(3, 4, 5, requires_grad=True)
    plain, owning = (PipelineStageModule(0, ["fc"], [nn.Linear(5, 2)], own_output=own) for own in (False, True))
    owning.load_state_dict(plain.state_dict())
    seen, handed = plain(x), owning(x)
    assert is_view(seen) and not is_view(handed) and torch.equal(seen, handed)
    with pytest.raises(RuntimeError, match="Can't detach views in-place"):
        seen.detach_()
    handed.detach_()
