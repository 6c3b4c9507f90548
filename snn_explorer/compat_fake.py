"""The private torch names of fake execution: FakeTensor (shape-only profiling) and the fake process group
(one process playing one rank of any world size). Checked on first use like :mod:`.compat`.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

from .compat import _check, _require

# Shape-only profiling (estimator/profile/shape_only.py).
# Imported on first use: torch._subclasses.fake_tensor loads torch's compiler stack, which sets
# TORCHINDUCTOR_CACHE_DIR (tests/unit/test_layers.py checks that importing snn_explorer does not).

_FAKE = "torch._subclasses.fake_tensor"
#: What FakeTensorMode raises where an operator's result depends on tensor values: ``.item()`` /
#: ``bool(tensor)`` (data-dependent output), ``nonzero`` and friends (output shape from the data),
#: an operator without a meta kernel. Each carries the operator as ``.func``.
_DATA_DEPENDENT = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException")


@functools.lru_cache(maxsize=None)
def _fake_names() -> tuple:
    """``(FakeTensorMode, FakeTensor, the data-dependent exceptions)``, checked once, on first use."""
    mode = _require(_FAKE, "FakeTensorMode", params=("allow_non_fake_inputs",))
    names = (mode, _require(_FAKE, "FakeTensor"), tuple(_require(_FAKE, name) for name in _DATA_DEPENDENT))
    with mode() as probe:
        x = torch.empty(3, 4)
        y = (x @ x.T).sum()
    _check(f"{_FAKE}.FakeTensorMode", isinstance(y, names[1]) and x.untyped_storage().nbytes() == 48 and
           probe is not None, "tensors made under it are no longer FakeTensors with shapes and storage sizes")
    return names


def fake_tensor_mode():
    """A new torch ``FakeTensorMode`` (tensors with shapes, dtypes, devices and storage sizes but no data;
    each operator runs its meta kernel) that also takes real tensors, as fake ones."""
    return _fake_names()[0](allow_non_fake_inputs=True)


def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` is a FakeTensor (its storage has no data; ``data_ptr`` is 0 for all of them)."""
    return _FAKE in sys.modules and isinstance(tensor, _fake_names()[1])


def data_dependent_op(exc: BaseException) -> Optional[str]:
    """The operator a FakeTensor run could not follow without tensor values, where ``exc`` says so; else None."""
    if _FAKE not in sys.modules or not isinstance(exc, _fake_names()[2]):
        return None
    return str(getattr(exc, "func", None) or type(exc).__name__)


# A process group that communicates nothing: each collective returns at once with its tensors as
# they are (torch's own "fake" backend, registered by a module of its testing package). One process
# plays one rank of any world size; estimator/measurement/fake_ranks.py records its collectives.
_FAKE_PG = "torch.testing._internal.distributed.fake_pg"


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """The default process group of this process, for the body: rank ``rank`` of ``world_size`` on
    torch's fake backend (nothing is sent or received; collectives complete at once)."""
    store = _require(_FAKE_PG, "FakeStore")()  # importing the module registers the "fake" backend
    dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
