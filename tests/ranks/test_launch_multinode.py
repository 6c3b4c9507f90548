"""The exported job as two torchrun "nodes" of two processes each on loopback (c10d rendezvous on
127.0.0.1, ``--nnodes 2``, its own ``command.sh``), training with periodic checkpoints. Mid-run one
node is SIGKILLed whole (its torchrun agent and both its ranks, from inside a step); the surviving
node's agent restarts its ranks (``--max-restarts``), a replacement node is started with the same
command (what a scheduler does), and the job resumes from the last complete checkpoint. The final
weights and the losses of the resumed steps equal those of an uninterrupted run with the same data
order (float64). For a dp plan and a pp x dp plan."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import snn_explorer as se
from snn_explorer.compat_dcp import SafeFileSystemReader
from snn_explorer.core.checkpoints import latest_checkpoint, read_manifest, saved_tensor_metadata, step_path
from snn_explorer.launcher import ExportOptions, export_job
from snn_explorer.zoo import build

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(600)

MODEL = "mlp_all_steps"
STEPS, EVERY, KILLED_STEP = 8, 2, 5  # the node dies in the 6th step: steps 5 and 6 are lost, 4 is saved
NODE_TIMEOUT_S = 240
REPO = str(Path(__file__).resolve().parents[2])


def _step(runtime, step, batch, state, inputs, labels, marker=None):
    """One step on this rank's slice of the global batch; in step ``KILLED_STEP`` the first local rank
    of node B SIGKILLs its whole node, once: the other rank of the node, the node's session (its
    torchrun agent; torchrun starts each rank in a session of its own), then itself."""
    share, start = runtime.plan.per_rank_batch, runtime.dp_rank * runtime.plan.per_rank_batch
    state["optimizer"].zero_grad()
    loss = runtime.train_step(nn.CrossEntropyLoss(), inputs[:, start:start + share], labels[start:start + share])
    if (marker and step == KILLED_STEP and os.environ.get("SNN_TEST_NODE") == "B"
            and os.environ["LOCAL_RANK"] == "0" and not os.path.exists(marker)):
        open(marker, "w").close()
        agent = psutil.Process(os.getppid())
        for sibling in agent.children():
            if sibling.pid != os.getpid():
                sibling.kill()
        os.killpg(os.getpgid(agent.pid), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    state["optimizer"].step()
    return loss


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _node(job, name: str, tmp: Path) -> subprocess.Popen:
    """One node: the job's own command.sh in a session of its own (its process group is the node).
    The script itself sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see ``export.RENDEZVOUS_LINES``):
    with the rendezvous store shared with the ranks (torch's default), a surviving agent that was rank 0
    keeps the store address of its first round and never publishes one for the next, so a replacement
    node waits for it until the 60 s store timeout (torch 2.13, dynamic_rendezvous.next_rendezvous)."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env = {**env, "MASTER_ADDR": "127.0.0.1", "SNN_TEST_NODE": name, "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo", "TMPDIR": str(tmp), "PYTHONPATH": REPO,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    log = open(tmp / f"node-{name}.log", "ab")
    return subprocess.Popen(["bash", job.command_file], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _end(nodes) -> None:
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()


def _run_two_nodes(job, tmp: Path, port: int, replace_killed: bool) -> dict:
    """Node A (hosting the rendezvous store) then node B; if B dies by SIGKILL, start a replacement.
    Returns each node's exit code and seconds taken."""
    started = time.monotonic()
    nodes = [_node(job, "A", tmp)]
    while not _listening(port) and time.monotonic() - started < 60:
        time.sleep(0.1)
    nodes.append(_node(job, "B", tmp))
    replaced = None
    try:
        while time.monotonic() - started < NODE_TIMEOUT_S:
            if replace_killed and replaced is None and nodes[1].poll() == -signal.SIGKILL:
                replaced = time.monotonic() - started
                nodes.append(_node(job, "B", tmp))
            if all(n.poll() is not None for n in nodes):
                break
            time.sleep(0.2)
        codes = [n.poll() for n in nodes]
    finally:
        _end(nodes)
    logs = "".join(f"\n===== node {n}\n" + (tmp / f"node-{n}.log").read_text(errors="replace")[-5000:] for n in "AB")
    assert None not in codes, f"a node did not finish within {NODE_TIMEOUT_S} s: {codes}\n{logs}"
    return {"codes": codes, "replaced_at": replaced, "seconds": time.monotonic() - started, "logs": logs}


def _weights(path: Path) -> dict:
    """The model tensors of a checkpoint, whole, read in this process through the safe reader."""
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved_tensor_metadata(path).items()
             if k.startswith("model.")}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
    return state


@pytest.mark.parametrize("topology, mode", [({"dp": 4}, "fsdp2"), ({"pp": 2, "dp": 2}, "pp")], ids=["fsdp2", "pp2dp2"])
def test_a_node_killed_mid_run_restarts_and_ends_equal_to_an_uninterrupted_run(tmp_path, topology, mode):
    zoo = build(MODEL)
    model = zoo.model.double()
    plan = se.plan(analysis=se.analyze(model, model_family=zoo.family), objective="speed", topology=topology,
                   mode=mode, batch_size=zoo.batch_size)
    data = {"inputs": zoo.example_input.double(), "labels": zoo.labels}
    common = dict(steps=STEPS, optimizer={"lr": 1e-2})
    whole_dir = tmp_path / "uninterrupted"
    whole = se.launch_plan(model, plan, _step, train_kwargs=data, options=se.LaunchOptions(progress=False, timeout=300, checkpoint_dir=whole_dir, checkpoint_every=EVERY), **common)
    assert len(set(whole.losses[0])) == STEPS  # training moves the loss
    port = _free_port()
    job = export_job(plan, _step, tmp_path / "job", model=model, train_kwargs={**data, "marker": str(tmp_path / "node-B-killed")}, options=ExportOptions(nnodes=2, nproc_per_node=2, port=port, max_restarts=1, checkpoint_dir="ckpt", checkpoint_every=EVERY), **common)
    assert "--nnodes 2 --nproc-per-node 2" in job.command and "--max-restarts 1" in job.command
    (tmp_path / "tmp").mkdir()
    run = _run_two_nodes(job, tmp_path / "tmp", port, replace_killed=True)
    assert os.path.exists(tmp_path / "node-B-killed") and run["replaced_at"] is not None, run["logs"]
    assert run["codes"] == [0, -signal.SIGKILL, 0], (run["codes"], run["logs"])
    ckpt = Path(job.path) / "ckpt"
    assert latest_checkpoint(ckpt) == step_path(ckpt, STEPS) and read_manifest(step_path(ckpt, STEPS))["world_size"] == 4
    resumed_from = (KILLED_STEP // EVERY) * EVERY
    for rank in range(4):  # the restarted attempt made the steps after the last complete checkpoint
        losses = [m["loss"] for m in json.loads((Path(job.path) / "results" / f"rank{rank}.json").read_text())]
        assert losses == pytest.approx(whole.losses[rank][resumed_from:], abs=1e-12), rank
    final, reference = _weights(step_path(ckpt, STEPS)), _weights(step_path(whole_dir, STEPS))
    initial = {f"model.{k}": v for k, v in model.named_parameters()}
    assert set(final) == set(reference) >= set(initial)
    assert all(not torch.equal(reference[k], initial[k]) for k in initial)  # every parameter was trained
    assert all(torch.allclose(final[k], reference[k], rtol=0, atol=1e-12) for k in reference), \
        {k: (final[k] - reference[k]).abs().max().item() for k in reference}
    assert not [p for p in psutil.process_iter(["environ"]) if _of_this_job(p, job.path)]


def _of_this_job(proc: psutil.Process, job_path: str) -> bool:
    """True for a process still running this job's command (none may outlive the test)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and any(job_path in part for part in proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
