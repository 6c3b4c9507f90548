"""Distributed checkpoints: save under one plan, load under another, on real gloo ranks.

Two rank groups are spawned once for the module (4 ranks, then 2 ranks); each saves a checkpoint
under every mode it runs, then loads every checkpoint saved so far (its own, the other group's, the
single-process one) under every mode, re-saves what it loaded and trains 3 more steps. The test
process itself saves and loads under mode ``none``. The asserting tests read those results:

- parameters after a load equal the saved ones exactly (``full_parameters`` at save time);
- the re-saved checkpoint holds exactly the saved parameters and optimizer state;
- 3 steps after the load equal 6 uninterrupted single-process steps (float64, within 1e-5), whose
  neurons spike at 2-98 %.
"""
import json
from pathlib import Path

import pytest
import torch
from distributed_harness import run_on_ranks
from torch import nn

pytestmark = pytest.mark.timeout(900)  # the shared rank groups run in the first test's setup

STEPS = 3
TOL = 1e-5
LR = 1e-2

#: plan key -> (topology, mode, zero)
PLANS = {
    "none": ({"dp": 1}, "none", False),
    "dp2": ({"dp": 2}, "dp", False), "zero2": ({"dp": 2}, "dp", True), "tp2": ({"tp": 2}, "tp", False),
    "fsdp2": ({"dp": 2}, "fsdp2", False),
    "dp4": ({"dp": 4}, "dp", False), "zero4": ({"dp": 4}, "dp", True), "tp4": ({"tp": 4}, "tp", False),
    "fsdp4": ({"dp": 4}, "fsdp2", False), "fsdp2_tp": ({"dp": 2, "tp": 2}, "fsdp2_tp", False),
}
MLP4 = ["dp4", "zero4", "tp4", "fsdp4", "fsdp2_tp"]
MLP2 = ["dp2", "zero2", "tp2", "fsdp2"]
#: checkpoints of 4 ranks loaded on 2 (each 4-rank mode once, to another mode)
FOUR_TO_TWO = [("fsdp4", "tp2"), ("zero4", "dp2"), ("fsdp2_tp", "fsdp2"), ("dp4", "zero2"), ("tp4", "tp2")]
#: checkpoints loaded on one process (mode none)
TO_NONE = ["fsdp2_tp", "zero4", "tp2", "fsdp2"]
#: (model, saved under, loaded under) for the VGG (conv TP) and Spikformer (conv + attention TP)
REPRESENTATIVE = [("vgg", "tp2", "fsdp2"), ("vgg", "fsdp2", "tp2"), ("vgg", "tp2", "none"), ("vgg", "none", "tp2"),
                  ("spikformer", "tp2", "dp2"), ("spikformer", "dp2", "tp2"), ("spikformer", "tp2", "none"),
                  ("spikformer", "fsdp2_tp", "tp2")]


def _world(key):
    world = 1
    for size in PLANS[key][0].values():
        world *= size
    return world


def _runtime(name, key):
    import snn_explorer as se
    from snn_explorer.zoo import build

    topology, mode, zero = PLANS[key]
    zoo = build(name)
    model = zoo.model.double()
    features = se.DistributedFeatureSet(allow_zero_optimizer=zero, allow_experimental_conv_tp=True,
                                        allow_experimental_spikformer_tp=True)
    plan = se.plan(analysis=se.analyze(model, model_family=zoo.family), objective="speed", topology=topology,
                   mode=mode, batch_size=zoo.batch_size, features=features)
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    share, start = plan.per_rank_batch, runtime.dp_rank * plan.per_rank_batch
    batch = zoo.example_input.double()[:, start:start + share], zoo.labels[start:start + share]
    return runtime, runtime.build_optimizer(torch.optim.Adam, lr=LR), batch


def _train(runtime, optimizer, batch):
    for _ in range(STEPS):
        optimizer.zero_grad()
        runtime.train_step(nn.CrossEntropyLoss(), *batch)
        optimizer.step()
    runtime.reset_state()


