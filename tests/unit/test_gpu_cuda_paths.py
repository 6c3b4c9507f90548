"""What torch and the fused neuron ops run on CUDA beyond the operator the trace sees: cuDNN's convolution
leaving its bias to a kernel of its own, the triton neuron op's zero-filled gradient of its unused ``h`` output
and its kernels' autotuning at their first call, each against bytes computed by hand from the shapes."""
import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.estimator.memory.fused_neurons import TRITON_BENCH_CACHE_BYTES, FusedNeuron
from snn_explorer.estimator.memory.gpu_trace import DeviceMeter, trace_step

sj = pytest.importorskip("spikingjelly.activation_based")  # installed by scripts/setup.sh
from spikingjelly.activation_based import layer, neuron, surrogate  # noqa: E402

RTX = "RTX-4090-PCIe-noP2P"
T, N, C, HW, F = 3, 2, 4, 8, 8
MIB = 2 ** 20


def lif(backend=None) -> nn.Module:
    cell = neuron.LIFNode(tau=1.333, decay_input=False, detach_reset=True, surrogate_function=surrogate.ATan(),
                          step_mode="m")
    if backend is not None:  # the attribute a release with a ``backend`` argument keeps
        cell.backend = backend
    return cell


def conv_bn_lif(backend=None) -> nn.Module:
    return nn.Sequential(layer.Conv2d(2, C, 3, padding=1, step_mode="m"), layer.BatchNorm2d(C, step_mode="m"),
                         lif(backend))


def traced(fn, *tensors):
    """The kernels ``fn`` launches forward and backward under a fresh meter."""
    meter = DeviceMeter()
    with meter:
        loss = fn(*tensors).sum()
        meter.phase = "backward"
        loss.backward()
    return meter


def test_the_warm_up_forward_is_not_part_of_the_traced_step():
    """The trace runs one forward without gradients before the step (the neurons' state then exists); its
    launches are not the step's: one fused forward and one fused backward per neuron layer."""
    step = trace_step(conv_bn_lif(), torch.empty(T, N, 2, HW, HW, device="meta"), None)
    assert [(k.phase, k.launches) for k in step.kernels if k.kind == "neuron"] == [("forward", 1), ("backward", 1)]


def test_a_convolution_bias_is_a_kernel_of_its_own():
    """cuDNN convolves without the bias, torch adds it after (reads and writes the output, reads the bias); the
    backward sums the output's gradient into the bias's in a reduction of its own. Without a bias: no such kernel."""
    x = torch.empty(N, 2, HW, HW, device="meta", requires_grad=True)
    conv = nn.Conv2d(2, C, 3, padding=1).to("meta")
    kernels = traced(conv, x).kernels
    inp, weight, bias, out = N * 2 * HW * HW * 4, C * 2 * 9 * 4, C * 4, N * C * HW * HW * 4
    convs = [k for k in kernels if k.kind == "conv"]
    assert [(k.phase, k.bytes, k.launches) for k in convs] == [
        ("forward", inp + weight + out, 1),
        ("backward", out + inp + weight + inp + weight, 2)]  # grad out, x, w read; grad x, grad w written
    forward_bias = [k for k in kernels if k.phase == "forward" and k.kind == "memory"]
    assert [(k.bytes, k.launches) for k in forward_bias] == [(2 * out + bias, 1), (out + 4, 1)]  # then the loss's sum
    assert any(k.phase == "backward" and k.kind == "memory" and k.bytes == out + bias for k in kernels)
    plain = traced(nn.Conv2d(2, C, 3, padding=1, bias=False).to("meta"), x).kernels
    assert [(k.kind, k.bytes) for k in plain if k.phase == "forward"] == [("conv", inp + weight + out),
                                                                          ("memory", out + 4)]  # the loss's sum
    assert [k.launches for k in plain if k.kind == "conv"] == [1, 2]


def test_the_triton_op_fills_its_unused_h_gradient_with_zeros():
    """The triton op returns h and lets autograd materialise its unused gradient: one [T, ...] zero fill (a memory
    kernel writing T * N * F floats) in its backward; 2.0.0's op (``set_materialize_grads(False)``) has none."""
    seq = T * N * F * 4
    for op, fills in (("triton", [seq]), ("sj_lif", [])):
        meter = DeviceMeter()
        x = torch.empty(T, N, F, device="meta", requires_grad=True)
        with meter:
            loss = FusedNeuron(meter.fused, op)(x).sum()
            meter.phase = "backward"
            first = len(meter.kernels)
            loss.backward()
        written = [k.bytes for k in meter.kernels[first:] if k.kind == "memory" and k.bytes == seq]
        assert written == fills, op


