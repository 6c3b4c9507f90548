"""The GPU execution model: the fused neuron kernel's saved tensors and bytes, the meta-device trace
of a step, and the time of each kernel on a profile, each against figures computed by hand from
the shapes and the profile's constants (not from the code under test)."""
import dataclasses

import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.estimator.memory.fused_neurons import FusedNeuron, fused_op, runs_fused, swap_fused
from snn_explorer.estimator.memory.gpu_trace import ALLOCATOR_BLOCK, DeviceMeter, Kernel, allocated, trace_step
from snn_explorer.estimator.timing.gpu_kernels import kernel_seconds, phase_seconds
from snn_explorer.zoo import build

sj = pytest.importorskip("spikingjelly.activation_based")  # installed by scripts/setup.sh
from spikingjelly.activation_based import layer, neuron, surrogate  # noqa: E402

RTX = "RTX-4090-PCIe-noP2P"
T, N, C, HW = 3, 2, 4, 8


def lif() -> nn.Module:
    return neuron.LIFNode(tau=1.333, decay_input=False, detach_reset=True, surrogate_function=surrogate.ATan(),
                          step_mode="m")


def conv_bn_lif() -> nn.Module:
    return nn.Sequential(layer.Conv2d(2, C, 3, padding=1, step_mode="m"), layer.BatchNorm2d(C, step_mode="m"), lif())


def saved_of(fn, x) -> list:
    """(shape, dtype, is x) of every tensor autograd saves while ``fn(x)`` runs."""
    out = []

    def pack(t):
        out.append((tuple(t.shape), t.dtype, t is x or t.untyped_storage() is x.untyped_storage()))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return out


def test_the_package_neuron_is_fused_on_a_gpu_and_the_others_are_not():
    assert runs_fused(lif(), "torch")  # 2.0.0 picks its fused op by itself, whatever the plan says
    single = neuron.LIFNode(step_mode="s")
    assert not runs_fused(single, "triton") and not runs_fused(nn.ReLU(), "triton")
    model = conv_bn_lif()
    assert swap_fused(model, "torch", lambda *a: None) == ("2",) and isinstance(model[2], FusedNeuron)


def test_stand_in_saves_exactly_what_the_package_fused_op_saves():
    """On the meta device spikingjelly 2.0.0 runs its own fused op (``sj_lif.forward``, the op its
    CUDA path runs), so its saved tensors are the reference: h [T, ...] fp32, the input itself,
    v_init [...] fp32. The stand-in saves the same; the CPU path (pure torch) saves something else."""
    x = torch.empty(T, N, 5, device="meta", requires_grad=True)
    package = saved_of(lif(), x)
    stand_in = saved_of(FusedNeuron(lambda *a: None), x)
    assert sorted(package, key=str) == sorted(stand_in, key=str)
    assert sorted(stand_in, key=str) == sorted([((T, N, 5), torch.float32, False), ((T, N, 5), torch.float32, True),
                                                ((N, 5), torch.float32, False)], key=str)
    cpu = saved_of(lif(), torch.rand(T, N, 5, requires_grad=True))
    assert all(shape == (N, 5) for shape, _, _ in cpu) and len(cpu) == 2 * T  # h - threshold, 1 - spike per step


def test_fused_kernel_bytes_and_launches_from_the_shapes():
    """One launch each way; forward reads x and v_init, writes spikes, h and v; backward reads the
    spikes' and v's gradients and h, writes grad x and grad v_init (4-byte floats: 4 B each)."""
    meter = DeviceMeter()
    cell = FusedNeuron(meter.fused)
    x = torch.empty(T, N, 8, device="meta", requires_grad=True)
    with meter:
        loss = cell(x).sum()
        meter.phase = "backward"
        loss.backward()
    fused = [k for k in meter.kernels if k.kind == "neuron"]
    seq, state = T * N * 8 * 4, N * 8 * 4
    assert [(k.phase, k.launches) for k in fused] == [("forward", 1), ("backward", 1)]
    assert fused[0].bytes == seq + state + seq + seq + state  # x, v_init | spikes, h, v
    assert fused[1].bytes == seq + state + seq + seq + state  # grad spikes, grad v, h | grad x, grad v_init


