"""Clean teardown after fsdp2 on spikingjelly's QKFormer (issue 35): apply + destroy 50 times on 2
gloo ranks, and an exported job's ranks that end with code 0 and no "terminate called" abort, never
entering interpreter teardown while c10d threads are alive.

Why it matters: ``destroy_process_group`` alone leaves the gloo worker, gloo socket and store
threads running while a DeviceMesh (held by every DTensor parameter) holds the groups; a process
that exits normally then tears those C++ threads down inside interpreter finalization.
"""
from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from datetime import timedelta

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_on_ranks
from spikingjelly.activation_based.model.qkformer import QKFormer
from spikingjelly.activation_based.neuron import BaseNode

import snn_explorer as se
from snn_explorer.launcher import export_job
from snn_explorer.ranks.teardown import c10d_threads, end_process_groups

_HERE = os.path.dirname(os.path.abspath(__file__))

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CYCLES = int(os.environ.get("SNN_TEARDOWN_CYCLES", "50"))
EXITS = 2  # exported-job runs of 2 ranks each: 4 real process exits


def _qkformer() -> QKFormer:
    torch.manual_seed(0)  # Q-K token attention in stages 1-2, spiking self-attention in stage 3, multi-step LIF
    return QKFormer(T=2, in_channels=3, num_classes=4, embed_dims=16, num_heads=(1, 1, 2), depths=(1, 1, 1),
                    mlp_ratio=1.0)


def _fsdp2_plan(model):
    return se.plan(analysis=se.analyze(model), objective="memory", topology={"dp": 2}, batch_size=4, mode="fsdp2")


def _step(runtime, step, batch, state):
    """One training step on this rank's 2 random images; the loss and how many spikes the LIF neurons fired."""
    fired = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: fired.append(float(out.sum())))
             for m in runtime.model.modules() if isinstance(m, BaseNode)]
    x, y = torch.rand(2, 3, 16, 16), torch.randint(0, 4, (2,))
    loss = torch.nn.functional.cross_entropy(runtime.model(x), y)
    for hook in hooks:
        hook.remove()
    loss.backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()
    return {"loss": loss, "spikes": sum(fired), "c10d_threads": len(c10d_threads())}


def _one_cycle(model, plan) -> dict:
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    metrics = _step(runtime, 0, None, {"optimizer": runtime.build_optimizer(lr=1e-3)})
    runtime.reset_state()
    return {"loss": metrics["loss"].item(), "spikes": metrics["spikes"], "threads": c10d_threads()}


def _apply_destroy_cycles(cycles: int) -> list:
    """On each rank: end the runner's group, then ``cycles`` times join a fresh gloo group (its own
    store prefix), apply fsdp2 to a copy of the QKFormer, train a step and end every group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = [{"threads": c10d_threads(), "left": end_process_groups()}]
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(seconds=60))
    template = _qkformer()
    plan = _fsdp2_plan(template)
    for cycle in range(cycles):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"teardown-{cycle}", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        done = _one_cycle(copy.deepcopy(template), plan)
        done["left"] = end_process_groups()
        out.append(done)
    return out


@pytest.mark.timeout(240)
def test_fsdp2_on_qkformer_apply_and_destroy_50_times_without_abort():
    for rank, cycles in enumerate(run_on_ranks(_apply_destroy_cycles, 2, CYCLES, timeout=200)):
        runner, cycles = cycles[0], cycles[1:]
        assert "gloo_tcp_loop" in runner["threads"] and runner["left"] == [], (rank, runner)  # a plain group ends whole
        assert len(cycles) == CYCLES
        for i, cycle in enumerate(cycles):
            # the gloo threads ran while the plan was applied (a real group, a real step) ...
            assert "pt_gloo_runloop" in cycle["threads"] and "gloo_tcp_loop" in cycle["threads"], (rank, i, cycle)
            assert cycle["spikes"] > 0 and torch.isfinite(torch.tensor(cycle["loss"])), (rank, i, cycle)
            # ... and a fresh group joined after end_process_groups each time (a dead store or group would raise)
        assert len({round(c["loss"], 6) for c in cycles}) > 1  # different random data each cycle: a real step
        # Known, not fixed: the fsdp2-applied model is not freed, so its groups' threads stay (3 per cycle).
        assert len(cycles[-1]["left"]) <= 3 * CYCLES + 1, cycles[-1]["left"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job_ranks(job, tmp_path) -> list:
    """Both ranks of the exported job as torchrun starts them (RANK, WORLD_SIZE, MASTER_*; rank 0
    serves the store), each a plain ``python run.py`` that exits through interpreter teardown."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "GLOO_SOCKET_IFNAME": "lo", "TMPDIR": str(tmp_path), "SNN_EXPLORER_DEBUG": "1",  # teardown said
               # the step is this module's, which imports the harness from tests/
               "PYTHONPATH": os.pathsep.join(p for p in (_HERE, os.path.dirname(_HERE), os.environ.get("PYTHONPATH"))
                                             if p)}
        procs.append(subprocess.Popen([sys.executable, job.script], cwd=job.path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        return [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.timeout(420)
def test_exported_fsdp2_qkformer_job_ranks_exit_cleanly(tmp_path):
    model = _qkformer()
    job = export_job(_fsdp2_plan(model), _step, tmp_path / "job", model=model, steps=1)
    for run in range(EXITS):
        for rank, (code, err) in enumerate(_run_job_ranks(job, tmp_path)):
            assert code == 0 and "terminate called" not in err, (run, rank, code, err[-3000:])
            # the fsdp2 model keeps its groups' threads alive: the rank must say so and skip interpreter teardown
            assert "c10d threads still alive" in err and "leaving without interpreter teardown" in err, err[-3000:]
            metrics = json.load(open(os.path.join(job.path, "results", f"rank{rank}.json")))
            assert metrics[0]["c10d_threads"] >= 3 and metrics[0]["spikes"] > 0, metrics  # gloo threads ran
