"""record_rank_step: a plan's step on one rank of torch's fake process group, on FakeTensors: its
collectives recorded as issued and its peak as torch's MemTracker follows it, nothing allocated. First
shown equal to what measure() gets on real gloo ranks; then the estimate is checked against it, also at
world sizes and model sizes this machine cannot spawn or hold.
(The tests on gloo ranks: tests/ranks/test_fake_ranks_ranks.py.)"""
import dataclasses

import pytest
import torch.distributed as dist

import snn_explorer as se
from snn_explorer import compat_fake
from snn_explorer.core.model import TIME_MAJOR
from snn_explorer.estimator import enumerate_plans, estimate, hardware_profile, record_rank_step
from snn_explorer.zoo import build
from snn_explorer.zoo.llm import build_llm, token_batch

COLUMNS = ["mesh_dim", "kind", "phase", "count", "bytes"]
#: The fake rank runs the step as this machine's CPU ranks do: estimates compared with it are made on a CPU-device
#: profile (the operator-count model of what a CPU rank allocates); a GPU profile predicts what a GPU allocates.
CPU_SIDE = dataclasses.replace(hardware_profile("A100-SXM-80GB"), device="cpu", kernel_model=False)


def _rows(table):
    return sorted(tuple(r) for r in table[COLUMNS].itertuples(index=False))


def _sharded_plans(model, world, n, family=None):
    analysis = se.analyze(model, model_family=family)
    plans = enumerate_plans(analysis, world_size=world, batch_size=n, objective="memory")
    return [p for p in plans if not (p.uses_ddp or p.uses_pp)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,world", [("mlp", 4), ("vgg", 2)])
def test_the_estimate_equals_a_fake_ranks_step_on_the_zoo(name, world):
    zoo = build(name)
    plans = _sharded_plans(zoo.model, world, zoo.example_input.shape[1], zoo.family)
    assert {"fsdp2", "tp"} <= {p.mode for p in plans}
    for plan in plans:
        fake = record_rank_step(zoo.model, plan, zoo.example_input, zoo.labels)
        estimated = estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels, hardware=CPU_SIDE)
        assert _rows(estimated.collectives) == _rows(fake.collectives), f"{name} {plan}"
        assert estimated.peak_bytes == pytest.approx(fake.peak_bytes, rel=0.05), f"{name} {plan}"


@pytest.mark.timeout(300)
def test_a_meta_llm_at_64_ranks_runs_on_a_fake_rank_without_allocating_it():
    """The 100 M spiking LLM's widths (2 blocks, untied embeddings) built on meta, FSDP2 x TP 16 x 4
    over 64 ranks, on rank 5: collectives equal the estimate's, the peak within 5 %, and
    neither the model nor anything of its size was materialised."""
    model = build_llm("spiking-llm-100m", device="meta", tied_embeddings=False, n_layers=2)
    tokens = token_batch(model.config, 2, 64, 16)
    analysis = se.analyze(model)
    plans = [se.plan(analysis=analysis, objective="speed", mode="fsdp2_tp", topology={"dp": 16, "tp": 4},
                     batch_size=64, options=se.PlanOptions(tensor_parallel_plan=model.tensor_parallel_plan()))]
    for plan in plans:
        fake = record_rank_step(model, plan, tokens, layout=TIME_MAJOR, rank=5)
        assert set(fake.collectives["mesh_dim"]) == set(plan.mesh_dim_names), plan
        cpu_side = dataclasses.replace(hardware_profile("H100-SXM-96GB"), device="cpu", kernel_model=False)
        estimated = estimate(model, plan, example_input=tokens, hardware=cpu_side, layout=TIME_MAJOR)
        assert _rows(estimated.collectives) == _rows(fake.collectives), plan
        assert estimated.peak_bytes == pytest.approx(fake.peak_bytes, rel=0.05), plan
    assert all(p.device.type == "meta" for p in model.parameters())
    assert not dist.is_initialized()


def test_what_a_fake_group_cannot_run_is_refused_before_anything_runs():
    zoo = build("mlp")
    analysis = se.analyze(zoo.model)
    dp = se.plan(analysis=analysis, objective="speed", mode="dp", topology={"dp": 2}, batch_size=4)
    with pytest.raises(ValueError, match=r"mode='dp' cannot run on a fake process group.*measure\(\)"):
        record_rank_step(zoo.model, dp, zoo.example_input, zoo.labels)
    fsdp = se.plan(analysis=analysis, objective="speed", mode="fsdp2", topology={"dp": 2}, batch_size=4)
    with pytest.raises(ValueError, match=r"rank=2; expected an int in \[0, 2\)"):
        record_rank_step(zoo.model, fsdp, zoo.example_input, zoo.labels, rank=2)
    with compat_fake.fake_process_group(0, 2):
        with pytest.raises(RuntimeError, match="already rank 0 of 2"):
            record_rank_step(zoo.model, fsdp, zoo.example_input, zoo.labels)
    one = se.plan(analysis=analysis, objective="speed", mode="none", topology={"dp": 1}, batch_size=4)
    alone = record_rank_step(zoo.model, one, zoo.example_input, zoo.labels)
    assert alone.collectives.empty and alone.peak_bytes > 0
    assert not dist.is_initialized()
