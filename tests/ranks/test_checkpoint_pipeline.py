"""Checkpoints of pipeline plans (pp, pp x dp) on real gloo ranks: saved under the same full paths
as every other plan, so pp, dp, tp, fsdp2 and one process read each other's checkpoints.

One 4-rank and one 2-rank group are spawned for the module; each saves under its plans, loads every
checkpoint listed under another plan, re-saves what it loaded and trains 3 more steps. Checked:
parameters after a load equal the saved ones exactly; optimizer state survives exactly; 3 steps
after the load equal 6 uninterrupted single-process steps (float64, 1e-5) of a model whose neurons
spike at 2-98 %; a pipeline rank refuses to save while its neurons hold state.
"""
from pathlib import Path

import pytest
import torch
from distributed_harness import run_on_ranks
from torch import nn

from snn_explorer.core.planning import split_options

pytestmark = pytest.mark.timeout(600)

MODEL = "mlp_all_steps"
STEPS = 3
TOL = 1e-5
LR = 1e-2

#: plan key -> (topology, mode, extra plan keywords)
PLANS = {
    "none": ({"dp": 1}, "none", {}),
    "pp2dp2": ({"pp": 2, "dp": 2}, "pp", {}),  # interleaved: 4 stages, two on each pp rank
    "pp2dp2_gpipe": ({"pp": 2, "dp": 2}, "pp", {"pp_schedule": "gpipe"}),  # 2 stages, cut elsewhere
    "fsdp4": ({"dp": 4}, "fsdp2", {}), "tp4": ({"tp": 4}, "tp", {}),
    "pp2": ({"pp": 2}, "pp", {}), "pp2_1f1b": ({"pp": 2}, "pp", {"pp_schedule": "1f1b"}),
    "dp2": ({"dp": 2}, "dp", {}), "fsdp2": ({"dp": 2}, "fsdp2", {}), "tp2": ({"tp": 2}, "tp", {}),
}
SAVES4 = ["pp2dp2", "fsdp4", "tp4"]
LOADS4 = [("pp2dp2", "fsdp4"), ("pp2dp2", "tp4"), ("pp2dp2", "pp2dp2_gpipe"), ("fsdp4", "pp2dp2"),
          ("tp4", "pp2dp2"), ("none", "pp2dp2")]
SAVES2 = ["pp2", "fsdp2"]
LOADS2 = [("pp2", "dp2"), ("pp2", "fsdp2"), ("pp2", "tp2"), ("pp2", "pp2_1f1b"), ("fsdp2", "pp2"),
          ("pp2dp2", "pp2"), ("fsdp4", "pp2")]
LOADS1 = [("pp2", "none"), ("pp2dp2", "none")]


def _runtime(key):
    import snn_explorer as se
    from snn_explorer.zoo import build

    topology, mode, extra = PLANS[key]
    zoo = build(MODEL)
    model = zoo.model.double()
    plan = se.plan(analysis=se.analyze(model, model_family=zoo.family), objective="speed", topology=topology,
                   mode=mode, batch_size=zoo.batch_size, **split_options(extra))
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    share, start = plan.per_rank_batch, runtime.dp_rank * plan.per_rank_batch
    batch = zoo.example_input.double()[:, start:start + share], zoo.labels[start:start + share]
    return runtime, runtime.build_optimizer(torch.optim.Adam, lr=LR), batch


def _train(runtime, optimizer, batch):
    for _ in range(STEPS):
        optimizer.zero_grad()
        runtime.train_step(nn.CrossEntropyLoss(), *batch)
        optimizer.step()


def _save(root, key):
    """Train 3 steps under ``key``; a save while neurons hold state is refused; then save."""
    from snn_explorer.core.checkpoints import CheckpointError

    runtime, optimizer, batch = _runtime(key)
    _train(runtime, optimizer, batch)
    refused = None
    try:
        runtime.save_checkpoint(Path(root) / f"busy-{key}", optimizer=optimizer, step=STEPS)
    except CheckpointError as exc:
        refused = str(exc)
    runtime.reset_state()
    runtime.save_checkpoint(Path(root) / key, optimizer=optimizer, step=STEPS, extra={"saved": key})
    params = runtime.full_parameters()
    if _is_rank0():
        torch.save(params, Path(root) / f"{key}.params.pt")
    return refused


def _is_rank0():
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _load(root, src, dst):
    runtime, optimizer, batch = _runtime(dst)
    loaded = runtime.load_checkpoint(Path(root) / src, optimizer=optimizer)
    after = runtime.full_parameters()
    saved = torch.load(Path(root) / f"{src}.params.pt")
    differ = sorted(k for k in saved if not torch.equal(saved[k], after[k]))
    runtime.save_checkpoint(Path(root) / f"{src}~{dst}", optimizer=optimizer, step=loaded.step)
    _train(runtime, optimizer, batch)
    return {"differ": differ, "step": loaded.step, "extra": loaded.extra, "plan_mode": loaded.plan.mode,
            "continued": runtime.full_parameters(), "schedule": runtime.plan.pp_schedule,
            "stages": runtime.plan.pp_stages}