def test_allocator_rounds_to_its_block():
    assert ALLOCATOR_BLOCK == 512
    assert [allocated(b) for b in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]


def test_trace_counts_what_a_conv_bn_lif_step_keeps():
    """Held at the forward's end (beyond parameters, input and the last state), by hand: the conv's
    output (the BN's saved input), the BN's mean and inverse std, its output (the neuron's input, by
    reference), h, v_init, the spikes (kept by the loss's square) and the loss."""
    step = trace_step(conv_bn_lif(), torch.empty(T, N, 2, HW, HW, device="meta"), None)
    seq = T * N * C * HW * HW * 4
    state = N * C * HW * HW * 4
    expected = seq + 512 + 512 + seq + seq + state + seq + 512
    assert step.saved == expected
    assert step.state == state and step.fused == ("2",)
    assert step.grads == allocated(C * 2 * 9 * 4) + 3 * allocated(C * 4)  # conv weight and bias, BN weight and bias


def test_the_triton_backend_op_saves_only_h():
    """The ``backend='triton'`` op of the releases with a ``backend`` argument (upstream
    ``triton_kernel/neuron_kernel/lif.py``: ``ctx.save_for_backward(h_seq)``, ``h_seq = empty_like(x_seq)``)
    keeps h alone, in the input's dtype; 2.0.0's neuron (no ``backend`` attribute) keeps its own op whatever
    the plan's backend."""
    assert fused_op(lif(), "triton") == "sj_lif"
    marked = lif()
    marked.backend = "triton"
    assert fused_op(marked, "torch") == "triton"
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.empty(T, N, 5, device="meta", dtype=dtype, requires_grad=True)
        assert saved_of(FusedNeuron(lambda *a: None, "triton"), x) == [((T, N, 5), dtype, False)]
    with pytest.raises(ValueError, match="'inductor'"):
        FusedNeuron(lambda *a: None, "inductor")


def test_trace_of_the_triton_op_frees_the_neuron_input_and_v_init():
    """As the conv-BN-LIF step above, the neuron running the triton op: held at the forward's end, by hand,
    the conv's output (the BN's saved input), the BN's mean and inverse std, h, the spikes (kept by the
    loss's square) and the loss; the BN's output and v_init are freed once the neuron has run."""
    model = conv_bn_lif()
    model[2].backend = "triton"
    step = trace_step(model, torch.empty(T, N, 2, HW, HW, device="meta"), None)
    seq = T * N * C * HW * HW * 4
    assert step.saved == seq + 512 + 512 + seq + seq + 512
    assert step.state == N * C * HW * HW * 4 and step.fused == ("2",)


def test_kernel_time_is_the_roofline_plus_launches():
    hw = se.hardware_profile(RTX)
    conv = Kernel("forward", "conv", 2e12, 10 ** 9, 4, 1)
    assert kernel_seconds(conv, hw) == pytest.approx(2e12 / 82.6e12 + 4e-6)  # TF32 tensor cores
    memory = Kernel("forward", "memory", 0.0, 0.92185e9, 4, 1)
    assert kernel_seconds(memory, hw) == pytest.approx(1e-3 + 4e-6)  # 921.85 GB/s measured (nvbench), of 1008
    half = Kernel("backward", "matmul", 1.652e12, 1000, 2, 3)
    assert kernel_seconds(half, hw) == pytest.approx(1e-2 + 3 * 4e-6)  # 165.2 TFLOP/s at 2 bytes
    assert kernel_seconds(memory, hw, scale=0.5) == pytest.approx(0.5e-3 + 4e-6)  # launches not scaled
    assert phase_seconds([conv, memory, half], hw) == pytest.approx(
        {"forward": 2e12 / 82.6e12 + 1e-3 + 8e-6, "backward": 1e-2 + 12e-6})
    # a mixed-precision plan's convolution runs at the 2-byte rate, half its operand bytes
    assert kernel_seconds(conv, hw, half=True) == pytest.approx(2e12 / 165.2e12 + 4e-6)


