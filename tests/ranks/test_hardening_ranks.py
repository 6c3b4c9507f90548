"""Issue 19 hardening: exported jobs others cannot subvert, inputs refused early, scale, side effects.
(The tests in one process: tests/unit/test_hardening.py.)"""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from snn_explorer import analyze, plan
from snn_explorer.zoo import build


@pytest.fixture(scope="module")
def mlp():
    zoo = build("mlp")
    p = plan(analysis=analyze(zoo.model), objective="speed", topology={"dp": 2}, backend="torch", batch_size=8)
    return zoo, p


# ---- export_job: values written into shell scripts -----------------------------------------------------


def test_script_values_reach_torchrun_as_one_literal_word(mlp, tmp_path):
    """command.sh runs under bash with a stand-in torchrun: values arrive verbatim, unexpanded; a job
    name that is not a plain name (it names files and the rendezvous) is refused at export."""
    name = "run $(touch pwned) `touch pwned2` ; touch pwned3 'q'"
    with pytest.raises(ValueError, match=r"job_name=.* must be 1-64 characters of letters, digits"):
        _export(mlp, tmp_path / "refused", job_name=name)
    job = _export(mlp, tmp_path / "job", job_name="run-1", partition="gpu; touch pwned4", nnodes=2)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$ARGV_FILE"\n')
    os.chmod(bin_dir / "torchrun", 0o755)
    argv_file = tmp_path / "argv"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MASTER_ADDR": "10.0.0.1",
           "ARGV_FILE": str(argv_file)}
    env.pop("MASTER_PORT", None)
    done = subprocess.run(["bash", job.command_file], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    argv = argv_file.read_text().splitlines()
    assert re.fullmatch(r"run-1-[0-9a-f]{8}", argv[argv.index("--rdzv-id") + 1])
    assert argv[argv.index("--rdzv-endpoint") + 1] == "10.0.0.1:29500"
    assert not any(p.name.startswith("pwned") for p in list(tmp_path.iterdir()) + list((tmp_path / "job").iterdir()))
    sbatch = open(job.sbatch_file).read()
    assert "#SBATCH --partition='gpu; touch pwned4'" in sbatch
    assert "#SBATCH --job-name=run-1" in sbatch
    assert subprocess.run(["bash", "-n", job.sbatch_file], timeout=30).returncode == 0


# ---- bad inputs: one clear error at the entry point ------------------------------------------------------

import json  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

from test_hardening import X, _export, _frozen_mlp

from snn_explorer.estimator import enumerate_plans  # noqa: E402

# ---- models: mixed dtypes, nothing to train ------------------------------------------------------


def _apply_each(plans):
    """On each rank: apply every plan to a frozen MLP and run it; then the refusals of a 2-rank group."""
    from snn_explorer import apply as apply_

    shapes = []
    for p in plans:
        runtime = apply_(model=_frozen_mlp(), plan=p, device_type="cpu")
        shapes.append(tuple(runtime.model(X[:, : p.per_rank_batch]).shape))
    refusals = []
    none_plan = plan(analysis=analyze(build("mlp").model), objective="speed", topology=1, backend="torch",
                     batch_size=8)
    try:
        apply_(model=build("mlp").model, plan=none_plan, device_type="cpu")
    except ValueError as exc:
        refusals.append(str(exc))
    model = build("mlp").model
    apply_(model=model, plan=plans[0], device_type="cpu")
    try:
        apply_(model=model, plan=plans[0], device_type="cpu")
    except ValueError as exc:
        refusals.append(str(exc))
    return shapes, refusals


@pytest.mark.timeout(180)
def test_every_plan_of_a_frozen_model_applies_on_two_ranks():
    from snn_explorer.launcher import launch

    plans = list(enumerate_plans(analyze(_frozen_mlp()), world_size=2, batch_size=8))
    result = launch(_apply_each, plans, nprocs=2, backend="gloo", progress=False, timeout=150)
    for shapes, refusals in result.values:
        assert shapes == [(8, 4, 8) if p.mode == "fsdp2" else (8, 8, 8) for p in plans]
        assert len(refusals) == 2, refusals
        assert "plan mode 'none' runs one process, but this process group has 2 ranks" in refusals[0]
        assert re.search(r"already distributed by apply\(\) with SNNDistributedPlan\(fsdp2", refusals[1])


# ---- side effects: the caller's process is left as it was found ---------------------------------------

SIDE_EFFECTS = textwrap.dedent('''
    import json, os, sys, tempfile
    import torch
    from torch import nn
    import snntorch as snn
    from snn_explorer import Explorer, analyze, plan
    from snn_explorer.estimator import estimate, measure, model_profile

    model = nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.5), snn.Leaky(beta=0.9, init_hidden=True), nn.Linear(12, 4))
    x = torch.rand(3, 4, 6)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    threads = torch.get_num_threads()  # the estimator runs on one thread, then restores the caller's
    a = analyze(model)
    model_profile(model, x[:, :2])
    Explorer(model, example_input=x).estimate(plan(analysis=a, objective="memory", topology={"dp": 2},
                                                   backend="torch", batch_size=4))
    for topo, obj in ((1, "speed"), ({"dp": 2}, "speed"), ({"dp": 2}, "memory"), ({"tp": 2}, "memory")):
        estimate(model, plan(analysis=a, objective=obj, topology=topo, backend="torch", batch_size=4), example_input=x)
    measure(model, plan(analysis=a, objective="speed", topology=1, backend="torch", batch_size=4), example_input=x,
            steps=1)
    if sys.argv[1] == "ranks":
        measure(model, plan(analysis=a, objective="speed", topology={"dp": 2}, backend="torch", batch_size=4),
                example_input=x, steps=1, timeout=120)
    print(json.dumps(dict(rng=torch.equal(before, torch.get_rng_state()), env=os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                          env_before=env, tmp=sorted(os.listdir(tempfile.gettempdir())),
                          dynamo="torch._dynamo" in sys.modules, threads=torch.get_num_threads() == threads)))
''')


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["in-process", "ranks"])
def test_estimate_and_measure_leave_the_process_as_found(tmp_path, where):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", SIDE_EFFECTS, where], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads(done.stdout.strip().splitlines()[-1])
    assert state["dynamo"]  # the runs did import torch's compiler, which sets the variable and the folder
    assert state == dict(rng=True, env=None, env_before=None, tmp=[], dynamo=True, threads=True)
    assert os.listdir(tmp) == []
