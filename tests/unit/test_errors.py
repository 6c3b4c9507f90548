"""Bad inputs: each raises a specific exception type whose message names the bad value."""
from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from models import MLP, leaky
from torch import nn

from snn_explorer import (
    DistributedFeatureSet,
    SNNDistributedAnalysis,
    SNNDistributedPlan,
    SNNDistributedRuntime,
    SNNDistributedTopology,
    analyze,
    apply,
    plan,
    preflight,
    recommend_snn_distributed_strategy,
    register_stateful,
)
from snn_explorer.core.planning import split_options

# ---- models and helpers ------------------------------------------------------------------------


def conv_net():
    """A conv 'features' stack (no Linear) and a Linear classifier."""
    m = nn.Module()
    m.features = nn.Sequential(nn.Conv2d(2, 4, 3), leaky(), nn.Conv2d(4, 4, 3))
    m.classifier = nn.Linear(4, 4)
    return m


def conv_only():
    return nn.Sequential(nn.Conv2d(2, 4, 3), leaky(), nn.Conv2d(4, 4, 3))


def mk(objective="speed", topology=1, neuron_backend="torch", batch_size=8, model=None, roots=None, **kw):
    a = analyze(MLP() if model is None else model, roots=roots)
    return plan(analysis=a, objective=objective, topology=topology, neuron_backend=neuron_backend,
                batch_size=batch_size, **split_options(kw))


def _tied_chain():
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    return nn.Sequential(first, nn.ReLU(), last, nn.ReLU())


def P(**kw):
    """SNNDistributedPlan with sane defaults, overridden by ``kw``."""
    args = dict(mode="none", objective="speed", topology={"dp": 1}, batch_size=8)
    args.update(kw)
    return SNNDistributedPlan(**args)


def topo(dims, world_size=None):
    return SNNDistributedTopology.from_mapping(dims, world_size)


def none_runtime():
    model = MLP()
    return apply(model=model, plan=mk(), device_type="cpu")


def dp_runtime():
    """A runtime for a 2-rank dp plan, built directly (prepare_dataloader checks before any collective)."""
    model = MLP()
    p = P(mode="dp", topology={"dp": 2}, batch_size=8)
    return SNNDistributedRuntime(model=model, mesh=None, analysis=analyze(model), plan=p)


def tp_plan_missing_module():
    return P(mode="tp", objective="memory", topology={"tp": 2}, tensor_parallel_plan={"missing.fc": "colwise"})


def lit(value) -> str:
    """Regex matching the repr of ``value`` literally."""
    return re.escape(repr(value))


# ---- the table ---------------------------------------------------------------------------------
# Each entry: (callable, exception type, regex that must occur in the message).

