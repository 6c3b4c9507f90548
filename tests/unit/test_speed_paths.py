"""The estimator's fast paths equal the slow paths they replace, on small models (numbers exact)."""
import copy
import dataclasses
import gc

import pandas as pd
import torch
from models import wide_jelly

import snn_explorer as se
from snn_explorer.core.model import TIME_MAJOR, stateful_modules
from snn_explorer.estimator import estimate
from snn_explorer.estimator.instruments import op_counter
from snn_explorer.estimator.instruments.meter import StorageMeter
from snn_explorer.estimator.instruments.storage import model_state_tensors, state_tensor_ids, total_bytes
from snn_explorer.estimator.memory.spike_compression import compressed_profile
from snn_explorer.estimator.profile import profiling
from snn_explorer.estimator.profile.checkpointed import CheckpointedProfile, held_after_forward, levered_profile
from snn_explorer.estimator.profile.profiling import SIZES, ModelProfile, model_profile
from snn_explorer.estimator.profile.step import batch_slice, forward_loss
from snn_explorer.estimator.timing.compute_work import counted_pass, counted_points
from snn_explorer.zoo import build
from snn_explorer.zoo.llm import build_llm, token_batch


def _counts(model, x, y) -> list:
    """Forward and backward counts of one step, in the state counted_pass counts in (after a forward at this size)."""
    counts = counted_pass(model, x, y)
    model.zero_grad(set_to_none=True)
    return counts


def test_flops_cached_by_shape_equal_each_formula_called(monkeypatch):
    """OpCounter's FLOPs, looked up per operator and shapes, equal those of calling torch's formula for every
    operator, on a spiking transformer (matrix products, attention) forward and backward with spikes firing."""
    zoo = build("spikformer")
    x, y = batch_slice(zoo.example_input, zoo.labels, 2, 2)
    spikes = []
    neuron = next(m for _, m in stateful_modules(zoo.model))
    handle = neuron.register_forward_hook(lambda m, i, out: spikes.append(float(out.detach().sum())))
    _counts(zoo.model, x, y)  # the model's first step (lazily created state) is not the one compared
    handle.remove()
    op_counter._FLOPS_OF_SHAPES.clear()
    cold = _counts(zoo.model, x, y)
    warm = _counts(zoo.model, x, y)  # every shape seen: all from the cache
    monkeypatch.setattr(op_counter, "flop_formula_reads_shapes_only", lambda formula: False)
    called = _counts(zoo.model, x, y)
    assert cold[0][0] > 0 and cold[1][0] > cold[0][0] and spikes and all(s > 0 for s in spikes)
    assert cold == warm == called
    assert len(op_counter._FLOPS_OF_SHAPES) > 0


def test_shape_key_tells_lists_tuples_and_tensors_apart():
    t = torch.zeros(2, 3)
    assert op_counter.shape_key((t, [1, 2])) != op_counter.shape_key((t, (1, 2)))
    assert op_counter.shape_key(t) == op_counter.shape_key(torch.ones(2, 3)) != op_counter.shape_key(torch.ones(3, 2))


def test_counted_points_with_one_warm_up_per_batch_size_equal_a_warm_up_before_each():
    """count_work's counts at the profile's sizes, warming the neuron state once per batch size, equal those of
    warming it before every size (snntorch's Leaky in the zoo MLP, spikingjelly's multi-step LIF)."""
    zoo = build("mlp")
    for name, (model, x, labels) in (("mlp", (zoo.model, zoo.example_input, zoo.labels)), ("jelly", wide_jelly())):
        profile = model_profile(model, x, labels)
        fast = counted_points(profile.model, profile)
        slow = []
        for n, t in SIZES:
            x, y = batch_slice(profile.example_input, profile.labels, n, t, layout=profile.layout)
            slow.append(counted_pass(profile.model, x.to(profile.dtype), y, warm_up=True))
        assert fast == slow, name
        assert all(point[0][0] > 0 and point[1][3] > 0 for point in fast), name


def _held_after_a_training_step(model, x, labels):
    """held_after_forward as it was: warmed up by a whole forward and backward instead of a forward without
    autograd, then the same measurement."""
    forward_loss(model, x, labels).backward()
    model.zero_grad(set_to_none=True)
    state_ids = state_tensor_ids(model)
    meter = StorageMeter()
    meter.track([t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in state_ids] + [x])
    with meter:
        entry = meter.current
        loss = forward_loss(model, x, labels)
        gc.collect()
        held = meter.current - entry
    state = total_bytes(model_state_tensors(model))
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(max(0, held - state)), float(state)


