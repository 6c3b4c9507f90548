"""3-D plans in one process: mode 'pp_tp' (pipeline stages over pp, each stage tensor-parallel over tp,
replicated over dp), 'pp_fsdp2_tp' (the same stages FSDP2-sharded over dp) on a 2 x 2 x 2 mesh and 'pp_fsdp2' on
pp=2 x dp=4: the mesh, stages and placements of each of 8 ranks on a fake process group; the plan-time refusals of
bad 3-D meshes; 3-D estimates of a meta model; the enumeration and the explorer offering 3-D plans. (The same plans
trained, checkpointed and measured on 8 gloo ranks: tests/ranks/test_mesh3d_ranks.py.)"""
import pytest
import torch
from torch import nn

from snn_explorer.core.model import TIME_MAJOR

STEPS = 2
BATCH = 8
TOPOLOGY = {"pp": 2, "dp": 2, "tp": 2}
PP_FSDP2 = {"pp": 2, "dp": 4}


def _zoo():
    from snn_explorer.zoo import build

    return build("mlp_all_steps", batch_size=BATCH)


def _plan(model, topology=TOPOLOGY, mode="pp_tp"):
    import snn_explorer as se

    return se.plan(analysis=se.analyze(model), objective="capacity", topology=topology, batch_size=BATCH, mode=mode)


def _applied_on_a_fake_rank(rank: int, mode: str, topology: dict) -> dict:
    """``apply`` of the zoo model under ``mode`` as rank ``rank`` of 8 on torch's fake process group (one process
    plays the rank; collectives complete at once): its mesh, stages, parameter types and placements."""
    import snn_explorer as se
    from snn_explorer import compat_fake

    with compat_fake.fake_process_group(rank, 8):
        model = _zoo().model.double()
        runtime = se.apply(model=model, plan=_plan(model, topology, mode), device_type="cpu")
        named = list(runtime.model.named_parameters())
        return dict(mesh=runtime.mesh.mesh.tolist(), stages=[s.index for s in runtime.model.stages],
                    sharded={n: type(p).__name__ for n, p in named},
                    placements={n: str(getattr(p, "placements", "")) for n, p in named})


def test_mesh_is_pp_dp_tp_with_tp_innermost():
    """Rank r sits at (pp, dp, tp) = (r // 4, r // 2 % 2, r % 2): tp peers are neighbouring ranks; each
    pp coordinate holds its own stage, whose layers are DTensor shards: over tp (pp_tp), over dp and tp (pp_fsdp2_tp:
    a dp Shard(0) first, then the TP placement), over dp (pp_fsdp2). Each of the 8 ranks on a fake process group,
    as torchtitan's ParallelDims tests check their meshes (the trained 3-D plans: tests/ranks/test_mesh3d_ranks.py)."""
    pp_tp = [_applied_on_a_fake_rank(rank, "pp_tp", TOPOLOGY) for rank in range(8)]
    assert all(r["mesh"] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]] for r in pp_tp)
    assert [r["stages"] for r in pp_tp] == [[0]] * 4 + [[1]] * 4
    assert all("DTensor" in r["sharded"].values() for r in pp_tp)
    fsdp_tp = _applied_on_a_fake_rank(0, "pp_fsdp2_tp", TOPOLOGY)["placements"]
    fsdp = _applied_on_a_fake_rank(0, "pp_fsdp2", PP_FSDP2)["placements"]
    assert fsdp_tp["stages.0.units.2.weight"] == "(Shard(dim=0), Shard(dim=1))"  # dp rows, then tp's rowwise split
    assert "Shard(dim=0)" in fsdp_tp["stages.0.units.0.weight"] and len(fsdp_tp) == 4  # colwise: dp x tp of dim 0
    assert set(fsdp.values()) == {"(Shard(dim=0),)"}


