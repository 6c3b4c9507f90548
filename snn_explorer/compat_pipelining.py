"""The private torch names of pipeline parallelism (``torch.distributed.pipelining``): a stage's
receive buffers and their labels, the time a schedule waits in its sends and receives, and the order
of actions a schedule class runs (read from a stand-in, nothing runs). Checked where first used,
with :mod:`.compat`'s errors naming the name and the torch version."""
from __future__ import annotations

import contextlib
import importlib
import time
from typing import Any

import torch

from .compat import _check, _require


def pipeline_recv_buffers(stage: Any) -> list:
    """The receive buffers a ``torch.distributed.pipelining`` stage keeps between steps: one per
    micro-batch and received activation (``args_recv_info``) and output gradient (``grad_recv_info``)."""
    out = []
    for infos in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
        _check("PipelineStage recv info", isinstance(infos, dict), "args_recv_info / grad_recv_info are no dicts")
        out += [i.buffer for chunk in infos.values() for i in chunk
                if not getattr(i, "is_root_arg", False) and isinstance(getattr(i, "buffer", None), torch.Tensor)]
    return out


def label_pipeline_p2p(stage: Any, labels: dict) -> None:
    """Wrap ``stage``'s ``get_{fwd,bwd}_{send,recv}_ops`` (which torch's schedules call for every
    micro-batch) so that ``labels[data_ptr]`` names the stage boundary of each op's tensor."""
    s = stage.stage_index
    phases = {"get_fwd_send_ops": f"forward {s}->{s + 1}", "get_fwd_recv_ops": f"forward {s - 1}->{s}",
              "get_bwd_send_ops": f"backward {s}->{s - 1}", "get_bwd_recv_ops": f"backward {s + 1}->{s}"}
    for name, phase in phases.items():
        original = getattr(stage, name, None)
        _check(f"PipelineStage.{name}", callable(original), "the schedules' p2p op builder is missing")

        def labelled(chunk, _original=original, _phase=phase):
            ops = _original(chunk)
            for op in ops:
                labels[op.tensor.data_ptr()] = _phase
            return ops
        setattr(stage, name, labelled)


@contextlib.contextmanager
def pipeline_waits():
    """Seconds torch's pipeline schedules spend waiting for their sends and receives while the body
    runs (every wait goes through ``schedules._wait_batch_p2p``), in the list yielded (one float)."""
    schedules = importlib.import_module("torch.distributed.pipelining.schedules")
    original = _require("torch.distributed.pipelining.schedules", "_wait_batch_p2p")
    waited = [0.0]

    def timed(work):
        start = time.perf_counter()
        try:
            return original(work)
        finally:
            waited[0] += time.perf_counter() - start
    schedules._wait_batch_p2p = timed
    try:
        yield waited
    finally:
        schedules._wait_batch_p2p = original


def pipelining():
    """``torch.distributed.pipelining``, imported on first use: importing it loads torch's compiler,
    which sets TORCHINDUCTOR_CACHE_DIR and makes a folder under TMPDIR, and only pp plans need it."""
    return importlib.import_module("torch.distributed.pipelining")


def pipeline_compute_order(cls: type, pp: int, micro: int, rank_stages) -> dict:
    """``{rank: [(kind, stage, micro-batch), ...]}``: the forwards (F), backwards (B) and, for
    zero-bubble schedules, input (I) and weight (W) backwards each rank runs under torch's schedule
    class ``cls`` (``rank_stages(rank)``: the stages a rank holds), in its order."""
    stages = sum(len(rank_stages(r)) for r in range(pp))
    if issubclass(cls, pipelining().schedules.PipelineScheduleMulti):
        return _multi_stage_order(cls, pp, micro, [_OrderStage(s, stages, pp, 0, []) for s in rank_stages(0)])
    return {r: _single_stage_order(cls, micro, _OrderStage(r, stages, pp, r, [])) for r in range(pp)}


def _multi_stage_order(cls: type, pp: int, micro: int, stubs: list) -> dict:
    """A multi-stage schedule built on stand-ins reports every rank's ``pipeline_order``: the program
    its runtime executes (with sends and receives added)."""
    order = cls(stubs, n_microbatches=micro).pipeline_order
    _check(f"{cls.__name__}.pipeline_order", isinstance(order, dict) and len(order) == pp,
           "it is no longer a mapping of every rank to its actions")
    return {r: [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in acts
                if a is not None and a.computation_type.value in _COMPUTE] for r, acts in order.items()}


def _single_stage_order(cls: type, micro: int, stub: _OrderStage) -> list:
    """A single-stage schedule's ``pipeline_order`` is only a sketch (1F1B's names micro-batches it
    never runs): its private ``_step_microbatches`` runs on a recording stand-in instead."""
    schedule = cls(stub, n_microbatches=micro)
    step = getattr(schedule, "_step_microbatches", None)
    _check(f"{cls.__name__}._step_microbatches", callable(step), "the single-stage step is missing")
    schedule._initialize_stage = lambda *args, **kwargs: None  # no shapes to exchange: nothing runs
    step()
    return stub.done


class _OrderStage:
    """A stand-in for a ``PipelineStage`` that torch's schedules can be built on without a process
    group: it holds the facts a schedule reads (stage index, stage count, group size and rank) and
    records the compute its single-stage step runs."""

    def __init__(self, index: int, stages: int, pp: int, rank: int, done: list):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, pp, rank
        self.is_first, self.is_last, self.submod, self.done = index == 0, index == stages - 1, None, done
        self.stage_index_to_group_rank: dict = {}

    def forward_one_chunk(self, chunk, *args, **kwargs):
        self.done.append(("F", self.stage_index, chunk))

    def backward_one_chunk(self, chunk, *args, **kwargs):
        self.done.append(("B", self.stage_index, chunk))

    def __getattr__(self, name):  # p2p op builders (none: no peers), per-step bookkeeping
        if name.startswith(("get_fwd_", "get_bwd_")):
            return lambda chunk: []
        if name in ("clear_runtime_states", "perform_reduce_grad"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


#: torch's compute action kinds (``_ComputationType`` values) the timeline shows.
_COMPUTE = frozenset("FBIW")
