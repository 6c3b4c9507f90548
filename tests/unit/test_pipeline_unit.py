"""Pipeline parallelism (mode 'pp') in one process: a stage under a zero-bubble schedule hands on no
view. (Every schedule on real gloo ranks against one process: tests/ranks/test_pipeline.py.)"""
import pytest
import torch
from torch import nn


def test_zero_bubble_stages_hand_on_no_view():
    """A Linear over [T, N, F] returns a view, which torch's zero-bubble input backward cannot detach
    in place; a stage under a zero-bubble schedule hands on a copy instead, with the same values."""
    from snn_explorer.compat import is_view
    from snn_explorer.core.parallelize import PipelineStageModule

    x = torch.rand(3, 4, 5, requires_grad=True)
    plain, owning = (PipelineStageModule(0, ["fc"], [nn.Linear(5, 2)], own_output=own) for own in (False, True))
    owning.load_state_dict(plain.state_dict())
    seen, handed = plain(x), owning(x)
    assert is_view(seen) and not is_view(handed) and torch.equal(seen, handed)
    with pytest.raises(RuntimeError, match="Can't detach views in-place"):
        seen.detach_()
    handed.detach_()
