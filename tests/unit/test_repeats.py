"""Repeated blocks profiled once (estimator/profile/repeats.py): the composed profile equals the full one."""
import dataclasses

import torch
from torch import nn

from snn_explorer.estimator.memory.pipeline_memory import under
from snn_explorer.estimator.profile import profiling, repeats_log
from snn_explorer.estimator.profile.profiling import measure_profile
from snn_explorer.estimator.profile.repeats import find_repeats
from snn_explorer.estimator.timing import compute_work
from snn_explorer.estimator.timing.compute_work import grouped_step_counts, restored, step_counts
from snn_explorer.zoo import SpikingMLP
from snn_explorer.zoo.llm import build_llm, token_batch

#: Everything a profile run gives the estimate, but the model copy and caches.
COMPARED = ("modules", "input_bytes", "grad_ready_order", "step_counts", "grad_params", "params", "param_itemsizes",
            "buffers", "fsdp_units", "norm_layers", "dtype")


def _equal_profiles(model, x, labels=None, **kw):
    full = measure_profile(model, x, labels, repeats=False, **kw)
    fast = measure_profile(model, x, labels, **kw)
    assert full.composed is None and fast.composed is not None, "the fast path was not taken"
    # non-trivial: the blocks save activations, hold neuron state and count FLOPs
    inside = [m for name, m in full.modules.items() if fast.composed.locate(name) is not None]
    assert sum(m.saved(4, 3) for m in inside) > 0 and sum(m.state(4, 3) for m in inside) > 0
    assert full.step_counts[0][0][0] > 0 and full.step_counts[-1][1][0] > 0
    for name in COMPARED:
        assert getattr(fast, name) == getattr(full, name), name
    return fast


def test_deep_mlps_composed_from_cut_runs_equal_their_full_profiles():
    """All-steps and per-step MLPs (blocks of Linear + LIF, with dropout of 3 children), 8 repeats: records,
    bytes, FLOPs, operator counts, gradient order equal the full runs'."""
    torch.manual_seed(0)
    x = torch.rand(3, 4, 16)
    fast = _equal_profiles(SpikingMLP(16, (16,) * 8, 8, stepping="all_steps"), x)
    assert (fast.composed.path, fast.composed.period, fast.composed.count) == ("net", 2, 8)
    _equal_profiles(SpikingMLP(16, (16,) * 8, 8, stepping="per_step", dropout=0.2), x)


def test_tiny_llm_blocks_composed_equal_the_full_profile_shape_only():
    """A ModuleList of 6 decoder blocks (spiking attention and MLP) on FakeTensors, as the 7 B model runs."""
    torch.manual_seed(0)
    model = build_llm("spiking-llm-tiny", n_layers=6)
    x, y = token_batch(model.config, 3, 4, 4), torch.randint(0, model.config.vocab_size, (4, 4))
    assert _equal_profiles(model, x, y, shape_only=True).composed.count == 6


class _Indexed(nn.Module):
    """Blocks run by a fixed index range: a model cut to fewer blocks fails, and is profiled in full."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))

    def forward(self, x):
        for i in range(6):
            x = torch.relu(self.blocks[i](x))
        return x


def test_what_is_not_a_repeat_is_profiled_in_full():
    """Different widths or tied weights are no repeats; a forward that needs all blocks falls back to the
    full runs (with the same profile as without repeats)."""
    assert find_repeats(SpikingMLP(16, (16, 24) * 4, 8)) is None
    tied = SpikingMLP(16, (16,) * 8, 8)
    for i in range(2, 16, 2):
        tied.net[i].weight = tied.net[0].weight
    assert find_repeats(tied) is None
    model, x = _Indexed(), torch.rand(2, 4, 8)
    assert find_repeats(model) is not None
    fast, full = measure_profile(model, x), measure_profile(model, x, repeats=False)
    assert fast.composed is None and dataclasses.replace(fast, model=None) == dataclasses.replace(full, model=None)


def test_logged_runs_composed_from_cut_runs_equal_the_full_runs(monkeypatch):
    """The storage meter's event log of a step (the peaks and FSDP2's replay read it), with and without the
    FSDP2 units logged, two sizes: composed from runs cut to 4, 5 and 6 repeats, equal event for event (kind,
    what, bytes, peak) to the full run's, on a 10-block MLP and the 8-block tiny LLM."""
    monkeypatch.setattr(repeats_log, "MIN_LOG_REPEATS", 7)
    torch.manual_seed(0)
    llm = build_llm("spiking-llm-tiny", n_layers=8)
    for model, x, y, kw in ((SpikingMLP(16, (16,) * 10, 8, stepping="all_steps"), torch.rand(3, 4, 16), None, {}),
                            (llm, token_batch(llm.config, 2, 4, 4), torch.randint(0, 64, (4, 4)), {})):
        profile = measure_profile(model, x, y, **kw)
        for units, (n, t) in (((), (1, 2)), (profile.fsdp_units, (3, 5))):
            fast = profile._run(n, t, None, 1, saved_only=False, units=units)
            with monkeypatch.context() as m:
                m.setattr(profiling, "cut_logged_run", lambda *a, **k: None)
                full = profile._run(n, t, None, 1, saved_only=False, units=units)
            assert "saved" not in fast and "saved" in full, "the composed path was not taken"
            events = full["log"].events
            assert len(events) > 20 and max(e[3] for e in events) > full["entry"]  # a step that allocates
            assert fast["log"].events == events and fast["log"].units == full["log"].units
            assert (fast["entry"], fast["grads"], fast["log"].grad_bytes) == (full["entry"], full["grads"],
                                                                             full["log"].grad_bytes)


