"""Pipeline plans on a GPU kernel-model profile: each stage timed from its own traced kernels, checked
against the whole model's trace (the non-pipeline GPU path), the difference bounded from the shapes."""
import dataclasses

import pytest
import torch

import snn_explorer as se
from snn_explorer.core.model import TIME_MAJOR
from snn_explorer.estimator.memory.gpu_trace import gpu_stage_kernels, gpu_stage_memory, gpu_step, optimizer_kernels
from snn_explorer.estimator.profile.profiling import model_profile
from snn_explorer.estimator.timing.gpu_kernels import phase_seconds
from snn_explorer.estimator.timing.hardware import hardware_profile
from snn_explorer.estimator.timing.pipeline_time import plan_stages
from snn_explorer.zoo import build
from snn_explorer.zoo.llm import build_llm, token_batch

RTX = "RTX-4090-PCIe-noP2P"


def pp_plan(z, micro=2, batch=None):
    return se.plan(analysis=se.analyze(z.model), objective="speed", mode="pp", topology={"pp": 2},
                   batch_size=batch or z.batch_size, options=se.PlanOptions(pp_microbatches=micro, pp_schedule="gpipe", pp_virtual_stages=1))


def seconds(kernels, hw) -> float:
    return sum(phase_seconds(kernels, hw).values())


@pytest.mark.parametrize("name", ["mlp_all_steps", "vgg"])
def test_stages_add_up_to_the_whole_model_trace(name):
    """The stages of one micro-batch of the whole batch, traced one by one, run the kernels of the whole
    model's traced step. The only kernels a stage may add: per boundary one copy of the activation it
    receives (``PipelineStageModule`` makes its input contiguous / casts its output), so the sum may exceed
    the whole by at most (stages - 1) x (a launch + reading and writing that activation at bandwidth)."""
    hw = hardware_profile(RTX)
    z = build(name)
    profile = model_profile(z.model, z.example_input, z.labels)
    stages = plan_stages(pp_plan(z), profile)
    n, t = z.batch_size, z.time_steps
    whole = gpu_step(profile, n, t).kernels
    traced = gpu_stage_kernels(profile, stages, n, t)
    assert all(s.forward and s.backward for s in traced)  # both stages run kernels both ways
    staged = sum(seconds(s.forward, hw) + seconds(s.backward, hw) for s in traced)
    boundary = profile.modules[stages[0][-1]].out_elems(n, t) * profile.dtype.itemsize
    bound = (len(stages) - 1) * (hw.op_overhead_s + 2 * boundary / hw.bandwidth())
    assert seconds(whole, hw) * (1 - 1e-9) <= staged <= seconds(whole, hw) * (1 + 1e-9) + bound


def test_pipeline_compute_on_gpu_is_the_traced_stages():
    """A GPipe plan (pp = 2, two micro-batches) on the kernel-model profile: its ranks' compute together is
    two micro-batches of the whole model's traced forward and backward at the micro-batch size (the
    non-pipeline GPU estimate of one rank holding one micro-batch), plus the optimizer once; each pp rank
    launches the optimizer's foreach kernels over its own stages, so at most one extra set of launches.
    On the same rates as a CPU profile (no kernel model) the stages are the counted operators."""
    z = build("vgg")
    micro = 2
    pp = se.estimate(z.model, pp_plan(z, micro), example_input=z.example_input, labels=z.labels, hardware=RTX)
    n = z.batch_size // micro
    one = se.plan(analysis=se.analyze(z.model), objective="speed", mode="none", topology={"dp": 1}, batch_size=n)
    single = se.estimate(z.model, one, example_input=z.example_input, labels=z.labels, hardware=RTX)
    hw = hardware_profile(RTX)
    profile = model_profile(z.model, z.example_input, z.labels)
    optimizer = seconds(optimizer_kernels(profile, None, 1, "adam"), hw)
    launches = sum(k.launches for k in optimizer_kernels(profile, None, 1, "adam")) * hw.op_overhead_s
    expected = micro * (single.time["compute_s"].iloc[0] - optimizer) + optimizer
    assert pp.step_time_s > 0 and "stages timed as" in pp.verdict
    assert expected * (1 - 1e-9) <= pp.time["compute_s"].iloc[[0, 1]].sum() <= expected * (1 + 1e-9) + launches
    counted = se.estimate(z.model, pp.plan, example_input=z.example_input, labels=z.labels,
                          hardware=dataclasses.replace(hw, device="cpu", kernel_model=False))
    assert counted.time["compute_s"].iloc[0] != pp.time["compute_s"].iloc[0]


def test_stage_memory_on_gpu_is_the_traced_step_cut_at_the_stages():
    """The stages' memory on the kernel-model profile comes from the same meta trace: with a spikingjelly
    LIF run as the fused kernel (h in fp32, the input and v_init saved; not the CPU path's tensors), the
    stages of one micro-batch of the whole batch keep, together, exactly what the whole traced forward
    keeps (each stage's output is what the next stage's first layer, or the loss, keeps in the whole
    model), hold its neuron state and allocate its gradients."""
    pytest.importorskip("spikingjelly.activation_based")  # installed by scripts/setup.sh
    from test_gpu_model import HW, N, T, small_snn
    model = small_snn()
    x = torch.rand(T, N, 2, HW, HW)
    profile = model_profile(model, x)
    plan = se.plan(analysis=se.analyze(model), objective="speed", mode="pp", topology={"pp": 2}, batch_size=N, options=se.PlanOptions(pp_microbatches=2, pp_schedule="gpipe", pp_virtual_stages=1))
    stages = plan_stages(plan, profile)
    runs = gpu_stage_memory(profile, stages, N, T, 1)
    whole = gpu_step(profile, N, T)
    assert whole.fused == ("2",) and whole.saved > 0  # the LIF runs fused, and something is kept
    assert sum(r.kept for r in runs) == whole.saved
    assert sum(r.held for r in runs) == whole.state and sum(r.grads for r in runs) == whole.grads
    gpu = se.estimate(model, plan, example_input=x, hardware=RTX)
    cpu = se.estimate(model, plan, example_input=x, hardware=dataclasses.replace(hardware_profile(RTX), device="cpu",
                                                                                 kernel_model=False))
    assert gpu.per_rank["activations_bytes"].iloc[0] != cpu.per_rank["activations_bytes"].iloc[0]


def test_shape_only_pipeline_of_a_language_model_counts_its_stages_as_the_real_one():
    """A pipeline plan of a language model built on the meta device: its stages' operators are counted on
    FakeTensors (the model holds no data, the token ids and next-token labels are on the CPU), and the
    estimate equals the one of the same model built for real, on a datasheet profile and on the GPU model."""
    cfg = dict(tied_embeddings=False)
    real, meta = build_llm("spiking-llm-tiny", **cfg), build_llm("spiking-llm-tiny", device="meta", **cfg)
    tokens, labels = token_batch(real.config, 2, 4, 8), torch.randint(0, real.config.vocab_size, (4, 8))
    plan = se.plan(analysis=se.analyze(real), objective="speed", mode="pp", topology={"pp": 2}, batch_size=4, options=se.PlanOptions(pp_microbatches=2, pp_schedule="gpipe", pp_virtual_stages=1))
    for hw in ("A100-SXM-80GB", RTX):
        ours = [se.estimate(m, plan, example_input=tokens, labels=labels, hardware=hw, layout=TIME_MAJOR)
                for m in (real, meta)]
        assert ours[0].step_time_s > 0 and ours[0].peak_bytes > 0
        assert ours[0].time.equals(ours[1].time) and ours[0].per_rank.equals(ours[1].per_rank), hw
