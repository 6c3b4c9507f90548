"""The first estimate's fast paths (the profile's model copy, the calibration's timed step) equal the slow ones."""
import copy
import time
import types

import torch
from models import wide_jelly
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from snn_explorer.core.model import deep_copy_module, detached_copy, reset_all, tensors_with_history
from snn_explorer.estimator.profile.profiling import measure_profile
from snn_explorer.estimator.profile.repeats import find_repeats
from snn_explorer.estimator.profile.step import batch_slice, forward_loss
from snn_explorer.estimator.timing import compute_work
from snn_explorer.zoo import SpikingMLP, build

_CODE = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)


_ATOMIC = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device)


def _paired(pairs: dict, kind: str, a_key, b_key, path: str) -> bool:
    """Records that ``a_key`` (of one copy) goes with ``b_key`` (of the other), one to one both ways, and says
    whether the pair was seen before; a key paired with another before fails the test."""
    seen = ("a", kind, a_key) in pairs
    assert pairs.setdefault(("a", kind, a_key), b_key) == b_key, f"{path}: {kind} shared differently"
    assert pairs.setdefault(("b", kind, b_key), a_key) == a_key, f"{path}: {kind} shared differently"
    return seen


def _same(a, b, pairs: dict, path: str = "model") -> None:
    """``a`` (one copy) and ``b`` (another) hold equal values, types and attributes, and share objects and tensor
    storages alike (``pairs`` maps each side's object ids and storage pointers to the other's, one to one)."""
    assert type(a) is type(b), path
    if not isinstance(a, _ATOMIC + _CODE) and _paired(pairs, "object", id(a), id(b), path):
        return  # compared already (modules refer to each other through bound methods)
    if isinstance(a, types.MethodType):
        assert a.__func__ is b.__func__, path
        _same(a.__self__, b.__self__, pairs, f"{path}.__self__")
        return
    if isinstance(a, torch.Tensor):
        assert (a.shape, a.dtype, a.stride(), a.storage_offset(), a.requires_grad) == \
            (b.shape, b.dtype, b.stride(), b.storage_offset(), b.requires_grad), path
        assert torch.equal(a, b), path
        _paired(pairs, "storage", a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr(), path)
        return
    if isinstance(a, (dict, list, tuple, set)):
        assert len(a) == len(b), path
        if isinstance(a, dict):
            assert list(a) == list(b), path
            for key in a:
                _same(a[key], b[key], pairs, f"{path}[{key!r}]")
        elif isinstance(a, set):
            assert a == b, path
        else:
            for i, (x, y) in enumerate(zip(a, b)):
                _same(x, y, pairs, f"{path}[{i}]")
        return
    if hasattr(a, "__dict__") and not isinstance(a, _CODE):
        _same(vars(a), vars(b), pairs, path)
        return
    assert a == b or a is b, path


def _pointers(model) -> set:
    """The storages of ``model``'s parameters and buffers (empty ones hold none)."""
    return {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())} - {0}


def _sharing_containers() -> nn.Sequential:
    """Two modules sharing a list that reaches back to it (through a module holding it) and an empty dict."""
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    first.cache = second.cache = {}
    first.others = [second]
    second.others = first.others
    return nn.Sequential(first, second)


class _Tied(nn.Module):
    """Tied weights, a view of a parameter kept as a buffer-like attribute, a hook and a set of names."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.register_buffer("table", torch.arange(12.0).reshape(3, 4))
        self.row = self.table[1]  # a view: shares the buffer's storage
        self.names = {"a", "b"}

    def forward(self, x):
        return self.b(self.a(x)) + self.row


def test_module_copy_equals_deepcopy():
    """deep_copy_module gives what copy.deepcopy gives (types, attributes, values, storages shared alike, nothing
    shared with the original) on snntorch, spikingjelly and transformer zoo models, tied weights, views and hooks."""
    torch.manual_seed(0)
    tied = _Tied()
    tied.a.register_forward_hook(lambda *args: None)
    models = [build(name).model for name in ("mlp", "mlp_all_steps", "spikformer")] + [wide_jelly()[0], tied,
                                                                                       _sharing_containers()]
    for model in models:
        fast, slow = deep_copy_module(model), copy.deepcopy(model)
        _same(fast, slow, {})
        assert not _pointers(model) & _pointers(fast)
    fast = deep_copy_module(_sharing_containers())
    assert fast[0].others is fast[1].others and fast[0].cache is fast[1].cache
    fast = deep_copy_module(tied)
    assert fast.b.weight is fast.a.weight and fast.row.untyped_storage().data_ptr() == fast.table.data_ptr()
    assert len(fast.a._forward_hooks) == 1


def test_detached_copy_after_a_forward_equals_deepcopy_of_the_detached_model():
    """The profile's private copy of a model a forward ran on (neuron state with autograd history) is the
    copy.deepcopy one, with the same fresh neuron state."""
    zoo = build("mlp")
    x, y = batch_slice(zoo.example_input, zoo.labels, 2, 3)
    forward_loss(zoo.model, x, y)
    fast = detached_copy(zoo.model)
    memo = {id(t): t.detach().clone() for t in tensors_with_history(zoo.model)}
    assert memo, "the forward left no state with history: nothing compared"
    slow = copy.deepcopy(zoo.model, memo)
    reset_all(slow)
    _same(fast, slow, {})


class _Ticks:
    """A clock that reads work done: one tick per module call and per gradient accumulated (hooks on the model),
    one per parameter an optimizer step updates; a block's time then is its work, exactly."""

    def __init__(self, model):
        self.now = 0.0
        for module in model.modules():
            module.register_forward_pre_hook(self._tick)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._tick)
        self.handle = register_optimizer_step_post_hook(self._step)

    def _tick(self, *args):
        self.now += 1.0

    def _step(self, optimizer, *args):
        self.now += sum(len(group["params"]) for group in optimizer.param_groups)

    def __call__(self):
        return self.now


def test_calibration_step_composed_from_cut_runs_equals_the_whole_step(monkeypatch):
    """The calibration's timed step of a model of repeated blocks, composed from the model cut to 2 and 5 repeats
    (TIME_CUTS, 64 in use), equals the whole step's times per phase where time is work (a clock of module calls,
    gradients and parameter updates), on a 12-block all-steps MLP; a model with fewer repeats times the whole step."""
    monkeypatch.setattr(compute_work, "TIME_CUTS", (2, 5))
    torch.manual_seed(0)
    profile = measure_profile(SpikingMLP(16, (16,) * 12, 8, stepping="all_steps"), torch.rand(3, 4, 16))
    model = profile.model
    x, y = batch_slice(profile.example_input, profile.labels, 4, 3)
    clock = _Ticks(model)
    try:
        whole = compute_work.timed_step(model, x, y, "adam", clock)
        composed = compute_work.composed_step(model, x, y, "adam", clock)
    finally:
        clock.handle.remove()
    assert find_repeats(model).count == 12 and all(v > 12 for v in whole.values())
    assert composed == whole
    for depth in (5, 6):  # too few blocks to be repeats; repeats, but no more than the longer cut (patched to 6)
        short = SpikingMLP(16, (16,) * depth, 8, stepping="all_steps")
        monkeypatch.setattr(compute_work, "TIME_CUTS", (2, 6))
        assert (find_repeats(short) is None) if depth == 5 else (find_repeats(short).count == 6)
        assert compute_work.composed_step(short, x, y, "adam", time.perf_counter) is None