def test_optimizer_counts_by_groups_of_alike_parameters_equal_the_whole_step():
    """An optimizer step counted once per group of alike parameters (times the group's size) equals the step
    over all parameters (Adam, AdamW, SGD with momentum; a deep MLP and the tiny LLM, some without gradients)."""
    torch.manual_seed(0)
    for model in (SpikingMLP(16, (16,) * 8, 8), build_llm("spiking-llm-tiny", n_layers=6)):
        params = list(model.parameters())
        for p in params[:-3]:
            p.grad = torch.randn_like(p)
        for optimizer in ("adam", "adamw", "sgd_momentum"):
            with restored(params):
                grouped, whole = grouped_step_counts(params, optimizer), step_counts(params, optimizer)
            assert grouped is not None and whole[3] > len(params) and whole[2] > 0
            assert grouped == whole, optimizer


def test_under_a_set_of_units_answers_as_under_their_list():
    """The pipeline's unit lookup by dotted prefixes (a set) answers as the scan of the list does."""
    units = ["net.0", "net.1", "blocks.10", "head", ""]
    for name in ("net.0", "net.0.weight", "net.01.weight", "net.1.lif.v", "blocks.1.w", "blocks.10.a.b", "head",
                 "header.w", "", "x"):
        assert under(name, set(units)) == under(name, units), name


def test_rank_work_counted_on_cut_runs_equals_the_full_count(monkeypatch):
    """count_work (the step of a model one rank runs, e.g. a TP replica) from passes cut to 2, 3 and 4 repeats
    equals the full count: FLOPs, bytes and operators of each phase, the optimizer over the same gradients."""
    torch.manual_seed(0)
    llm = build_llm("spiking-llm-tiny", n_layers=6, tied_embeddings=False)
    cases = [(SpikingMLP(16, (16,) * 8, 8, stepping="all_steps"), torch.rand(3, 4, 16), None, None),
             (llm, token_batch(llm.config, 2, 4, 4), torch.randint(0, 64, (4, 4)), llm.tensor_parallel_plan())]
    for model, x, y, tp_plan in cases:
        profile = measure_profile(model, x, y)
        rank_model = profile.rank_model(tp_plan, 2 if tp_plan else 1)[1]
        assert compute_work.cut_counted_points(rank_model, profile) is not None, "the cut path was not taken"
        fast = compute_work.count_work(rank_model, profile, "adam")
        with monkeypatch.context() as m:
            m.setattr(compute_work, "cut_counted_points", lambda *a, **k: None)
            full = compute_work.count_work(rank_model, profile, "adam")
        assert full.forward.flops(4, 3) > 0 and full.optimizer.ops(1, 1) > 0
        assert fast == full


def test_tp_replica_saved_and_state_from_cut_runs_equal_the_full_run(monkeypatch):
    """The bytes a TP rank's forward saves and its neuron state, from runs of its replica cut to 2 and 3 repeats,
    equal the full run's (tiny LLM, TP along whole heads)."""
    torch.manual_seed(0)
    llm = build_llm("spiking-llm-tiny", n_layers=6, tied_embeddings=False)
    profile = measure_profile(llm, token_batch(llm.config, 2, 4, 4), torch.randint(0, 64, (4, 4)))
    plan = llm.tensor_parallel_plan()
    _, replica = profile.rank_model(plan, 2)
    x, y = token_batch(llm.config, 3, 2, 4), torch.randint(0, 64, (2, 4))
    fast = profiling.cut_saved_run(replica, x, y)
    with monkeypatch.context() as m:
        m.setattr(profiling, "cut_saved_run", lambda *a, **k: None)
        full = profile._run(2, 3, plan, 2, saved_only=True)
    assert fast is not None and sum(full["saved"].values()) > 0 and sum(full["state"].values()) > 0
    assert fast["saved"] == full["saved"] and fast["state"] == full["state"]
