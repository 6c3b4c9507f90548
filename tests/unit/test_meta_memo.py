"""The meta-operator memo of the GPU trace: remembered outputs are laid out as the operator lays them out, and
what cannot be remembered (views, in-place operators, outputs an empty tensor would not reproduce) runs as is."""
import torch

from snn_explorer.estimator.memory.meta_memo import MetaOutputs

aten = torch.ops.aten


def _layout(t):
    return tuple(t.shape), t.stride(), t.dtype, t.storage_offset(), t.untyped_storage().nbytes()


def _twice(memo, func, *args, **kwargs):
    key = memo.key(func, args, kwargs)
    first = memo.run(func, args, kwargs)
    return key, first, memo.run(func, args, kwargs)


def test_a_second_call_makes_outputs_laid_out_as_the_operator_lays_them_out():
    memo = MetaOutputs()
    x = torch.empty(2, 3, 8, 8, device="meta").to(memory_format=torch.channels_last)
    w = torch.empty(4, 3, 3, 3, device="meta")
    calls = [
        (aten.convolution.default, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
        (aten.mul.Tensor, (x, 2.0)),
        (aten.max_pool2d_with_indices.default, (x, [2, 2], [2, 2])),
        (aten._to_copy.default, (x,), {"dtype": torch.bfloat16}),
    ]
    for func, args, *kw in calls:
        kwargs = kw[0] if kw else {}
        key, first, second = _twice(memo, func, *args, **kwargs)
        assert key is not None
        firsts, seconds = (first, second) if isinstance(first, tuple) else ((first,), (second,))
        assert [_layout(t) for t in seconds] == [_layout(t) for t in firsts]
        assert all(a.untyped_storage() is not b.untyped_storage() for a, b in zip(firsts, seconds))
    assert memo.hits == len(calls)
    assert _layout(firsts[0])[1] != torch.empty(2, 3, 8, 8).stride()  # non-trivial: channels-last strides kept


def test_the_key_tells_apart_values_of_other_types_and_dtypes():
    memo = MetaOutputs()
    x = torch.empty(3, device="meta")
    keys = {memo.key(aten.mul.Tensor, (x, v), {}) for v in (1, 1.0, True)}
    keys.add(memo.key(aten.mul.Tensor, (x.to(torch.float16), 1), {}))
    keys.add(memo.key(aten.mul.Tensor, (x[1:], 1), {}))  # another offset
    assert None not in keys and len(keys) == 5


def test_views_in_place_operators_and_unknown_arguments_are_not_remembered():
    memo = MetaOutputs()
    x = torch.empty(4, 4, device="meta")
    assert memo.key(aten.view.default, (x, [16]), {}) is None
    assert memo.key(aten.add_.Tensor, (x, x), {}) is None
    assert memo.key(aten.mul.Tensor, (x, object()), {}) is None
    assert memo.key(aten.mul.Tensor, (torch.empty(4), 2.0), {}) is None  # not on the meta device
    out = memo.run(aten.add_.Tensor, (x, x), {})
    assert out is x and memo.hits == 0


def test_an_output_an_empty_tensor_would_not_reproduce_runs_every_time(monkeypatch):
    memo = MetaOutputs()
    x = torch.empty(4, 4, device="meta")
    _twice(memo, aten.clone.default, x)
    assert memo.hits == 1
    # an operator whose output is a view into a larger new buffer: the memo keeps None and runs it again
    wide = MetaOutputs()
    monkeypatch.setattr(wide, "key", lambda *call: ("wide",))  # a call the memo would remember
    view_of_new = lambda: torch.empty(8, 4, device="meta")[4:]  # noqa: E731
    for _ in range(2):
        out = wide.run(view_of_new, (), {})
        assert out.storage_offset() == 16
    assert wide.hits == 0
