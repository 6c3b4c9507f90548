"""Every registered TP style through apply (2 real gloo ranks, one spawned group for all cases),
the estimator and the Explorer's tables and shard chart; plan-time refusals of TP plans that
cannot compute (issue 19): tied weights, broken chains, styles of another layer kind, missing gates.
(The tests in one process: tests/unit/test_styles.py.)"""
import pytest
import torch
from distributed_harness import run_on_ranks
from test_styles import CASES, TP, build, example, plan_for
from torch import nn

import snn_explorer as se
from snn_explorer.core.tp import STYLES, TP_STYLES

T, N = 3, 4


def _rates(model: nn.Module, x, y):
    """Spike rate of every neuron in one forward/backward of the unsharded ``model``."""
    import snntorch
    from spikingjelly.activation_based.neuron import BaseNode

    rates = {}
    for name, m in model.named_modules():
        if isinstance(m, (snntorch.SpikingNeuron, BaseNode)):
            m.register_forward_hook(lambda _m, _i, o, name=name: rates.setdefault(name, []).append(float(o.detach().mean())))
    se.core.model.neurons.reset_all(model)
    out = model(x)
    nn.functional.cross_entropy(out.mean(0), y).backward()
    return {k: sum(v) / len(v) for k, v in rates.items()}, out.detach()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _layout_problems(model, fresh, plan, tp_rank):
    """Each sharded tensor's local shape and values against its style's local_shape and held."""
    problems = []
    for path, name in plan.tensor_parallel_plan.items():
        style, module, full = STYLES[name], model.get_submodule(path), fresh.get_submodule(path)
        for leaf in style.split:
            tensor = getattr(module, leaf, None)
            if tensor is None:
                continue
            local, whole = _local(tensor.detach()), getattr(full, leaf).detach()
            if tuple(local.shape) != style.local_shape(leaf, whole.shape, TP):
                problems.append(f"{path}.{leaf}: shape {tuple(local.shape)}")
            dim, index = style.held(leaf, whole.shape, TP, tp_rank)
            if not torch.equal(local, whole.index_select(dim, torch.tensor(index))):
                problems.append(f"{path}.{leaf}: values are not rows {index} of dim {dim}")
    return problems


def _all_cases_on_rank():
    from snn_explorer.estimator.instruments.recorder import CollectiveRecorder

    results = {}
    for case in CASES:
        x, y = example(case)
        rates, ref_out = _rates(ref := build(case), x, y)
        model = build(case)
        plan = plan_for(case, model)
        runtime = se.apply(model=model, plan=plan, device_type="cpu")
        layout = _layout_problems(runtime.module, build(case), plan, runtime.tp_rank)
        recorder = CollectiveRecorder()
        with recorder:
            loss, out = runtime.forward_loss(nn.CrossEntropyLoss(), x, y)
            recorder.phase = "backward"
            loss.backward()
        grads = runtime.full_gradients()
        errors = {"outputs": float((out.detach() - ref_out).abs().max())}
        errors.update({n: float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()})
        results[case] = dict(rates=rates, errors=errors, layout=layout, styles=dict(plan.tensor_parallel_plan),
                             collectives=recorder.table({"tp": runtime.mesh.get_group("tp")}),
                             params_bytes=sum(_local(p).numel() * p.element_size() for p in runtime.module.parameters()))
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_all_cases_on_rank, TP, timeout=240)


def test_every_registered_style_is_exercised(ranks):
    used = {s for res in ranks[0].values() for s in res["styles"].values()}
    assert used == set(STYLES) == set(TP_STYLES)


@pytest.mark.parametrize("case", CASES)
def test_apply_equals_the_single_process(ranks, case):
    rates = ranks[0][case]["rates"]
    assert rates and all(0.02 <= r <= 0.98 for r in rates.values()), f"spike rates make it vacuous: {rates}"
    for rank, res in enumerate(ranks):
        assert res[case]["layout"] == [], f"rank {rank}: {res[case]['layout']}"
        for what, err in res[case]["errors"].items():
            assert err <= 1e-9, f"rank {rank}: {what} differs by {err:.3g}"


@pytest.mark.parametrize("case", CASES)
def test_estimate_matches_the_ranks(ranks, case):
    from snn_explorer.estimator import estimate

    model, (x, y) = build(case), example(case)
    est = estimate(model, plan_for(case, model), example_input=x, labels=y)
    key = lambda rows: sorted((r["kind"], r["phase"], r["count"], r["bytes"]) for r in rows if r["mesh_dim"] == "tp")
    for res in ranks:
        assert key(res[case]["collectives"]) == key(est.collectives.to_dict("records"))
        assert len(res[case]["collectives"]) > 0
    assert (est.per_rank["params_bytes"] == [res[case]["params_bytes"] for res in ranks]).all()