@pytest.mark.parametrize("topology,mode,match", [
    ({"pp": 6, "tp": 2}, "pp_tp", "pp=6 = 6 stages, but the model has only 5 pipeline unit"),
    ({"pp": 4, "tp": 2}, "pp_tp", "cannot be cut into 4 stages .* tensor parallelism leaves whole"),
    ({"pp": 3, "tp": 2}, "pp_tp", "leaves pp rank 1 .* without a trainable parameter"),
    ({"pp": 2, "tp": 3}, "pp_tp", "tp=3 does not divide"),
    ({"pp": 2, "dp": 2, "tp": 2}, "pp", "use mode 'pp_tp'"),
    ({"pp": 2, "dp": 2, "tp": 2}, "fsdp2_tp", "does not cut the model into pipeline stages; with pp=2 use mode "
                                              "'pp_fsdp2' .* or 'pp_fsdp2_tp'"),
    ({"pp": 2, "dp": 2, "tp": 2}, "pp_fsdp2", "does not split the stages' layers over tp=2; use mode 'pp_fsdp2_tp'"),
    ({"pp": 2, "tp": 4}, "pp_fsdp2_tp", r"needs the dim\(s\) \['dp'\] in the topology"),
    ({"pp": 2, "dp": 2, "tp": 3}, "pp_fsdp2_tp", "tp=3 does not divide"),
    ({"pp": 4, "dp": 2}, "pp_fsdp2", "leaves pp rank 2 .* without a trainable parameter"),
])
def test_bad_3d_meshes_are_refused_at_plan_time(topology, mode, match):
    with pytest.raises(ValueError, match=match):
        _plan(_zoo().model, topology, mode)


def test_pp_fsdp2_refuses_resharding_after_every_forward():
    """A pipeline's FSDP2 stages stay gathered for the step (one all-gather, not one per micro-batch): memopt_level=1
    is refused when the plan is built, not silently dropped; the planner gives these modes 0. CPU offload of the
    shards and activation checkpointing are refused with pipeline stages too."""
    import dataclasses

    plan = _plan(_zoo().model, TOPOLOGY, "pp_fsdp2_tp")
    assert plan.memopt_level == 0 and not plan.reshard_after_forward
    with pytest.raises(ValueError, match="memopt_level=1 .* is not used by mode 'pp_fsdp2_tp'.* use memopt_level=0"):
        dataclasses.replace(plan, memopt_level=1)
    import snn_explorer as se

    gates = se.DistributedFeatureSet(allow_cpu_offload=True, allow_activation_checkpointing=True)
    with pytest.raises(ValueError, match="offloads FSDP2's shards .* needs modes 'fsdp2' and 'fsdp2_tp', not mode='pp_fsdp2'"):
        dataclasses.replace(_plan(_zoo().model, PP_FSDP2, "pp_fsdp2"), cpu_offload=True, experimental_features=gates)
    with pytest.raises(ValueError, match="'blocks' is not combined with pipeline stages \\(mode 'pp_fsdp2_tp'\\)"):
        dataclasses.replace(plan, activation_checkpointing="blocks", experimental_features=gates)


def test_tp_needs_candidates_and_a_stage_never_ends_on_a_shard():
    import snn_explorer as se

    with pytest.raises(ValueError, match=r"multiply to 8, but world_size=6"):
        se.SNNDistributedTopology(TOPOLOGY, world_size=6)

    plain = nn.Sequential(nn.ReLU(), nn.Tanh())
    with pytest.raises(ValueError, match="needs tensor-parallel candidates"):
        se.plan(analysis=se.analyze(plain), objective="capacity", topology=TOPOLOGY, batch_size=BATCH, mode="pp_tp")
    model = _zoo().model
    with pytest.raises(ValueError, match="ending with unit 'net.1' would send a tensor-parallel shard: 'net.0' \\(colwise\\)"):
        se.plan(analysis=se.analyze(model), objective="capacity", topology=TOPOLOGY, batch_size=BATCH, mode="pp_tp", options=se.PlanOptions(pp_layout="2|3"))
    plan = _plan(model)
    assert plan.pp_layout == "3|2"  # the planner ends the first stage after the row-split layer


def _llm(device=None, **overrides):
    from snn_explorer.zoo.llm import build_llm

    return build_llm("spiking-llm-tiny", device=device, tied_embeddings=False, **overrides)


def _llm_plan(model, topology, batch, mode="pp_tp"):
    import snn_explorer as se

    return se.plan(analysis=se.analyze(model), objective="speed", mode=mode, topology=topology, batch_size=batch, options=se.PlanOptions(tensor_parallel_plan=model.tensor_parallel_plan()))