def test_convolutions_use_tensor_cores_and_matmuls_fp32():
    a100 = se.hardware_profile("A100-SXM-80GB")  # 156 TF32, 19.5 FP32, at cuBLAS's measured 267.9 / 312 of peak
    reached = 267.9 / 312
    conv = Kernel("forward", "conv", 156e12 * reached, 0, 4, 0)
    matmul = Kernel("forward", "matmul", 19.5e12 * reached, 0, 4, 0)
    assert kernel_seconds(conv, a100) == pytest.approx(1.0) and kernel_seconds(matmul, a100) == pytest.approx(1.0)


def test_gemm_quantisation_against_the_sm_count():
    """By hand on an A100 (108 SMs): a 128 x 128 output is at best four 64 x 64 tiles on four SMs and its K = 64 is
    too short to split (split-K keeps >= 256 per slice): 4/108 of the rate; 108 such outputs are 432 tiles, four
    whole waves; a 2-channel 3x3 convolution's K = 18 pads to 20 (4 TF32 elements = 16 bytes)."""
    a100 = se.hardware_profile("A100-SXM-80GB")
    one = Kernel("forward", "matmul", 2.0 * 128 * 128 * 64, 0, 4, 0, ((1, 128, 128, 64),))
    full = Kernel("forward", "matmul", 2.0 * 108 * 128 * 128 * 64, 0, 4, 0, ((108, 128, 128, 64),))
    rate = a100.flops(4)
    assert kernel_seconds(one, a100) == pytest.approx(one.flops / rate * 108 / 4)
    assert kernel_seconds(full, a100) == pytest.approx(full.flops / rate)
    narrow = Kernel("forward", "conv", 2.0 * 108 * 128 * 128 * 18, 0, 4, 0, ((108, 128, 128, 18),))
    assert kernel_seconds(narrow, a100) == pytest.approx(narrow.flops / a100.conv_flops(4) * 20 / 18)


def test_rtx_profile_states_its_topology_and_link():
    hw = se.hardware_profile(RTX)
    assert hw.kernel_model and "NCCL_P2P_DISABLE=1" in hw.topology and hw.efficiency == 1.0
    alpha, beta = hw.collectives["all_reduce"][2]
    assert alpha == pytest.approx(2 * 14e-6) and beta == pytest.approx(1 / 7.9e9)  # ring on 2: 2 steps, 1 x buffer
    # one model for every GPU: each cuda profile is traced as the GPU runs it, at rates with their sources
    for name, profile in se.hardware_profiles().items():
        assert profile.kernel_model and profile.efficiency == 1.0 and profile.sm_count, name
    assert dataclasses.replace(hw, kernel_model=False).kernel_model  # a cuda profile cannot leave it
    assert not dataclasses.replace(hw, device="cpu", kernel_model=False).kernel_model


def small_snn() -> nn.Module:
    return nn.Sequential(*conv_bn_lif(), layer.Flatten(step_mode="m"), layer.Linear(C * HW * HW, 3, step_mode="m"))


