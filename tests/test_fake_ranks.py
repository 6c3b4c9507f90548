"""record_collectives: one step of a plan on one rank of torch's fake process group, collectives recorded
as issued, nothing allocated; the estimate's collective rows must equal them, also at world sizes and
model sizes this machine cannot spawn or hold."""
import pytest
import torch
import torch.distributed as dist

import snn_explorer as se
from snn_explorer import compat
from snn_explorer.estimator import enumerate_plans, estimate, record_collectives
from snn_explorer.zoo import build
from snn_explorer.zoo.llm import build_llm, token_batch

COLUMNS = ["mesh_dim", "kind", "phase", "count", "bytes"]


def _rows(table):
    return sorted(tuple(r) for r in table[COLUMNS].itertuples(index=False))


def _sharded_plans(model, world, n, family=None):
    analysis = se.analyze(model, model_family=family)
    plans = enumerate_plans(analysis, world_size=world, batch_size=n, objective="memory")
    return [p for p in plans if not (p.uses_ddp or p.uses_pp)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,world", [("mlp", 4), ("spikformer", 2), ("vgg", 2)])
def test_recorded_collectives_equal_the_estimate_on_the_zoo(name, world):
    zoo = build(name)
    plans = _sharded_plans(zoo.model, world, zoo.example_input.shape[1], zoo.family)
    assert {"fsdp2", "tp"} <= {p.mode for p in plans}
    for plan in plans:
        recorded = record_collectives(zoo.model, plan, zoo.example_input, zoo.labels)
        assert len(recorded) and (recorded["bytes"] > 0).all(), plan  # FSDP2 / DTensor really communicated
        estimated = estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels).collectives
        assert _rows(estimated) == _rows(recorded), f"{name} {plan}"


@pytest.mark.timeout(300)
def test_a_meta_llm_at_64_ranks_is_recorded_without_allocating_it():
    """The 100 M spiking LLM's widths (3 blocks, untied embeddings) built on meta, FSDP2 over 64 ranks and FSDP2 x TP 16 x 4: rows equal, and
    neither the model nor anything of its size was materialised."""
    model = build_llm("spiking-llm-100m", device="meta", tied_embeddings=False, n_layers=3)
    tokens = token_batch(model.config, 2, 64, 16)
    analysis = se.analyze(model)
    plans = [se.plan(analysis=analysis, objective="speed", mode="fsdp2", topology={"dp": 64}, batch_size=64),
             se.plan(analysis=analysis, objective="speed", mode="fsdp2_tp", topology={"dp": 16, "tp": 4},
                     batch_size=64, tensor_parallel_plan=model.tensor_parallel_plan())]
    for plan in plans:
        recorded = record_collectives(model, plan, tokens, layout=se.TIME_MAJOR, rank=5)
        assert set(recorded["mesh_dim"]) == set(plan.mesh_dim_names), plan
        estimated = estimate(model, plan, example_input=tokens, hardware="H100-SXM-96GB", layout=se.TIME_MAJOR)
        assert _rows(estimated.collectives) == _rows(recorded), plan
    assert all(p.device.type == "meta" for p in model.parameters())
    assert not dist.is_initialized()


def test_what_a_fake_group_cannot_record_is_refused_before_anything_runs():
    zoo = build("mlp")
    analysis = se.analyze(zoo.model)
    dp = se.plan(analysis=analysis, objective="speed", mode="dp", topology={"dp": 2}, batch_size=4)
    with pytest.raises(ValueError, match=r"mode='dp' cannot run on a fake process group.*measure\(\)"):
        record_collectives(zoo.model, dp, zoo.example_input, zoo.labels)
    fsdp = se.plan(analysis=analysis, objective="speed", mode="fsdp2", topology={"dp": 2}, batch_size=4)
    with pytest.raises(ValueError, match=r"rank=2; expected an int in \[0, 2\)"):
        record_collectives(zoo.model, fsdp, zoo.example_input, zoo.labels, rank=2)
    with compat.fake_process_group(0, 2):
        with pytest.raises(RuntimeError, match="already rank 0 of 2"):
            record_collectives(zoo.model, fsdp, zoo.example_input, zoo.labels)
    one = se.plan(analysis=analysis, objective="speed", mode="none", topology={"dp": 1}, batch_size=4)
    assert record_collectives(zoo.model, one, zoo.example_input, zoo.labels).empty
    assert not dist.is_initialized() and torch.is_tensor(zoo.example_input)