def test_a_3d_estimate_of_a_meta_model_equals_the_real_one():
    """The spiking LLM's pp x dp x tp and pp x fsdp2 x tp estimates, profiled shape-only on a meta copy, equal the
    real profile's: every rank's bytes, the collectives and the step time (the stage walk runs on FakeTensors)."""
    import snn_explorer as se
    from snn_explorer.zoo.llm import token_batch

    ests = {}
    for device in (None, "meta"):
        model = _llm(device)
        tokens = token_batch(model.config, 2, 8, 16)
        labels = torch.randint(0, model.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))
        for mode in ("pp_tp", "pp_fsdp2_tp"):  # next-token labels: the last stage's loss on meta, too
            ests[device, mode] = se.estimate(model, _llm_plan(model, TOPOLOGY, 8, mode), example_input=tokens,
                                             labels=labels, hardware="8x8-H100-SXM-96GB", optimizer="adamw",
                                             layout=TIME_MAJOR)
    for mode in ("pp_tp", "pp_fsdp2_tp"):
        real, shape_only = ests[None, mode], ests["meta", mode]
        assert real.plan.pp_layout == shape_only.plan.pp_layout and real.peak_bytes > 0
        assert real.per_rank.equals(shape_only.per_rank)
        assert real.collectives.equals(shape_only.collectives) and set(real.collectives["mesh_dim"]) == {"pp", "dp", "tp"}
        assert real.step_time_s == pytest.approx(shape_only.step_time_s, rel=1e-9)
    sharded, replicated = ests[None, "pp_fsdp2_tp"].per_rank, ests[None, "pp_tp"].per_rank
    assert (sharded["optimizer_bytes"] < replicated["optimizer_bytes"]).all()


def test_tp_stays_inside_a_node_and_pp_dp_cross_nodes():
    """Mesh order pp, dp, tp whatever order the topology names them: on 8 nodes of 8 GPUs, a pp=4 x dp=2 x tp=8
    plan keeps each tp group on one node (its collectives on NVLink) and sends pp and dp between nodes."""
    from snn_explorer.estimator.timing.hardware import hardware_profile
    from snn_explorer.estimator.timing.placement import spans_nodes

    model = _llm(dim=64, n_heads=8, ffn_dim=128, n_layers=4)
    plan = _llm_plan(model, {"tp": 8, "pp": 4, "dp": 2}, 16)
    hw = hardware_profile("8x8-H100-SXM-96GB")
    assert plan.mesh_dim_names == ("pp", "dp", "tp") and plan.mesh_shape == (4, 2, 8)
    assert (spans_nodes(plan, "tp", hw), spans_nodes(plan, "dp", hw), spans_nodes(plan, "pp", hw, 2)) == \
        (False, True, True)


def test_enumerate_and_the_explorer_offer_3d_plans():
    import snn_explorer as se

    zoo = _zoo()
    listed = se.enumerate_plans(se.analyze(zoo.model), world_size=8, batch_size=BATCH)
    three_d = [p for p in listed if p.mode == "pp_tp"]
    assert [dict(p.topology.dims) for p in three_d] == [TOPOLOGY, {"pp": 2, "tp": 4}]
    assert {p.pp_layout for p in three_d} == {"3|2"}
    assert "tensor parallelism leaves whole" in listed.infeasible["pp_tp pp=4 x tp=2"]
    sharded = [(p.mode, dict(p.topology.dims)) for p in listed if p.uses_pp and p.uses_fsdp]
    assert sharded == [("pp_fsdp2", PP_FSDP2), ("pp_fsdp2_tp", TOPOLOGY)]  # FSDP2 needs dp >= 2
    explorer = se.Explorer(zoo.model, example_input=zoo.example_input, labels=zoo.labels)
    plan = explorer.make_plan(objective="speed", topology=TOPOLOGY, batch_size=BATCH)  # mode auto: the one that fits
    assert plan.mode == "pp_tp" and plan.pp_layout == "3|2"  # balanced by the profile, ending on whole tensors
    assert explorer.estimate(plan).summary()["mesh"] == "pp=2 x dp=2 x tp=2"
    plan = explorer.make_plan(objective="memory", topology=TOPOLOGY, batch_size=BATCH)  # sharded stages first
    est = explorer.estimate(plan)
    assert plan.mode == "pp_fsdp2_tp" and est.summary()["mesh"] == "pp=2 x dp=2 x tp=2"
    assert est.per_rank["params_bytes"].iloc[0] * 2 == explorer.estimate(_plan(zoo.model)).per_rank["params_bytes"][0]
