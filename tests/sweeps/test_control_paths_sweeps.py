"""Sweeps of test_control_paths.py (tests/unit): the same checks over many plans or models, minutes of CPU each."""
import copy

import pandas as pd
import torch

import snn_explorer as se
from snn_explorer.core.model import TIME_MAJOR, detached_copy
from snn_explorer.estimator import estimate
from snn_explorer.estimator.profile import tp_replica
from snn_explorer.estimator.profile.profiling import measure_profile
from snn_explorer.zoo import SpikingMLP
from snn_explorer.zoo.llm import build_llm, token_batch


def test_tp_estimates_with_a_shared_storage_replica_equal_those_with_a_deep_copied_one(monkeypatch):
    """estimate() of TP plans (tp and fsdp2_tp, 2-way) whose replica shares the profile copy's weights equals
    the estimate whose replica is a detached deep copy: per-rank memory, collectives and step time, exactly;
    the profile's own model keeps its weights (the replica's optimizer count restores what it steps)."""
    torch.manual_seed(0)
    llm = build_llm("spiking-llm-tiny", n_layers=4, tied_embeddings=False)
    cases = (("deep mlp", SpikingMLP(16, (16,) * 8, 8, stepping="all_steps"), torch.rand(3, 4, 16), None, None),
             ("llm", llm, token_batch(llm.config, 3, 4, 8), None, TIME_MAJOR))
    for name, model, x, labels, layout in cases:
        analysis = se.analyze(model)
        for mode, topology in (("tp", {"tp": 2}), ("fsdp2_tp", {"dp": 2, "tp": 2})):
            p = se.plan(analysis=analysis, objective="speed", topology=topology, batch_size=x.shape[1], mode=mode)
            kw = dict(example_input=x, labels=labels, hardware="H100-SXM", layout=layout)
            fast_model = copy.deepcopy(model)
            profile = measure_profile(fast_model, x, labels)
            before = {n: t.clone() for n, t in profile.model.state_dict().items()}
            fast = estimate(fast_model, p, profile=profile, **kw)
            assert all(torch.equal(before[n], t) for n, t in profile.model.state_dict().items()), name
            with monkeypatch.context() as m:
                m.setattr(tp_replica, "shared_storage_copy", detached_copy)
                slow_model = copy.deepcopy(model)
                slow = estimate(slow_model, p, profile=measure_profile(slow_model, x, labels), **kw)
            assert fast.peak_bytes > 0 and fast.step_time_s > 0 and p.tp_size == 2, (name, mode)
            for table in ("per_rank", "collectives", "time"):
                pd.testing.assert_frame_equal(getattr(fast, table), getattr(slow, table), check_exact=True)