CASES = [
    # objective
    pytest.param(lambda: mk(objective="fast"), ValueError, lit("fast"), id="objective-fast"),
    pytest.param(lambda: mk(objective=None), ValueError, r"objective=None", id="objective-None"),
    pytest.param(lambda: mk(objective=3), ValueError, r"objective=3\b", id="objective-int"),
    pytest.param(lambda: P(objective="throughput"), ValueError, lit("throughput"), id="plan-objective"),
    pytest.param(lambda: recommend_snn_distributed_strategy(world_size=2, prefer="cheap"), ValueError, lit("cheap"),
                 id="recommend-prefer"),
    # mode
    pytest.param(lambda: mk(mode="ddp"), ValueError, lit("ddp"), id="mode-ddp"),
    pytest.param(lambda: mk(mode="fsdp"), ValueError, lit("fsdp"), id="mode-fsdp"),
    pytest.param(lambda: mk(mode=2), ValueError, r"mode=2\b", id="mode-int"),
    pytest.param(lambda: P(mode="zero"), ValueError, re.escape("unsupported mode='zero'"), id="plan-mode"),
    pytest.param(lambda: mk(mode="pp", topology={"pp": 2, "tp": 2}), ValueError, r"use mode .pp_tp.",
                 id="plan()-pp-with-tp"),
    pytest.param(lambda: mk(mode="fsdp2", topology={"pp": 2, "dp": 2}), ValueError,
                 r"with pp=2 use mode .pp_fsdp2. \(stages FSDP2-sharded over dp\)",
                 id="plan()-fsdp2-with-pp"),
    pytest.param(lambda: mk(mode="PP", topology={"dp": 2}), ValueError,
                 r"mode='pp' cannot be applied: mode 'pp' needs the dim\(s\) \['pp'\]",
                 id="plan()-PP-without-pp-dim"),
    pytest.param(lambda: mk(mode="pp", topology={"pp": 8}), ValueError,
                 re.escape("pp=8 = 8 stages, but the model has only 4 pipeline unit(s)"), id="plan()-pp-more-stages-than-units"),
    pytest.param(lambda: mk(mode="pp", topology={"pp": 2}, model=nn.Sequential(nn.Linear(2, 2)).eval()), ValueError,
                 re.escape("pp=2 = 2 stages, but the model has only 1 pipeline unit(s)"), id="plan()-pp-one-unit"),
    pytest.param(lambda: mk(mode="pp", topology={"pp": 2}, pp_microbatches=3), ValueError,
                 re.escape("pp_microbatches=3 does not divide the per-rank batch 8"), id="plan()-pp-microbatches"),
    pytest.param(lambda: mk(mode="pp", topology={"pp": 2}, pp_microbatches=2, pp_virtual_stages=2), ValueError,
                 re.escape("pp_microbatches=2 is fewer than pp * virtual stages = 2 * 2 = 4"), id="plan()-pp-too-few"),
    pytest.param(lambda: mk(mode="pp", topology={"pp": 2}, pp_layout="1|1|1", pp_virtual_stages=1), ValueError,
                 re.escape("pp_layout='1|1|1' has 3 stage(s) of 3 unit(s), but the plan needs 2"),
                 id="plan()-pp-layout"),
    pytest.param(lambda: mk(mode="pp", topology={"pp": 2}, model=_tied_chain(), pp_virtual_stages=1), ValueError,
                 re.escape("the tied parameter ['0.weight', '2.weight'] would be split over pipeline stages [0, 1]"),
                 id="plan()-pp-tied-over-stages"),
    pytest.param(lambda: mk(mode="pp", topology={"pp": 2}, pp_schedule="zb"), ValueError,
                 re.escape("pp_schedule='zb'"), id="plan()-pp-schedule"),
    pytest.param(lambda: P(mode="pp", topology={"pp": 2}, pp_schedule="gpipe", pp_microbatches=2,
                           pp_virtual_stages=2), ValueError, r"pp_schedule='gpipe' runs one stage per rank",
                 id="Plan-pp-gpipe-virtual"),
    pytest.param(lambda: P(mode="pp", topology={"pp": 2}, pp_schedule="zbv", pp_microbatches=6,
                           pp_virtual_stages=3, batch_size=6), ValueError,
                 re.escape("pp_schedule='zbv' needs exactly pp_virtual_stages=2 (got 3)"), id="Plan-pp-zbv-virtual"),
    pytest.param(lambda: P(mode="pp", topology={"pp": 2}, pp_schedule="interleaved_zb", pp_microbatches=5,
                           pp_virtual_stages=2, batch_size=5), ValueError,
                 re.escape("pp_microbatches=5 must be a multiple of 2"), id="Plan-pp-zb-rounds"),
    pytest.param(lambda: P(mode="dp", topology={"dp": 2}, pp_microbatches=2), ValueError,
                 re.escape("pipeline fields {'pp_microbatches': 2} are only used by modes 'pp', 'pp_tp', 'pp_fsdp2' and 'pp_fsdp2_tp'"), id="Plan-dp-pp-fields"),
    pytest.param(lambda: mk(mode="none", topology={"dp": 2}), ValueError, r"mode='none'.*world_size=2",
                 id="mode-none-on-2-ranks"),
    pytest.param(lambda: P(mode="tp", topology={"dp": 2}, tensor_parallel_plan={"head": "colwise"}), ValueError,
                 r"mode 'tp' needs the dim\(s\) \['tp'\]", id="Plan-tp-without-tp-dim"),
    pytest.param(lambda: P(mode="dp", topology={"dp": 2, "tp": 2}), ValueError,
                 re.escape("mode 'dp' uses only the dim(s) ['dp']; the dim(s) {'tp': 2}"), id="Plan-dp-with-idle-tp"),
    pytest.param(lambda: mk(mode="dp", topology={"dp": 2, "x": 3}, batch_size=6), ValueError, re.escape("{'x': 3}"),
                 id="plan()-dp-with-idle-dim"),
    # explicit fsdp2_tp without dp and tp
    pytest.param(lambda: mk(mode="fsdp2_tp", topology={"dp": 4}), ValueError,
                 r"mode='fsdp2_tp'.*\['tp'\]", id="fsdp2_tp-on-dp-only"),
    pytest.param(lambda: mk(mode="fsdp2_tp", topology={"tp": 4}), ValueError,
                 r"mode='fsdp2_tp'.*\['dp'\]", id="fsdp2_tp-on-tp-only"),
    pytest.param(lambda: mk(mode="fsdp2_tp", topology={"pp": 2, "ep": 2}), ValueError,
                 r"mode='fsdp2_tp'.*\['dp', 'tp'\]", id="fsdp2_tp-on-other-dims"),
    # TP without Linear candidates
    pytest.param(lambda: mk(mode="tp", objective="memory", topology={"tp": 2}, model=conv_net(), roots=["features"]),
                 ValueError, r"mode='tp'.*no Linear.*" + re.escape("('features',)"), id="tp-conv-only-roots"),
    pytest.param(lambda: mk(mode="fsdp2_tp", topology={"dp": 2, "tp": 2}, model=conv_only()), ValueError,
                 r"mode='fsdp2_tp'.*no Linear", id="fsdp2_tp-conv-only-model"),
    pytest.param(lambda: mk(objective="memory", topology={"tp": 2}, model=conv_only()), ValueError,
                 re.escape("no mode fits topology {'tp': 2} for this model: "
                           "tp: mode 'tp' needs tensor-parallel candidates"),
                 id="memory-tp-conv-only-model"),
    pytest.param(lambda: P(mode="tp", objective="memory", topology={"tp": 2}), ValueError,
                 r"mode 'tp' needs a non-empty tensor_parallel_plan", id="Plan-tp-without-tp-plan"),
    pytest.param(lambda: P(mode="dp", topology={"dp": 2}, tensor_parallel_plan={"head": "colwise"}), ValueError,
                 r"not 'dp'", id="Plan-dp-with-tp-plan"),
    # bad explicit tensor_parallel_plan
    pytest.param(lambda: mk(mode="tp", topology={"tp": 2}, tensor_parallel_plan={}), ValueError,
                 re.escape("tensor_parallel_plan={}"), id="tp-plan-empty"),
    pytest.param(lambda: mk(mode="tp", topology={"tp": 2}, tensor_parallel_plan=["head"]), ValueError,
                 re.escape("tensor_parallel_plan=['head'] must be"), id="tp-plan-list"),
    pytest.param(lambda: mk(mode="tp", topology={"tp": 2}, tensor_parallel_plan="head"), ValueError,
                 re.escape("tensor_parallel_plan='head' must be"), id="tp-plan-str"),
    pytest.param(lambda: mk(mode="tp", topology={"tp": 2}, tensor_parallel_plan={"nope": "colwise"}), ValueError,
                 re.escape("tensor_parallel_plan key 'nope' is not a tensor-parallel candidate"),
                 id="tp-plan-unknown-key"),
    pytest.param(lambda: mk(topology={"tp": 2}, tensor_parallel_plan={"body.9": "rowwise"}), ValueError,
                 re.escape("tensor_parallel_plan key 'body.9' is not a tensor-parallel candidate"),
                 id="tp-plan-unknown-key-no-mode"),
    pytest.param(lambda: mk(mode="tp", topology={"tp": 2}, tensor_parallel_plan={"head": "diagonal"}), ValueError,
                 lit("diagonal"), id="tp-plan-unknown-style"),
    pytest.param(lambda: mk(mode="tp", topology={"tp": 2}, tensor_parallel_plan={"head": None}), ValueError,
                 re.escape("['head']=None"), id="tp-plan-style-None"),
    pytest.param(lambda: mk(mode="tp", topology={"tp": 2}, tensor_parallel_plan={"head": "local"}), ValueError,
                 re.escape("['head']='local'"), id="tp-plan-local-on-linear"),
    pytest.param(lambda: mk(mode="dp", topology={"dp": 2}, tensor_parallel_plan={"head": "colwise"}), ValueError,
                 re.escape("tensor_parallel_plan is only used by modes 'tp', 'fsdp2_tp', 'pp_tp' and 'pp_fsdp2_tp', not mode='dp'"),
                 id="tp-plan-with-mode-dp"),
    pytest.param(lambda: mk(mode="fsdp2", topology={"dp": 2}, tensor_parallel_plan={"head": "colwise"}), ValueError,
                 r"not mode='fsdp2'", id="tp-plan-with-mode-fsdp2"),
    # TP size that does not divide a feature count
    pytest.param(lambda: mk(mode="tp", objective="memory", topology={"tp": 4}), ValueError,
                 re.escape("mode='tp' cannot be applied: tp=4 does not divide head.out_features=10"),
                 id="tp4-head-out"),
    pytest.param(lambda: mk(objective="memory", topology={"tp": 4}), ValueError,
                 re.escape("no mode fits topology {'tp': 4}")
                 + ".*" + re.escape('tp: tp=4 does not divide head.out_features=10'),
                 id="tp4-head-out-no-mode"),
    pytest.param(lambda: mk(mode="tp", objective="memory", topology={"tp": 3}, tensor_parallel_plan={"body.2": "rowwise"}),
                 ValueError, re.escape("tp=3 does not divide body.2.in_features=16"), id="tp3-rowwise-in"),
    pytest.param(lambda: mk(mode="fsdp2_tp", topology={"dp": 2, "tp": 3}, batch_size=6,
                            tensor_parallel_plan={"body.0": "colwise", "body.2": "rowwise"}),
                 ValueError, re.escape("tp=3 does not divide body.0.out_features=16"), id="tp3-colwise-out"),
    # topology
    pytest.param(lambda: topo({"dp": Decimal("2")}), TypeError, re.escape("Decimal('2')"), id="topo-Decimal"),
    pytest.param(lambda: topo({"dp": Fraction(2)}), TypeError, re.escape("Fraction(2, 1)"), id="topo-Fraction"),
    pytest.param(lambda: topo({"dp": "2"}), TypeError, r"size '2' of type str", id="topo-str"),
    pytest.param(lambda: topo({"dp": 2.5}), ValueError, r"size 2\.5", id="topo-2.5"),
    pytest.param(lambda: topo({"tp": float("nan")}), ValueError, r"size nan", id="topo-nan"),
    pytest.param(lambda: topo({"tp": float("inf")}), ValueError, r"size inf", id="topo-inf"),
    pytest.param(lambda: topo({"dp": True}), TypeError, re.escape("topology dim 'dp' has size True of type bool"),
                 id="topo-True"),
    pytest.param(lambda: topo({"dp": 2, "tp": False}), TypeError, r"'tp' has size False", id="topo-False"),
    pytest.param(lambda: topo({"dp": None}), TypeError, r"size None", id="topo-None"),
    pytest.param(lambda: topo({"dp": 0}), ValueError, r"'dp' has size 0\b", id="topo-zero"),
    pytest.param(lambda: topo({"dp": -2}), ValueError, r"'dp' has size -2\b", id="topo-negative"),
    pytest.param(lambda: topo({"dp": -1.0}), ValueError, r"size -1\b", id="topo-negative-float"),
    pytest.param(lambda: topo({}), ValueError, r"dims are empty", id="topo-empty"),
    pytest.param(lambda: topo([("dp", 2)]), TypeError, re.escape("[('dp', 2)]"), id="topo-list"),
    pytest.param(lambda: topo({1: 2}), TypeError, r"got 1 \(int\)", id="topo-name-int"),
    pytest.param(lambda: topo({None: 2}), TypeError, r"got None \(NoneType\)", id="topo-name-None"),
    pytest.param(lambda: topo({"": 2}), ValueError, re.escape("topology dim names must be non-empty, got ''"),
                 id="topo-name-empty"),
    pytest.param(lambda: topo({"  ": 2}), ValueError, r"got '  '", id="topo-name-blank"),
    pytest.param(lambda: topo({"dp": 2, "tp": 2}, world_size=3), ValueError, r"multiply to 4, but world_size=3",
                 id="topo-product-mismatch"),
    pytest.param(lambda: topo({"dp": 2}, world_size=True), TypeError, r"'world_size' has size True",
                 id="topo-world-size-bool"),
    pytest.param(lambda: topo({"dp": 2}, world_size=0), ValueError, r"'world_size' has size 0",
                 id="topo-world-size-zero"),
    pytest.param(lambda: SNNDistributedTopology.coerce(0), ValueError, r"'dp' has size 0", id="topo-coerce-0"),
    pytest.param(lambda: mk(topology=True), TypeError, r"got bool: True", id="plan-topology-True"),
    pytest.param(lambda: mk(topology={"dp": 2.5}), ValueError, r"size 2\.5", id="plan-topology-2.5"),
    pytest.param(lambda: mk(topology="dp=2"), TypeError, lit("dp=2"), id="plan-topology-str"),
    # analysis
    pytest.param(lambda: analyze(MLP(), roots=""), ValueError, r"empty path ''", id="roots-empty-str"),
    pytest.param(lambda: analyze(MLP(), roots=["body", ""]), ValueError, r"empty path ''", id="roots-empty-item"),
    pytest.param(lambda: analyze(MLP(), roots=["nope"]), KeyError, r"root 'nope'", id="roots-unknown"),
    pytest.param(lambda: analyze(MLP(), roots=["body.9"]), KeyError, r"root 'body\.9'", id="roots-unknown-nested"),
    pytest.param(lambda: analyze(MLP(), roots=[3]), TypeError, re.escape('roots must be module paths (str), got 3'),
                 id="roots-int"),
    pytest.param(lambda: analyze("MLP"), TypeError, re.escape('analyze expects a torch.nn.Module, got str'),
                 id="analyze-str"),
    pytest.param(lambda: analyze(None), TypeError, r"got NoneType", id="analyze-None"),
    pytest.param(lambda: analyze(MLP, ), TypeError, r"got type", id="analyze-class-not-instance"),
    pytest.param(lambda: analyze(MLP(), model_family=""), ValueError,
                 re.escape("model_family must be a non-empty string or None, got ''"),
                 id="family-empty"),
    pytest.param(lambda: analyze(MLP(), model_family=7), ValueError, r"got 7\b", id="family-int"),
    pytest.param(lambda: analyze(MLP()).shape("body.1"), KeyError, r"'body\.1' is not a Linear", id="shape-neuron"),
    pytest.param(lambda: plan(analysis={"kind": "analysis"}, objective="speed", topology=1, neuron_backend="torch",
                              batch_size=1), TypeError, re.escape('analysis must come from analyze(), got dict'),
                 id="plan-analysis-dict"),
    # ZeRO outside pure dp
    pytest.param(lambda: P(mode="fsdp2", topology={"dp": 2}, optimizer_strategy="zero"), ValueError,
                 r"not 'fsdp2'", id="zero-fsdp2"),
    pytest.param(lambda: P(mode="tp", topology={"tp": 2}, optimizer_strategy="zero",
                           tensor_parallel_plan={"head": "colwise_gather"}), ValueError, r"not 'tp'", id="zero-tp"),
    pytest.param(lambda: P(mode="none", optimizer_strategy="zero"), ValueError, r"not 'none'", id="zero-none"),
    pytest.param(lambda: P(mode="dp", topology={"dp": 2}, optimizer_strategy="adam"), ValueError, lit("adam"),
                 id="optimizer-strategy-unknown"),
    # batch size
    pytest.param(lambda: mk(batch_size=0), ValueError,
                 re.escape('batch_size=0 must be a positive int (the global batch of one step)'),
                 id="batch-0"),
    pytest.param(lambda: mk(batch_size=-1), ValueError, r"batch_size=-1\b", id="batch-negative"),
    pytest.param(lambda: mk(batch_size=True), ValueError,
                 re.escape('batch_size=True must be a positive int (the global batch of one step)'),
                 id="batch-True"),
    pytest.param(lambda: mk(batch_size=2.5), ValueError,
                 re.escape('batch_size=2.5 must be a positive int (the global batch of one step)'),
                 id="batch-2.5"),
    pytest.param(lambda: mk(batch_size=8.0), ValueError, r"batch_size=8\.0", id="batch-8.0"),
    pytest.param(lambda: mk(batch_size="8"), ValueError, r"batch_size='8'", id="batch-str"),
    pytest.param(lambda: mk(batch_size=None), ValueError, r"batch_size=None", id="batch-None"),
    pytest.param(lambda: mk(topology={"dp": 2}, batch_size=3), ValueError,
                 re.escape('batch_size=3 (global) is not divisible by dp=2; use a multiple of 2'),
                 id="batch-not-divisible-dp"),
    pytest.param(lambda: mk(objective="memory", topology={"dp": 2, "tp": 2}, batch_size=5), ValueError,
                 r"batch_size=5 .*dp=2", id="batch-not-divisible-fsdp2_tp"),
    pytest.param(lambda: P(mode="fsdp2", topology={"dp": 4}, batch_size=6), ValueError, r"batch_size=6 .*dp=4",
                 id="Plan-batch-not-divisible"),
    pytest.param(lambda: P(batch_size=0), ValueError,
                 re.escape('batch_size=0 must be a positive int (the global batch of one step)'),
                 id="Plan-batch-0"),
    pytest.param(lambda: recommend_snn_distributed_strategy(world_size=2, batch_size=-3), ValueError,
                 r"batch_size=-3", id="recommend-batch"),
    # backend
    pytest.param(lambda: mk(neuron_backend="jax"), ValueError, lit("jax"), id="backend-jax"),
    pytest.param(lambda: mk(neuron_backend="nccl"), ValueError, lit("nccl"),
                 id="backend-nccl-is-not-a-neuron-backend"),
    pytest.param(lambda: mk(neuron_backend="gloo"), ValueError, lit("gloo"), id="backend-gloo"),
    pytest.param(lambda: mk(neuron_backend=None), ValueError, r"neuron_backend=None", id="backend-None"),
    pytest.param(lambda: P(neuron_backend="cuda"), ValueError, re.escape("unsupported neuron_backend='cuda'"),
                 id="Plan-backend"),
    pytest.param(lambda: mk(neuron_backend="cupy"), ValueError, r"backend='cupy'.*'body\.1'",
                 id="cupy-with-snntorch"),
    pytest.param(lambda: mk(neuron_backend="triton", topology={"dp": 2}), ValueError, r"backend='triton'.*'body\.1'",
                 id="triton-with-snntorch"),
    pytest.param(lambda: recommend_snn_distributed_strategy(world_size=2, neuron_backend="tensorflow"), ValueError,
                 lit("tensorflow"), id="recommend-backend"),
    # recommend world size
    pytest.param(lambda: recommend_snn_distributed_strategy(world_size=0), ValueError, r"world_size=0\b",
                 id="recommend-ws-0"),
    pytest.param(lambda: recommend_snn_distributed_strategy(world_size=True), ValueError, r"world_size=True",
                 id="recommend-ws-True"),
    pytest.param(lambda: recommend_snn_distributed_strategy(world_size=2.0), ValueError, r"world_size=2\.0",
                 id="recommend-ws-float"),
    # memopt level
    pytest.param(lambda: P(memopt_level=2), ValueError, r"memopt_level=2\b", id="memopt-2"),
    pytest.param(lambda: P(memopt_level=-1), ValueError, r"memopt_level=-1\b", id="memopt-negative"),
    pytest.param(lambda: P(memopt_level="1"), ValueError, r"memopt_level='1'", id="memopt-str"),
    pytest.param(lambda: P(memopt_level=None), ValueError, r"memopt_level=None", id="memopt-None"),
    pytest.param(lambda: P(memopt_level=True), (TypeError, ValueError), r"memopt_level=True", id="memopt-True"),
    pytest.param(lambda: P(memopt_level=1.0), (TypeError, ValueError), r"memopt_level=1\.0", id="memopt-1.0"),
    # feature set
    pytest.param(lambda: DistributedFeatureSet(allow_zero_optimizer=1), TypeError,
                 r"allow_zero_optimizer must be a bool, got 1\b", id="features-zero-int"),
    pytest.param(lambda: DistributedFeatureSet(allow_zero_optimizer="no"), TypeError,
                 r"allow_zero_optimizer must be a bool, got 'no'", id="features-zero-str"),
    pytest.param(lambda: DistributedFeatureSet(allow_experimental_conv_tp=None), TypeError,
                 r"allow_experimental_conv_tp must be a bool, got None", id="features-conv-None"),
    pytest.param(lambda: DistributedFeatureSet(allow_experimental_spikformer_tp=0), TypeError,
                 r"allow_experimental_spikformer_tp must be a bool, got 0\b", id="features-spikformer-int"),
    pytest.param(lambda: mk(features={"allow_zero_optimizer": False}), TypeError,
                 re.escape("{'allow_zero_optimizer': False}"), id="plan-features-dict"),
    # from_dict with the wrong kind
    pytest.param(lambda: SNNDistributedPlan.from_dict(analyze(MLP()).to_dict()), ValueError, r"got kind='analysis'",
                 id="plan-from-analysis-dict"),
    pytest.param(lambda: SNNDistributedAnalysis.from_dict(mk().to_dict()), ValueError,
                 re.escape("expected serialised 'analysis', got kind='plan'"), id="analysis-from-plan-dict"),
    pytest.param(lambda: DistributedFeatureSet.from_dict({"kind": "plan", "allow_zero_optimizer": True}), ValueError,
                 re.escape("expected serialised 'features', got kind='plan'"), id="features-from-plan-dict"),
    pytest.param(lambda: SNNDistributedPlan.from_dict({**mk().to_dict(), "kind": "Plan"}), ValueError,
                 r"got kind='Plan'", id="plan-kind-case"),
    pytest.param(lambda: SNNDistributedPlan.from_dict([("kind", "plan")]), TypeError,
                 re.escape('expected a mapping for plan, got list'), id="plan-from-list"),
    # register_stateful
    pytest.param(lambda: register_stateful(int), TypeError, re.escape("<class 'int'>"), id="register-non-module"),
    pytest.param(lambda: register_stateful(nn.Linear), TypeError, r"Linear has no reset\(\)",
                 id="register-without-reset"),
    pytest.param(lambda: register_stateful(nn.Linear, reset=3), TypeError, re.escape('reset must be callable, got 3'),
                 id="register-bad-reset"),
    # apply / preflight without a process group
    pytest.param(lambda: apply(model=MLP(), plan=mk(), device_type="tpu"), ValueError, lit("tpu"), id="apply-tpu"),
    pytest.param(lambda: apply(model=MLP(), plan=mk(), device_type="cuda"), ValueError,
                 re.escape("device_type='cuda' but CUDA is not available"), id="apply-cuda-without-cuda",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
    pytest.param(lambda: apply(model=MLP(), plan=mk(topology={"dp": 2}), device_type="cpu"), RuntimeError,
                 r"mode 'dp' needs torch\.distributed initialised with 2", id="apply-dp-no-pg"),
    pytest.param(lambda: apply(model=MLP(), plan=mk(objective="memory", topology={"dp": 2}), device_type="cpu"),
                 RuntimeError, r"mode 'fsdp2' needs torch\.distributed", id="apply-fsdp2-no-pg"),
    pytest.param(lambda: apply(model=MLP(), plan=mk(objective="memory", topology={"tp": 2}), device_type="cpu"),
                 RuntimeError, r"mode 'tp' needs torch\.distributed", id="apply-tp-no-pg"),
    pytest.param(lambda: apply(model=MLP(), plan=mk(objective="memory", topology={"dp": 2, "tp": 2}),
                               device_type="cpu"),
                 RuntimeError, r"mode 'fsdp2_tp' needs torch\.distributed initialised with 4", id="apply-2d-no-pg"),
    pytest.param(lambda: preflight(MLP(), tp_plan_missing_module()), ValueError, lit("missing.fc"),
                 id="preflight-tp-module-missing"),
    pytest.param(lambda: apply(model=MLP(), plan=tp_plan_missing_module(), device_type="cpu"), ValueError,
                 lit("missing.fc"), id="apply-tp-module-missing"),
    pytest.param(lambda: preflight(nn.Sequential(nn.Linear(8, 6)), mk(objective="memory", topology={"tp": 2})),
                 ValueError, re.escape("tensor_parallel_plan key 'body.0' is not a tensor-parallel candidate; "
                                      "candidates: ('0',)"),
                 id="preflight-plan-for-other-model"),
    pytest.param(lambda: preflight(MLP(), P(mode="fsdp2", topology={"dp": 2}, fsdp_units=("blocks.3",))), ValueError,
                 lit("blocks.3"), id="preflight-fsdp-unit-missing"),
    pytest.param(lambda: apply(model=MLP(), plan=mk().to_dict(), device_type="cpu"), TypeError,
                 re.escape('plan must be an SNNDistributedPlan, got dict'), id="apply-plan-dict"),
    pytest.param(lambda: apply(model=MLP(), plan="none", device_type="cpu"), TypeError,
                 re.escape('plan must be an SNNDistributedPlan, got str'), id="apply-plan-str"),
    pytest.param(lambda: preflight("model", mk()), TypeError, re.escape('model must be a torch.nn.Module, got str'),
                 id="preflight-model-str"),
    # runtime helpers
    pytest.param(lambda: SNNDistributedRuntime.prepare_classification_output(torch.zeros(4), torch.zeros(4)),
                 ValueError, re.escape("got shape (4,)"), id="outputs-1d"),
    pytest.param(lambda: SNNDistributedRuntime.prepare_classification_output(torch.zeros(2, 3, 4, 5), torch.zeros(3)),
                 ValueError, re.escape("got shape (2, 3, 4, 5)"), id="outputs-4d"),
    pytest.param(lambda: SNNDistributedRuntime.prepare_classification_output(torch.zeros(3, 4, 10), torch.zeros(5)),
                 ValueError, re.escape("labels of shape (5,)"), id="labels-wrong-length"),
    pytest.param(lambda: SNNDistributedRuntime.prepare_classification_output(torch.zeros(4, 10), torch.zeros(4, 3)),
                 ValueError, re.escape("labels of shape (4, 3)"), id="labels-wrong-one-hot"),
    pytest.param(lambda: SNNDistributedRuntime.prepare_classification_output(torch.zeros(4, 10),
                                                                             torch.zeros(4, 10, 1)),
                 ValueError, re.escape("labels of shape (4, 10, 1)"), id="labels-3d"),
    pytest.param(lambda: dp_runtime().prepare_dataloader(torch.utils.data.TensorDataset(torch.zeros(8, 8)),
                                                         batch_size=3),
                 ValueError, re.escape("batch_size=3 (the loader's global batch) is not divisible by dp=2"),
                 id="loader-batch-not-divisible-dp"),
    pytest.param(lambda: none_runtime().prepare_dataloader(torch.utils.data.TensorDataset(torch.zeros(8, 8)),
                                                           batch_size=0),
                 ValueError, re.escape("batch_size=0 must be a positive int (the loader's global batch)"),
                 id="loader-batch-0"),
    pytest.param(lambda: none_runtime().prepare_dataloader(torch.utils.data.TensorDataset(torch.zeros(8, 8)),
                                                           batch_size=True),
                 ValueError, re.escape("batch_size=True must be a positive int (the loader's global batch)"),
                 id="loader-batch-True"),
    pytest.param(lambda: none_runtime().prepare_dataloader(torch.utils.data.TensorDataset(torch.zeros(8, 8)),
                                                           batch_size=2.5),
                 ValueError, re.escape("batch_size=2.5 must be a positive int (the loader's global batch)"),
                 id="loader-batch-float"),
]


@pytest.fixture(autouse=True)
def _no_process_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("these tests need a process with no process group initialised")


@pytest.mark.parametrize("call,exc,pattern", CASES)
def test_bad_input(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def _message(call, exc):
    try:
        call()
    except exc as raised:
        return str(raised)
    return None  # a case its marks skip here (e.g. CUDA is available)


@pytest.fixture(scope="module")
def messages():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("these tests need a process with no process group initialised")
    found = {p.id: _message(*p.values[:2]) for p in CASES}
    return {i: m for i, m in found.items() if m is not None}


@pytest.mark.parametrize("case", [pytest.param(p, id=p.id) for p in CASES])
def test_each_pattern_picks_out_its_own_message(case, messages):
    """A case's fragment names its bad value: among all the table's messages it matches only those
    identical to its own (so "got str" or "mode" alone would fail)."""
    if case.id not in messages:
        pytest.skip("the case does not raise here")
    pattern, own = case.values[2], messages[case.id]
    hits = sorted(i for i, m in messages.items() if re.search(pattern, m))
    assert hits == sorted(i for i, m in messages.items() if m == own), (pattern, own)


def test_pp_needs_a_model_whose_forward_chains_its_modules():
    """A forward that loops over time cannot be cut into stages: the error says why and what would do."""
    from snn_explorer.zoo import build

    with pytest.raises(ValueError, match=r"forward chains its top-level modules, but torch.fx cannot trace .*"
                                         r"nn.Sequential"):
        mk(mode="pp", topology={"pp": 2}, model=build("mlp").model, pp_layout="1|1")


def test_apply_default_device_type_follows_the_one_rule():
    """apply() without device_type: CUDA when available (no process group here), else the CPU."""
    runtime = apply(model=MLP(), plan=mk())
    assert runtime.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_errors_leave_registry_unchanged():
    from snn_explorer.core.model import neurons
    before = dict(neurons._REGISTRY)
    for bad in (int, nn.Linear):
        with pytest.raises(TypeError):
            register_stateful(bad)
    assert neurons._REGISTRY == before