def test_gpu_estimate_runs_nothing_at_the_rank_size():
    """The GPU model traces on the meta device: a step far beyond this machine's memory is estimated
    (the CPU path refuses to measure it), and its activations grow with the time steps as traced."""
    model = small_snn()
    x = torch.rand(T, N, 2, HW, HW)
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 1}, batch_size=N, mode="none")
    huge = 2 * 10 ** 7
    cpu = dataclasses.replace(se.hardware_profile(RTX), device="cpu", kernel_model=False)  # the CPU-profile path
    with pytest.raises(ValueError, match="time_steps"):
        se.estimate(model, plan, example_input=x, time_steps=huge, hardware=cpu)
    gpu = se.estimate(model, plan, example_input=x, time_steps=huge, hardware=RTX)
    seq = huge * N * C * HW * HW * 4  # one [T, N, C, H, W] fp32 tensor
    # conv output, BN output (the neuron's input), h, spikes (the Linear's input); v_init, BN mean
    # and inverse std, the output (kept by the loss's square), the loss; and the input batch itself
    saved = 4 * seq + N * C * HW * HW * 4 + 3 * 512 + allocated(huge * N * 3 * 4)
    assert gpu.per_rank["activations_bytes"].iloc[0] == saved + huge * N * 2 * HW * HW * 4
    assert gpu.peak_bytes > saved and gpu.step_time_s > 0


def test_gpu_path_leaves_the_other_profiles_alone():
    model = small_snn()
    x = torch.rand(T, N, 2, HW, HW)
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 1}, batch_size=N, mode="none")
    cpu_side = se.estimate(model, plan, example_input=x, hardware=dataclasses.replace(
        se.hardware_profile("RTX-4090"), device="cpu", kernel_model=False))
    gpu_side = se.estimate(model, plan, example_input=x, hardware="RTX-4090")
    assert cpu_side.peak_bytes != gpu_side.peak_bytes  # the fused kernel and the allocator's blocks, not the CPU run


def test_batch_norm_reads_its_input_twice_in_two_launches():
    """Statistics first, then the normalisation: forward reads x twice and writes y (plus the small
    per-channel tensors); backward reads the output's gradient and x twice and writes x's gradient."""
    meter = DeviceMeter()
    bn = nn.BatchNorm2d(C).to("meta")
    x = torch.empty(N, C, HW, HW, device="meta", requires_grad=True)
    with meter:
        loss = bn(x).sum()
        meter.phase = "backward"
        loss.backward()
    big = N * C * HW * HW * 4
    norms = [k for k in meter.kernels if k.launches == 2 and k.kind == "memory"]
    assert len(norms) == 2
    forward, backward = norms
    assert big * 3 <= forward.bytes < big * 3 + 4096  # x twice, y once; weight, bias, stats: C floats each
    assert big * 5 <= backward.bytes < big * 5 + 4096  # grad y and x twice each, grad x once


def test_fills_and_copies_move_what_they_write_and_read():
    meter = DeviceMeter()
    a, b = torch.empty(1000, device="meta"), torch.empty(1000, device="meta")
    with meter:
        a.copy_(b)  # reads b, writes a
        a.zero_()  # writes a
        torch.zeros_like(b)  # writes a new tensor
        a.add_(b)  # reads a and b, writes a
    assert [k.bytes for k in meter.kernels] == [8000, 4000, 4000, 12000]


def test_gpu_trace_of_a_checkpointed_plan_recomputes_its_blocks():
    """Block checkpointing on the GPU path: the trace runs the checkpointed meta copy (a copy of an
    already checkpointed model would run the original's modules and fail on the meta device): fewer
    saved activations, and the recompute adds kernels to the step."""
    zoo = build("vgg")
    analysis = se.analyze(zoo.model)
    gates = se.DistributedFeatureSet(allow_activation_checkpointing=True)
    steps = {}
    for checkpointing in ("none", "blocks"):
        plan = se.plan(analysis=analysis, objective="speed", topology={"dp": 2}, mode="fsdp2", features=gates,
                       batch_size=zoo.example_input.shape[1], options=se.PlanOptions(activation_checkpointing=checkpointing))
        steps[checkpointing] = se.estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels,
                                           hardware=RTX)
    plain, recomputed = steps["none"], steps["blocks"]
    assert recomputed.per_rank["activations_bytes"].iloc[0] < plain.per_rank["activations_bytes"].iloc[0] / 2
    assert recomputed.peak_bytes < plain.peak_bytes
    assert recomputed.step_time_s > plain.step_time_s  # the forward of every block runs again in the backward