def _group(root, saves, loads):
    refused = {key: _save(root, key) for key in saves}
    results = {(src, dst): _load(root, src, dst) for src, dst in loads}
    return (refused, results) if _is_rank0() else None


def _reference():
    """6 uninterrupted Adam steps of the whole model in one process, with its spike rates."""
    from snn_explorer.zoo import build, reset_state

    zoo = build(MODEL)
    model = zoo.model.double()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    spikes = []
    hooks = [model.net[i].register_forward_hook(lambda m, i, out: spikes.append(float(out.detach().mean()))) for i in (1, 3)]
    for _ in range(2 * STEPS):
        reset_state(model)
        loss = nn.CrossEntropyLoss()(model(zoo.example_input.double()).mean(0), zoo.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for h in hooks:
        h.remove()
    return {"spikes": spikes, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "initial": {n: p.detach().clone() for n, p in build(MODEL).model.double().named_parameters()}}


def _contents(path):
    """Every model and optimizer tensor of a checkpoint, whole, read in this process."""
    import torch.distributed.checkpoint as dcp

    from snn_explorer.core.checkpoints import saved_tensor_metadata

    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved_tensor_metadata(path).items()
             if not k.startswith("rng")}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


@pytest.fixture(scope="module")
def pipeline_round_trips(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp-ckpt")
    refused = {"none": _save(root, "none")}
    part, results = run_on_ranks(_group, 4, str(root), SAVES4, LOADS4, timeout=420)[0]
    refused.update(part)
    part, more = run_on_ranks(_group, 2, str(root), SAVES2, LOADS2, timeout=420)[0]
    refused.update(part)
    results.update(more)
    results.update({(src, dst): _load(root, src, dst) for src, dst in LOADS1})
    return {"root": root, "results": results, "refused": refused, "reference": _reference()}


def test_pipeline_plans_are_loaded_from_and_into_every_other_plan(pipeline_round_trips):
    results = pipeline_round_trips["results"]
    into_pp = {s for s, d in results if PLANS[d][1] == "pp"}
    from_pp = {d for s, d in results if PLANS[s][1] == "pp"}
    assert {"none", "fsdp4", "tp4", "fsdp2", "pp2dp2"} <= into_pp
    assert {"none", "dp2", "fsdp2", "tp2", "fsdp4", "tp4", "pp2dp2_gpipe", "pp2_1f1b"} <= from_pp
    assert {r["stages"] for (s, d), r in results.items() if PLANS[d][1] == "pp"} == {2, 4}  # cut differently


def test_reference_is_not_trivial(pipeline_round_trips):
    ref = pipeline_round_trips["reference"]
    assert all(0.02 <= rate <= 0.98 for rate in ref["spikes"]), ref["spikes"]
    assert all(not torch.equal(ref["params"][k], ref["initial"][k]) for k in ref["params"])


def test_loaded_pipeline_parameters_and_optimizer_state_are_exact(pipeline_round_trips):
    root = pipeline_round_trips["root"]
    for (src, dst), res in pipeline_round_trips["results"].items():
        assert res["differ"] == [], f"{src} -> {dst}: {res['differ']} differ"
        assert (res["step"], res["extra"], res["plan_mode"]) == (STEPS, {"saved": src}, PLANS[src][1])
        saved, again = _contents(root / src), _contents(root / f"{src}~{dst}")
        assert saved.keys() == again.keys() and any(k.endswith(".exp_avg_sq") for k in saved)
        assert "model.net.4.weight" in saved  # the unsharded names of the whole model
        for key in saved:
            assert torch.equal(saved[key], again[key]), f"{src} -> {dst}: {key} differs"


def test_training_resumed_across_pp_and_other_plans_equals_uninterrupted(pipeline_round_trips):
    want = pipeline_round_trips["reference"]["params"]
    for (src, dst), res in pipeline_round_trips["results"].items():
        assert res["continued"].keys() == want.keys()
        for name, value in want.items():
            err = (res["continued"][name] - value).abs().max().item()
            assert err <= TOL, f"{src} -> {dst}: {name} off by {err:.3g} after 3 more steps"


def test_a_pipeline_rank_refuses_to_save_neurons_holding_state(pipeline_round_trips):
    for key in ("pp2dp2", "pp2"):
        assert "neuron state is not at rest" in pipeline_round_trips["refused"][key]
