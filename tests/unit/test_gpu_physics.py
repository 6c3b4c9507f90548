"""One GPU execution model for every GPU profile: its rates obey the hardware's physics on one step,
fused ``torch.jit.script`` chains are one kernel, collectives put the bytes on the wire that NCCL's
algorithms do, and groups without peer-to-peer share the host path."""
import dataclasses

import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.estimator.memory.gpu_trace import gpu_peaks, trace_step
from snn_explorer.estimator.timing.wire_bytes import BACKENDS, algorithm, wire_factor
from snn_explorer.ranks import COMM_BACKENDS

sj = pytest.importorskip("spikingjelly.activation_based")  # installed by scripts/setup.sh
from spikingjelly.activation_based import layer, neuron, surrogate  # noqa: E402

GATE = se.DistributedFeatureSet(allow_mixed_precision=True)
T, N, C, HW = 4, 16, 64, 32


def conv_snn() -> nn.Module:
    lif = lambda: neuron.LIFNode(tau=2.0, detach_reset=True, surrogate_function=surrogate.ATan(), step_mode="m")  # noqa
    return nn.Sequential(layer.Conv2d(3, C, 3, padding=1, step_mode="m"), layer.BatchNorm2d(C, step_mode="m"), lif(),
                         layer.Conv2d(C, C, 3, padding=1, step_mode="m"), layer.BatchNorm2d(C, step_mode="m"), lif(),
                         layer.Flatten(step_mode="m"), layer.Linear(C * HW * HW, 10, step_mode="m"))


def step_ms(precision: str, hardwares) -> dict:
    """The conv SNN's estimated step time in ms on each of ``hardwares``: one model and input for all, so that
    they compare one step (its trace is taken once and timed on each profile)."""
    model = conv_snn()
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 1}, batch_size=N, mode="none",
                   features=GATE, options=se.PlanOptions(precision=precision))
    x = torch.rand(T, N, 3, HW, HW)
    return {hw: se.estimate(model, plan, example_input=x, hardware=hw).step_time_s * 1e3 for hw in hardwares}


def test_every_gpu_profile_obeys_physics_on_the_same_step():
    """The same conv SNN step: an H100 beats an A100, which beats an RTX 4090 (more bandwidth, more tensor
    FLOP/s, in that order on their datasheets), and bf16 beats fp32 on each (2-byte tensor-core rate)."""
    gpus = ("H100-SXM", "A100-SXM-80GB", "RTX-4090")
    times = {(hw, p): ms for p in ("fp32", "bf16") for hw, ms in step_ms(p, gpus).items()}
    for p in ("fp32", "bf16"):
        assert times[("H100-SXM", p)] < times[("A100-SXM-80GB", p)] < times[("RTX-4090", p)], times
    for hw in gpus:
        assert times[(hw, "bf16")] < times[(hw, "fp32")], times


@torch.jit.script
def _charge(v: torch.Tensor, x: torch.Tensor, decay: float) -> torch.Tensor:
    return v + (x - v) * decay + x * 0.5


def _charge_eager(v, x, decay: float):
    return v + (x - v) * decay + x * 0.5


class Stepper(nn.Module):
    """A neuron that steps in a Python loop through a charge function (scripted or not)."""

    def __init__(self, charge):
        super().__init__()
        self.charge = charge

    def forward(self, x):
        v, out = torch.zeros_like(x[0]), []
        for t in range(x.shape[0]):
            v = type(self).step(self.charge, v, x[t])
            out.append(v)
        return torch.stack(out)

    @staticmethod
    def step(charge, v, x):
        return charge(v, x, 0.5)


class ScriptedStepper(Stepper):
    """The same neuron with its charge a module-level script function, as snnTorch-style models call it."""

    def __init__(self):
        super().__init__(None)

    @staticmethod
    def step(charge, v, x):
        return _charge(v, x, 0.5)


def test_a_fused_jit_chain_is_counted_as_one_kernel():
    """Eager, the charge is 5 elementwise kernels per step (sub, mul, add, mul, add); scripted, the GPU's
    fuser runs it as one, reading v and x and writing v once (3 x 4 B per element)."""
    x = torch.empty(3, 2, 8, device="meta")
    eager = trace_step(nn.Sequential(nn.Linear(8, 8), Stepper(_charge_eager)), x, None)
    fused = trace_step(nn.Sequential(nn.Linear(8, 8), ScriptedStepper()), x, None)
    forward = lambda s: [k for k in s.kernels if k.phase == "forward" and k.kind == "memory"]  # noqa: E731
    step_bytes = 3 * 2 * 8 * 4
    assert len(forward(eager)) - len(forward(fused)) == 3 * (5 - 1)  # non-trivial: 4 fewer launches per step
    assert [k.bytes for k in forward(fused)].count(step_bytes) == 3 and all(k.launches == 1 for k in forward(fused))
    assert _charge.__class__ is torch.jit.ScriptFunction and ScriptedStepper.step.__name__ == "step"  # restored


