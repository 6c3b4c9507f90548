"""Sweeps of test_shape_only.py (tests/unit): the same checks over many plans or models, minutes of CPU each."""
import copy

from test_shape_only import (
    _same_profile,
)

import snn_explorer as se
from snn_explorer.core.model import TIME_MAJOR
from snn_explorer.estimator import estimate
from snn_explorer.estimator.profile.profiling import model_profile
from snn_explorer.zoo import build


def test_spikformer_on_meta_is_profiled_shape_only_and_estimates_as_the_real_model():
    z = build("spikformer")
    meta = copy.deepcopy(z.model).to("meta")  # snntorch's Leaky reads a value in __init__: built, then moved
    real_profile = model_profile(z.model, z.example_input, z.labels)
    meta_profile = model_profile(meta, z.example_input, z.labels, layout=TIME_MAJOR)
    _same_profile(real_profile, meta_profile, [(6, 5)])
    analysis = se.analyze(z.model)
    levers = se.DistributedFeatureSet(allow_activation_checkpointing=True)
    for mode, topology, hw, checkpointing in (("dp", {"dp": 2}, "A100-SXM-80GB", None),
                                              ("fsdp2", {"dp": 2}, "RTX-4090-PCIe-noP2P", None),
                                              ("tp", {"tp": 2}, "A100-SXM-80GB", None),
                                              ("fsdp2", {"dp": 2}, "A100-SXM-80GB", "blocks")):
        plan = se.plan(analysis=analysis, objective="memory", neuron_backend="torch", mode=mode,
                       topology=topology, batch_size=4, features=levers if checkpointing else None, options=se.PlanOptions(activation_checkpointing=checkpointing))
        real = estimate(z.model, plan, example_input=z.example_input, labels=z.labels, hardware=hw)
        fake = estimate(meta, plan, example_input=z.example_input, labels=z.labels, hardware=hw,
                        profile=meta_profile, layout=TIME_MAJOR)
        assert real.peak_bytes > 0 and real.step_time_s > 0
        assert real.per_rank.equals(fake.per_rank), (mode, hw)
        assert real.time.equals(fake.time) and real.collectives.equals(fake.collectives), (mode, hw)
        assert real.recompute_forward_fraction == fake.recompute_forward_fraction
