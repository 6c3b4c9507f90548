"""The CLI reaches the Explorer's controls: hardware, time steps, budget, gates, levers; compare prints each plan once."""
from __future__ import annotations

import re

import pytest

from snn_explorer.cli import main
from snn_explorer.core import SNNDistributedTopology, analyze, plan
from snn_explorer.core.common import dp_tp_splits
from snn_explorer.core.planning import SNN_DISTRIBUTED_PREFERENCES
from snn_explorer.zoo import build

HW = ["--hardware", "A100-SXM-80GB"]


def _rows(out: str) -> dict:
    """{row name: [cells]} of the printed comparison (cells split on runs of 2+ spaces)."""
    rows = {}
    for line in out.splitlines():
        parts = re.split(r"\s{2,}", line.strip())
        if len(parts) > 1 and re.fullmatch(r"[a-z_]+", parts[0]):
            rows[parts[0]] = parts[1:]
    return rows


def test_compare_prints_each_layout_once_in_a_compact_table(capsys):
    assert main(["compare", "zoo:mlp", "--world-size", "4", *HW]) == 0
    out = capsys.readouterr().out
    zoo = build("mlp")
    analysis = analyze(zoo.model, model_family=zoo.family)
    layouts = set()
    for dims in dp_tp_splits(4):
        for objective in SNN_DISTRIBUTED_PREFERENCES:
            layouts.add(plan(analysis=analysis, objective=objective, topology=SNNDistributedTopology(dims),
                             batch_size=zoo.example_input.shape[1]).layout_key())
    legend = [line for line in out.splitlines() if re.match(r"\s*#\d+  [a-z]", line)]
    assert len(legend) == len(layouts) < 3 * len(dp_tp_splits(4))  # some objectives share a plan
    assert len(_rows(out)["mode"]) == len(layouts)
    assert max(len(line) for line in out.splitlines()) <= 160
    assert "rationale" not in out and "memory,capacity" in out.replace(" ", "")


def test_time_steps_hardware_and_budget_reach_the_estimates(capsys):
    assert main(["compare", "zoo:mlp", "--topology", "dp=2", "--objective", "speed", *HW]) == 0
    base = _rows(capsys.readouterr().out)
    assert main(["compare", "zoo:mlp", "--topology", "dp=2", "--objective", "speed", "--hardware", "H100-SXM",
                 "--time-steps", "16", "--memory-budget", "0.1"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert "hardware: H100" in out and base["time_steps"] == ["8"] and rows["time_steps"] == ["16"]
    assert rows["activations_bytes"] != base["activations_bytes"] and rows["step_time_s"] != base["step_time_s"]
    assert rows["fits_budget"] == ["no"]  # 0.1 MiB: less than any plan's peak
    assert main(["compare", "zoo:mlp", "--topology", "dp=2", "--objective", "speed", *HW, "--memory-budget", "64"]) == 0
    assert _rows(capsys.readouterr().out)["fits_budget"] == ["yes"]


def test_gates_and_levers(capsys):
    argv = ["compare", "zoo:mlp", "--topology", "dp=2", "--objective", "memory", *HW]
    assert main(argv + ["--gate", "allow_activation_checkpointing", "--checkpointing", "blocks"]) == 0
    assert "+ac:blocks" in capsys.readouterr().out
    assert main(argv + ["--no-gate", "allow_zero_optimizer", "--objective", "speed"]) == 0
    assert _rows(capsys.readouterr().out)["optimizer_strategy"] == ["none"]
    assert main(argv + ["--objective", "speed"]) == 0
    assert _rows(capsys.readouterr().out)["optimizer_strategy"] == ["zero"]


@pytest.mark.parametrize("extra, named", [
    (["--hardware", "Z80"], "'Z80'"),
    (["--gate", "allow_cpu_offload", "--no-gate", "allow_cpu_offload"], "allow_cpu_offload"),
    (["--gate", "allow_everything"], "'allow_everything'"),
    (["--memory-budget", "-1"], "--memory-budget -1"),
    (["--time-steps", "0"], "--time-steps=0"),
])
def test_bad_controls_are_one_line_errors(capsys, extra, named):
    assert main(["compare", "zoo:mlp", "--topology", "dp=2", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("snn-explorer: error: ") and err.count("\n") == 1 and named in err, err


def test_precision_options_reach_the_plans_behind_their_gate(capsys):
    base = ["compare", "zoo:mlp", "--topology", "dp=2", "--objective", "speed", *HW]
    assert main(base + ["--gate", "allow_mixed_precision", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert _rows(out)["precision"] == ["bf16"] and "dp=2 bf16" in out
    assert main(base + ["--gate", "allow_mixed_precision", "--precision", "bf16", "--no-neuron-state-fp32",
                        "--json"]) == 0
    assert '"keep_neuron_state_fp32": false' in capsys.readouterr().out
    assert main(base + ["--precision", "fp16"]) == 2
    assert "--precision fp16 needs --gate allow_mixed_precision" in capsys.readouterr().err
    assert main(base + ["--no-neuron-state-fp32"]) == 2
    assert "give --precision too" in capsys.readouterr().err
    assert main(base + ["--precision", "fp8"]) == 2  # argparse: not a choice
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