def _is_rank0():
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _save(root, name, key):
    """Train 3 steps under ``key``, save to root/name-key; the saved full parameters go next to it."""
    runtime, optimizer, batch = _runtime(name, key)
    _train(runtime, optimizer, batch)
    runtime.save_checkpoint(Path(root) / f"{name}-{key}", optimizer=optimizer, step=STEPS, extra={"saved": key})
    params = runtime.full_parameters()
    if _is_rank0():
        torch.save(params, Path(root) / f"{name}-{key}.params.pt")


def _load(root, name, src, dst):
    """Load root/name-src under ``dst``; re-save it; train 3 more steps. Returns what the tests check."""
    runtime, optimizer, batch = _runtime(name, dst)
    loaded = runtime.load_checkpoint(Path(root) / f"{name}-{src}", optimizer=optimizer)
    after = runtime.full_parameters()
    saved = torch.load(Path(root) / f"{name}-{src}.params.pt")
    exact = sorted(k for k in saved if not torch.equal(saved[k], after[k]))
    runtime.save_checkpoint(Path(root) / f"{name}-{src}~{dst}", optimizer=optimizer, step=loaded.step)
    _train(runtime, optimizer, batch)
    return {"differ": exact, "step": loaded.step, "extra": loaded.extra, "plan_mode": loaded.plan.mode,
            "continued": runtime.full_parameters(), "tp_plan": dict(runtime.plan.tensor_parallel_plan)}


def _group(root, saves, loads):
    for name, key in saves:
        _save(root, name, key)
    results = {(name, src, dst): _load(root, name, src, dst) for name, src, dst in loads}
    return results if _is_rank0() else None


