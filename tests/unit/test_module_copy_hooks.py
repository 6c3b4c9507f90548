"""``core.module_copy``'s walk honours copy hooks as ``copy.deepcopy`` does, when they change after an earlier copy
(on the class) or sit on one instance only, and remembers nothing that keeps a class alive."""
import copy
import gc
import weakref

from torch import nn

from snn_explorer.core.model import deep_copy_module


def _marked(self, memo):
    out = nn.Linear(1, 1)
    out.marked = True
    return out


def test_a_class_hook_added_after_a_copy_is_honoured():
    class Late(nn.Linear):
        pass

    model = nn.Sequential(Late(2, 2))
    assert not hasattr(deep_copy_module(model)[0], "marked")  # copied by the walk first
    Late.__deepcopy__ = _marked
    assert copy.deepcopy(model)[0].marked and deep_copy_module(model)[0].marked


def test_an_instance_hook_is_honoured():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].__deepcopy__ = _marked.__get__(model[1])
    want, got = copy.deepcopy(model), deep_copy_module(model)
    assert want[1].marked and not hasattr(want[0], "marked")
    assert got[1].marked and not hasattr(got[0], "marked")


def test_a_class_made_at_run_time_is_not_kept_alive():
    def make():
        class Temporary(nn.Linear):
            pass
        deep_copy_module(nn.Sequential(Temporary(2, 2)))
        return weakref.ref(Temporary)

    ref = make()
    gc.collect()
    assert ref() is None