def test_the_triton_op_autotunes_once_per_key_holding_the_flush_buffer_and_clones():
    """At its first call the forward kernel is tuned: live then, by hand (512-byte blocks: every tensor here is
    smaller): x, v_init, the spikes, h, the last potential; beside them Triton's 256 MiB flush buffer and clones of
    the spikes, h and the last potential. A second call of the same shape tunes nothing, a new shape does."""
    assert TRITON_BENCH_CACHE_BYTES == 256 * MIB
    meter = DeviceMeter()
    cell = FusedNeuron(meter.fused, "triton")
    x = torch.empty(T, N, F, device="meta", requires_grad=True)
    meter.track([x])
    with meter:
        out = cell(x)
        assert meter.tune_peak == 5 * 512 + 256 * MIB + 3 * 512
        assert meter.tuned == {("forward", T, N * F, torch.float32)}
        keep = [torch.empty(4096, device="meta") for _ in range(4)]  # more live: a re-tune would raise the peak
        cell(x)
        assert meter.tune_peak == 5 * 512 + 256 * MIB + 3 * 512
        cell(torch.empty(T, N, 2 * F, device="meta"))
        assert ("forward", T, 2 * N * F, torch.float32) in meter.tuned
        assert meter.tune_peak > 5 * 512 + 256 * MIB + 3 * 512 + 4 * 16384
        meter.phase = "backward"
        out.sum().backward()
    assert ("backward", T, N * F, torch.float32) in meter.tuned
    del keep


def test_the_first_step_peak_holds_the_autotuning_but_no_optimizer_state():
    """A small model whose neuron runs the triton op: its peak is the first step's, where the 256 MiB flush buffer
    stands beside less than a MiB of the model; Adam's state is not created yet, so ZeRO leaves that peak as it is
    (the reference's dp and dp + zero rows publish the same peak). The same model on 2.0.0's op stays far below."""
    x = torch.rand(T, 2 * N, 2, HW, HW)
    peaks = {}
    for backend in ("triton", None):
        model = conv_bn_lif(backend)
        for zero in (False, True):
            plan = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 2}, batch_size=2 * N,
                           mode="dp", features=se.DistributedFeatureSet(allow_zero_optimizer=zero))
            assert plan.uses_zero == zero
            peaks[(backend, zero)] = se.estimate(model, plan, example_input=x, hardware=RTX).peak_bytes
    assert 256 * MIB < peaks[("triton", False)] < 257 * MIB
    assert peaks[("triton", False)] == peaks[("triton", True)]
    assert peaks[(None, False)] < MIB and peaks[(None, True)] < peaks[(None, False)]


def test_ddp_copies_every_gradient_into_its_bucket_and_back():
    """DDP without gradient-as-bucket-view multiplies each gradient into its bucket and copies it back after the
    all-reduce: two memory-bound kernels per gradient, each reading and writing it. By hand for the conv-BN-LIF
    block (conv weight 4 x 2 x 3 x 3 and bias 4, BN weight and bias 4 each, fp32): 4 gradients, 336 bytes."""
    hw = se.hardware_profile(RTX)
    model = conv_bn_lif()
    x = torch.rand(T, 2 * N, 2, HW, HW)
    compute = {}
    for dp in (1, 2):
        plan = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": dp}, batch_size=dp * N,
                       mode="dp" if dp > 1 else "none", features=se.DistributedFeatureSet(allow_zero_optimizer=False))
        assert not plan.uses_zero  # the same optimizer step on both
        compute[dp] = se.estimate(model, plan, example_input=x[:, :dp * N], hardware=RTX).time["compute_s"].iloc[0]
    grads = (C * 2 * 9 + 3 * C) * 4
    assert compute[2] - compute[1] == pytest.approx(2 * (2 * grads / hw.bandwidth() + 4 * hw.op_overhead_s), rel=1e-9)


def test_an_unsafe_view_launches_nothing():
    """``_unsafe_view`` (how ``torch.matmul`` folds a 3-D operand) returns its input's storage reshaped: no kernel.
    A [T, N, F] @ [F, 5] matmul is one GEMM over T * N rows: one kernel moving the operands and the output."""
    meter = DeviceMeter()
    x, w = torch.empty(T, N, F, device="meta"), torch.empty(F, 5, device="meta")
    with meter:
        folded = torch.ops.aten._unsafe_view(x, [T * N, F])
        assert folded.untyped_storage()._cdata == x.untyped_storage()._cdata
        assert meter.kernels == []
        torch.matmul(x, w)
    assert [(k.kind, k.bytes, k.launches) for k in meter.kernels] == [("matmul", (T * N * F + F * 5 + T * N * 5) * 4, 1)]
