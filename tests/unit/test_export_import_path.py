"""An exported job carries the import path of the user's own model module: command.sh runs under
torchrun (2 gloo ranks) where ``import mymodels`` alone fails.
(The tests on gloo ranks: tests/ranks/test_export_import_path_ranks.py.)"""
from __future__ import annotations

import os
import sys
import textwrap

import cloudpickle
import pytest
from torch import nn

from snn_explorer.launcher.export import import_roots, pickled_modules

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MYMODELS = textwrap.dedent('''
    """A user's model module, importable only from its own folder."""
    from snn_explorer.zoo import SpikingMLP


    class MyNet(SpikingMLP):
        pass
''')


def step(runtime, step, batch, state, inputs, labels):
    share = runtime.plan.per_rank_batch
    x, y = inputs[:, runtime.dp_rank * share:(runtime.dp_rank + 1) * share], \
        labels[runtime.dp_rank * share:(runtime.dp_rank + 1) * share]
    loss, _ = runtime.forward_loss(nn.CrossEntropyLoss(), x, y)
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    return loss


@pytest.fixture()
def mymodels(tmp_path, monkeypatch):
    folder = tmp_path / "notebook_folder"
    folder.mkdir()
    (folder / "mymodels.py").write_text(MYMODELS)
    monkeypatch.syspath_prepend(str(folder))
    import mymodels

    yield mymodels, str(folder)
    sys.modules.pop("mymodels", None)


def test_the_payload_names_the_module_and_its_folder_is_found(mymodels):
    module, folder = mymodels
    data = cloudpickle.dumps({"model": module.MyNet(in_features=8, hidden=(16,), num_classes=4), "fn": step})
    assert "mymodels" in pickled_modules(data)
    roots = import_roots(pickled_modules(data))
    assert roots["mymodels"] == os.path.realpath(folder)
    assert "torch" not in roots and "json" not in roots  # site-packages and the standard library stay out