def _reference(name):
    """6 uninterrupted Adam steps of the unsharded model, with their spike rates."""
    import snntorch

    from snn_explorer.zoo import build, reset_state

    zoo = build(name)
    model = zoo.model.double()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    rates, outputs = {}, []
    def record(name):
        def hook(_module, _inputs, out):
            rates.setdefault(name, []).append(float(out.detach().float().mean()))
        return hook

    hooks = [m.register_forward_hook(record(n)) for n, m in model.named_modules()
             if isinstance(m, snntorch.SpikingNeuron)]
    for _ in range(2 * STEPS):
        reset_state(model)
        out = model(zoo.example_input.double())
        outputs.append(out.detach())
        loss = nn.CrossEntropyLoss()(out.mean(0), zoo.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for h in hooks:
        h.remove()
    return {"rates": {n: sum(r) / len(r) for n, r in rates.items()}, "outputs": outputs,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _contents(path):
    """Every model and optimizer tensor in a checkpoint, whole, read in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata) and not k.startswith("rng")}
    dcp.load(state, checkpoint_id=str(path))
    return state


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    references = {name: _reference(name) for name in ("mlp", "vgg", "spikformer")}
    for name in ("mlp", "vgg", "spikformer"):
        _save(root, name, "none")
    results = {}
    loads4 = [("mlp", src, dst) for src in MLP4 for dst in MLP4 if src != dst] + [("mlp", "none", "fsdp2_tp")]
    loads4 += [c for c in REPRESENTATIVE if _world(c[2]) == 4]
    results.update(run_on_ranks(_group, 4, str(root), [("mlp", k) for k in MLP4] + [("spikformer", "fsdp2_tp")],
                                loads4, timeout=600)[0])
    saves2 = [("mlp", k) for k in MLP2] + sorted({(n, s) for n, s, _ in REPRESENTATIVE if _world(s) == 2})
    loads2 = [("mlp", src, dst) for src in ["none"] + MLP2 for dst in MLP2 if src != dst]
    loads2 += [("mlp", src, dst) for src, dst in FOUR_TO_TWO]
    loads2 += [c for c in REPRESENTATIVE if _world(c[2]) == 2]
    results.update(run_on_ranks(_group, 2, str(root), saves2, loads2, timeout=600)[0])
    for name, src, dst in [("mlp", src, "none") for src in TO_NONE] + [c for c in REPRESENTATIVE if c[2] == "none"]:
        results[(name, src, dst)] = _load(root, name, src, dst)
    return {"root": root, "results": results, "references": references}


def test_every_pair_of_modes_is_covered(round_trips):
    pairs = {(s, d) for n, s, d in round_trips["results"] if n == "mlp"}
    wanted = {(s, d) for s in ["none"] + MLP2 for d in MLP2 if s != d} | {(s, d) for s in MLP4 for d in MLP4 if s != d}
    wanted |= set(FOUR_TO_TWO) | {("none", "fsdp2_tp")} | {(s, "none") for s in TO_NONE}
    assert not wanted - pairs
    tp_styles = {n: set(r["tp_plan"].values()) for (n, s, d), r in round_trips["results"].items() if d == "tp2"}
    assert {"conv_colwise", "conv_rowwise", "norm_local"} <= tp_styles["vgg"]  # channel shards (plain tensors)
    assert {"colwise", "rowwise", "conv_colwise"} <= tp_styles["spikformer"]  # heads and channels


def test_references_are_not_trivial(round_trips):
    for name, ref in round_trips["references"].items():
        assert ref["rates"], f"{name}: no spiking layers recorded"
        for layer, rate in ref["rates"].items():
            assert 0.02 <= rate <= 0.98, f"{name} {layer} spikes at {rate:.3f}: comparison would be vacuous"
        assert ref["outputs"][0].std() > 1e-3, f"{name}: outputs are constant"
        assert not torch.equal(ref["outputs"][STEPS], ref["outputs"][2 * STEPS - 1]), f"{name}: training is idle"


def test_loaded_parameters_equal_the_saved_ones_exactly(round_trips):
    for (name, src, dst), res in round_trips["results"].items():
        assert res["differ"] == [], f"{name} {src} -> {dst}: {res['differ']} differ"
        assert (res["step"], res["extra"], res["plan_mode"]) == (STEPS, {"saved": src}, PLANS[src][1])


def test_optimizer_state_survives_resharding_exactly(round_trips):
    root = round_trips["root"]
    for name, src, dst in round_trips["results"]:
        saved, again = _contents(root / f"{name}-{src}"), _contents(root / f"{name}-{src}~{dst}")
        assert saved.keys() == again.keys(), f"{name} {src} -> {dst}: keys differ"
        assert any(k.endswith(".exp_avg_sq") for k in saved)
        for key in saved:
            assert torch.equal(saved[key], again[key]), f"{name} {src} -> {dst}: {key} differs"


def _trains_like_one_process(name, key):
    """The VGG and Spikformer have BatchNorm: under a plan with dp > 1 each rank normalises its own
    share of the batch (no SyncBatchNorm), so their training differs from one process by design."""
    return name == "mlp" or PLANS[key][0].get("dp", 1) == 1


def test_training_continued_after_load_equals_uninterrupted(round_trips):
    cases = {c: r for c, r in round_trips["results"].items()
             if _trains_like_one_process(c[0], c[1]) and _trains_like_one_process(c[0], c[2])}
    assert {n for n, _, _ in cases} == {"mlp", "vgg", "spikformer"}
    for (name, src, dst), res in cases.items():
        want = round_trips["references"][name]["params"]
        assert res["continued"].keys() == want.keys()
        for param, value in want.items():
            err = (res["continued"][param] - value).abs().max().item()
            assert err <= TOL, f"{name} {src} -> {dst}: {param} off by {err:.3g} after 3 more steps"


def test_checkpoint_directory_holds_manifest_and_no_partial(round_trips):
    root = round_trips["root"]
    assert not [p.name for p in root.iterdir() if p.name.endswith(".partial")]
    manifest = json.loads((root / "mlp-fsdp2_tp" / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["step"], manifest["plan"]["mode"]) == (4, STEPS, "fsdp2_tp")
    assert manifest["tensors"]["net.0.weight"]["dtype"] == "float64"
    assert manifest["optimizer"]["class"] == "Adam"
    assert manifest["torch_version"] == torch.__version__
    assert sorted(manifest["files"]) == sorted(p.name for p in (root / "mlp-fsdp2_tp").iterdir()
                                               if p.name != "manifest.json")