def test_wire_bytes_per_algorithm():
    """Bytes one rank sends per byte of the buffer (nccl-tests' algorithm-to-bus factors, worked by hand)."""
    assert wire_factor("all_reduce", 4, "ring") == pytest.approx(2 * 3 / 4)  # reduce-scatter then all-gather
    assert wire_factor("all_gather", 8, "ring") == pytest.approx(7 / 8)
    assert wire_factor("reduce_scatter", 2, "ring") == pytest.approx(1 / 2)
    assert wire_factor("reduce_scatter", 4, "ring all-reduce") == pytest.approx(2 * 3 / 4)  # gloo's
    assert wire_factor("broadcast", 4, "binomial tree") == pytest.approx(3 / 4)
    assert wire_factor("send", 2, "point-to-point") == 1.0 and wire_factor("all_gather", 1, "ring") == 0.0
    assert algorithm("all_reduce", "nccl", spans_nodes=True) == "tree"
    assert set(BACKENDS) == set(COMM_BACKENDS) - {"auto"}
    with pytest.raises(ValueError, match="'mpi'"):
        algorithm("all_reduce", "mpi")


def test_groups_without_peer_to_peer_share_the_host_path():
    """fsdp2_tp on a (2, 2) mesh: both TP pairs exchange at once; through host memory (no P2P) each gets
    half the path, so its exposed TP time doubles but for the latency; with P2P it stays."""
    rtx = se.hardware_profile("RTX-4090-PCIe-noP2P")
    one, two = (rtx.collective_time("all_reduce", 2, 1e8, 1, concurrent=c) for c in (1, 2))
    alpha = rtx.collectives["all_reduce"][2][0]
    assert two - alpha == pytest.approx(2 * (one - alpha))
    p2p = dataclasses.replace(rtx, peer_to_peer=True)
    assert p2p.collective_time("all_reduce", 2, 1e8, 1, concurrent=2) == pytest.approx(one)


def test_the_trace_counts_what_torch_memtracker_counts_on_the_same_step():
    """The meta trace's peak (parameters, input, neuron state, what the forward keeps, the backward's) against torch's own
    MemTracker on the same fused-neuron meta step: equal up to the allocator's 512-byte rounding and MemTracker's
    temporaries, so a gap to a published peak lies in what the step keeps, not in the counting."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from snn_explorer.estimator.memory.fused_neurons import swap_fused
    x = torch.empty(T, N, 3, HW, HW, device="meta")
    traced = trace_step(conv_snn(), x, None)
    model = conv_snn().to("meta")
    swap_fused(model, "torch", lambda *a: None)
    with torch.no_grad():
        model(x)  # the state of the last step, as the trace starts with
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(x).square().mean().backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("meta")]["Total"]
    forward, backward, _, _ = gpu_peaks(traced)
    ours = traced.entry + max(forward, backward + traced.grads)
    assert traced.saved > 10 * 2 ** 20  # non-trivial: tens of MiB kept
    assert abs(ours - peak) <= 0.02 * peak, (ours, peak)


def test_profile_files_round_trip_and_older_files_load(tmp_path):
    """Every built-in saves and loads to an equal profile (achieved fractions and SM count included); a file
    written before those fields existed (no ``achieved`` / ``sm_count``, ``kernel_model`` false) still loads, as a
    GPU profile of the kernel model at its datasheet rates times its own efficiency."""
    import json
    for name, profile in se.hardware_profiles().items():
        path = tmp_path / "p.json"
        profile.save(path)
        assert se.HardwareProfile.load(path) == profile, name
    old = json.loads(path.read_text())
    for key in ("achieved", "sm_count"):
        old.pop(key)
    old.update(kernel_model=False, efficiency=0.5)
    path.write_text(json.dumps(old))
    loaded = se.HardwareProfile.load(path)
    assert loaded.kernel_model and loaded.bandwidth() == pytest.approx(old["bytes_per_s"] * 0.5)
    with pytest.raises(ValueError, match="achieved"):
        dataclasses.replace(loaded, achieved={"bandwidth": 0.0})


def test_fsdp2_copy_kernels_are_on_the_clocks_where_torch_runs_them():
    """One unit (gathered 1000 B, unsharded 1000 B, dp 2), one 1 s kernel each way, resharded after forward;
    all-gather 0.5 s, reduce-scatter 0.25 s, a copy 1 ms per byte moved. By hand: the all-gather's copy-in
    (2 * 1000 / 2 B) and the collective on the communicator, then the copy-out (1000 B read + 1000 B written)
    on the compute stream, before the forward and again before the backward; after the backward the
    reduce-scatter's chunk-cat (2 * 1000 B) and the collective: communicator ends at 11.25 s, compute at 9 s,
    so 11.25 - 2 s of kernels = 9.25 s exposed; without the copies 1.25 s."""
    from snn_explorer.estimator.instruments.fsdp_events import EventLog
    from snn_explorer.estimator.memory.fsdp_timeline import Unit
    from snn_explorer.estimator.timing.fsdp_overlap import fsdp_exposed_s
    log = EventLog(("a",), {})
    for kind, path, at in (("pre_forward", "a", 0), ("forward_end", "", 1), ("pre_backward", "a", 1),
                           ("post_backward", "a", 2)):
        log.events.append((kind, path, 0, 0))
        log.kernel_at.append(at)
    unit = Unit("a", unsharded=1000, flat=1000, shard=500)
    collective = lambda kind, nbytes: 0.5 if kind == "all_gather" else 0.25  # noqa: E731
    assert fsdp_exposed_s(log, [1.0, 1.0], [unit], True, collective, 2, lambda b: b * 1e-3) == pytest.approx(9.25)
    assert fsdp_exposed_s(log, [1.0, 1.0], [unit], True, collective) == pytest.approx(1.25)