def test_held_after_forward_warmed_without_autograd_equals_warmed_by_a_step():
    """The bytes a checkpointed (and a spike-compressed) model's forward leaves for backward, and its neuron state,
    are the same after a warm-up forward without autograd as after a whole training step."""
    zoo = build("spikformer")
    base = model_profile(zoo.model, zoo.example_input, zoo.labels)
    x, y = batch_slice(base.example_input, base.labels, 2, 3)
    gates = se.DistributedFeatureSet(allow_activation_checkpointing=True, allow_spike_compression=True)
    plain = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 2}, batch_size=4,
                    features=gates)
    for c, k, s in (("blocks", 1, False), ("blocks", 2, True), ("none", 1, True)):
        p = dataclasses.replace(plain, activation_checkpointing=c, checkpoint_every=k, spike_compression=s)
        profile = levered_profile(base, p)
        profile = compressed_profile(profile) if p.spike_compression else profile
        model = profile.rank_model(None, 1)[1]
        slow = _held_after_a_training_step(model, x, y)
        assert held_after_forward(model, x, y) == slow and slow[0] > 0 and slow[1] > 0, p


def test_a_bf16_plan_estimated_without_the_fp32_profile_equals_one_estimated_from_it():
    """estimate() of a bf16 plan without a profile measures the model in bf16 directly (the fp32 runs it would
    not read are skipped): per-rank memory, collectives and step time equal those from the fp32 profile's
    precision_profile, for FSDP2 (parameters gathered in bf16) and DDP, on the tiny spiking LLM and the zoo MLP."""
    gate = se.DistributedFeatureSet(allow_mixed_precision=True)
    zoo = build("mlp")
    torch.manual_seed(0)
    llm = build_llm("spiking-llm-tiny", tied_embeddings=False)
    for name, model, x, labels, layout in (("mlp", zoo.model, zoo.example_input, zoo.labels, None),
                                           ("llm", llm, token_batch(llm.config, 3, 4, 8), None, TIME_MAJOR)):
        analysis = se.analyze(model)
        for mode in ("fsdp2", "dp"):
            p = se.plan(analysis=analysis, objective="speed", topology={"dp": 2}, batch_size=x.shape[1], mode=mode,
                        features=gate, options=se.PlanOptions(precision="bf16"))
            kw = dict(example_input=x, labels=labels, hardware="H100-SXM", layout=layout)
            own = copy.deepcopy(model)
            direct = estimate(own, p, **kw)
            assert {pr.precision.name for pr in profiling._CACHE[own].values()} == {"bf16"}  # no fp32 runs
            twin = copy.deepcopy(model)
            from_fp32 = estimate(twin, p, profile=model_profile(twin, x, labels, layout=direct.data_layout), **kw)
            assert direct.peak_bytes > 0 and direct.step_time_s > 0, (name, mode)
            for table in ("per_rank", "collectives", "time"):
                pd.testing.assert_frame_equal(getattr(direct, table), getattr(from_fp32, table), check_exact=True)


def test_recompute_fraction_with_the_plain_flops_shared_equals_its_own_count():
    """The checkpointed profiles of one profile share the plain model's FLOPs: each granularity's recompute
    fraction equals that of a checkpointed profile counting them itself (blocks every 1st and 2nd, spikformer)."""
    zoo = build("spikformer")
    base = model_profile(zoo.model, zoo.example_input, zoo.labels)
    gates = se.DistributedFeatureSet(allow_activation_checkpointing=True)
    plain = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 2}, batch_size=4,
                    features=gates)
    fractions = []
    for every in (1, 2):
        p = dataclasses.replace(plain, activation_checkpointing="blocks", checkpoint_every=every)
        shared = levered_profile(base, p).recompute_fraction(2, 3)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelProfile)}
        fields.update(peaks={}, logs={}, replicas={}, saved_state={}, step_counts=())
        alone = CheckpointedProfile(**fields, plan=p).recompute_fraction(2, 3)
        assert shared == alone > 0, every
        fractions.append(shared)
    assert fractions[0] > fractions[1]  # every 2nd block recomputes less
    assert len(base.__dict__["_plain_flops"]) == 1
