"""Collective counts and bytes per step of every mode on the zoo models, checked on real gloo ranks
against torch's own view, not against the estimator's recorder.

On each rank a step runs under a counter built on torch's ``CommDebugMode``: torch decides what is a
collective and counts it; the counter adds the bytes of the tensors handed to it, read off each op's
schema by argument name (the larger of what goes in and what comes out: the tensor of an all-reduce,
the output of an all-gather, the input of a reduce-scatter). DDP's buckets are also read from a comm
hook, which DDP hands each bucket. The estimate must match both, row for row.
 (The tests in one process: tests/unit/test_collective_bytes_unit.py.)"""
import copy
import functools

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_on_ranks
from torch.distributed.tensor.debug import CommDebugMode

import snn_explorer as se
from snn_explorer.compat import TorchDispatchMode, ddp_rebuilt_bucket_sizes
from snn_explorer.estimator import enumerate_plans, estimate
from snn_explorer.zoo import build

MODELS = ("mlp", "vgg", "spikformer")
KINDS = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
         "broadcast": "broadcast", "alltoall": "all_to_all"}


def _kind(packet) -> str:
    """'all_gather' for c10d::_allgather_base_, _c10d_functional::all_gather_into_tensor, ..."""
    name = str(packet).rsplit(".", 1)[-1].replace("_", "")
    return next(kind for prefix, kind in KINDS.items() if name.startswith(prefix))


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


class CollectiveCounter(CommDebugMode):
    """CommDebugMode's counts, plus per collective ``(group, kind, phase, bytes)``.

    CommDebugMode's module tracker fails on modules called more than once per forward (every
    per-step SNN), so it is not entered: the counting is CommDebugMode's ``__torch_dispatch__``,
    which files every collective under the tracker's (then constant) module name."""

    def __init__(self):
        super().__init__()
        self.phase, self.calls = "forward", []

    def __enter__(self):
        self.comm_counts.clear()
        tracker = self.advanced_module_tracker
        tracker.module_parents_dict.setdefault(tracker.name, [])
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *exc):
        return TorchDispatchMode.__exit__(self, *exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = sum(self.comm_counts.values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and sum(self.comm_counts.values()) > before:
            given = dict(zip((a.name for a in func._schema.arguments), args), **(kwargs or {}))
            self.calls.append((_group(given), _kind(func._overloadpacket), self.phase, _full_bytes(given, out)))
        return out


def _full_bytes(given, out) -> int:
    """The larger of the bytes sent (inputs) and received (outputs, or the result of a functional op)."""
    sent = sum(_bytes(v) for n, v in given.items() if n.startswith("input") or n == "tensors")
    outputs = [v for n, v in given.items() if n.startswith("output")]
    received = _bytes(outputs) if outputs else sent if "tensors" in given else _bytes(out)
    return max(sent, received)


def _group(given) -> str:
    """The name of the group a collective runs on: its ``group_name`` or boxed ``process_group``."""
    if "group_name" in given:
        return given["group_name"]
    return dist.ProcessGroup.unbox(given["process_group"]).group_name


def _plans(name, world):
    zoo = _zoo(name)
    analysis = se.analyze(zoo.model, model_family=zoo.family)
    n = zoo.example_input.shape[1]
    speed = enumerate_plans(analysis, world_size=world, batch_size=n, objective="speed")
    memory = enumerate_plans(analysis, world_size=world, batch_size=n, objective="memory")
    plans = [p for p in speed if (world == 2 and not p.uses_pp) or p.mode == "fsdp2_tp"]
    plans += [p for p in memory if p.mode in ("fsdp2", "fsdp2_tp") and (world == 2) == (p.mode == "fsdp2")]
    return plans


def _count_step(name, plan, dims):
    """Two warm-up steps (DDP rebuilds its buckets, optimizers create state), then one counted.
    ``dims``: group name -> mesh dim of every mesh made so far on this rank (DTensor may run a
    collective on the equal group of an earlier, equal mesh)."""
    from snn_explorer.estimator.profile.step import batch_slice, forward_loss

    zoo = build(name)
    runtime = se.apply(model=copy.deepcopy(zoo.model), plan=plan, device_type="cpu")
    n = plan.per_rank_batch
    x, y = batch_slice(zoo.example_input, zoo.labels, n, zoo.example_input.shape[0], start=runtime.dp_rank * n)
    hooked = []
    if plan.mode == "dp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(group, bucket):
            hooked.append(_bytes(bucket.buffer()))
            return allreduce_hook(group, bucket)
        runtime.model.register_comm_hook(runtime.mesh.get_group("dp"), hook)
    opt = runtime.build_optimizer(torch.optim.Adam, lr=1e-3)
    counter = CollectiveCounter()

    def step():
        opt.zero_grad(set_to_none=True)
        counter.phase = "forward"
        loss = forward_loss(runtime.model, x, y)
        counter.phase = "backward"
        loss.backward()
        counter.phase = "optimizer"
        opt.step()
    for _ in range(2):
        step()
    del hooked[:]
    with counter:
        step()
    dims.update((runtime.mesh.get_group(d).group_name, d) for d in plan.mesh_dim_names)
    rows = {}
    for group, kind, phase, nbytes in counter.calls:
        row = rows.setdefault((dims.get(group, f"group {group}"), kind, phase), [0, 0])
        row[0] += 1
        row[1] += nbytes
    counts = {}
    for packet, c in counter.comm_counts.items():
        if c:
            counts[_kind(packet)] = counts.get(_kind(packet), 0) + c
    rebuilt = ddp_rebuilt_bucket_sizes(runtime.model) if plan.mode == "dp" else []
    return dict(rows=sorted((*k, *v) for k, v in rows.items()), counts=counts, hooked=list(hooked), rebuilt=rebuilt)


def _on_rank(cases):
    dims = {}
    return [_count_step(name, plan, dims) for name, plan in cases]


_CASES, _RESULTS = {}, {}


def _cases(world):
    """(model name, plan): on 2 ranks every zoo model in dp, ZeRO, FSDP2 (both resharding levels)
    and TP; on 4 ranks the MLP in FSDP2 x TP (both levels)."""
    if world not in _CASES:
        _CASES[world] = [(m, p) for m in (MODELS if world == 2 else ("mlp",)) for p in _plans(m, world)]
    return _CASES[world]


def _measured(world):
    """Per case, the results of every rank: one spawned group per world size serves all cases."""
    if world not in _RESULTS:
        ranks = run_on_ranks(_on_rank, world, _cases(world), timeout=900)
        _RESULTS[world] = [[r[i] for r in ranks] for i in range(len(_cases(world)))]
    return _RESULTS[world]


@functools.lru_cache(maxsize=None)
def _zoo(name):
    """One model object per name in this process, so its estimates share one cached profile."""
    return build(name)


def _estimated_rows(name, plan):
    zoo = _zoo(name)
    table = estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels).collectives
    return sorted(tuple(r) for r in table[["mesh_dim", "kind", "phase", "count", "bytes"]].itertuples(index=False))


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("world", [2, 4])
def test_estimated_collectives_match_torchs_count_and_tensor_bytes(world):
    for (name, plan), ranks in zip(_cases(world), _measured(world)):
        first = ranks[0]
        assert first["rows"], f"{name} {plan}: no collective counted"
        assert all(r["rows"] == first["rows"] for r in ranks), (name, plan, [r["rows"] for r in ranks])
        assert _estimated_rows(name, plan) == first["rows"], f"{name} {plan}"
        per_kind = {}
        for _, kind, _, count, _ in first["rows"]:
            per_kind[kind] = per_kind.get(kind, 0) + count
        assert first["counts"] == per_kind, f"{name} {plan}: CommDebugMode counted {first['counts']}"


@pytest.mark.timeout(1200)
def test_ddp_buckets_are_the_ones_ddp_hands_its_comm_hook():
    dp = [(name, plan, ranks) for (name, plan), ranks in zip(_cases(2), _measured(2)) if plan.mode == "dp"]
    assert len(dp) == 2 * len(MODELS)
    for name, plan, ranks in dp:
        hooked = ranks[0]["hooked"]
        assert hooked and all(r["hooked"] == hooked for r in ranks), (name, plan)
        assert ranks[0]["rebuilt"] == hooked, (name, plan)  # DDP's logging data says the same
        est = [r for r in _estimated_rows(name, plan) if r[1] == "all_reduce"]
        assert est == [("dp", "all_reduce", "backward", len(hooked), sum(hooked))], (name, plan, hooked)
