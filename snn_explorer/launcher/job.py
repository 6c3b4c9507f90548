"""What an exported job's ``run.py`` calls (see ``export_job``): under ``torchrun``, this rank's
training; run directly (``python run.py``), every rank of the plan on this machine through
:mod:`snn_explorer.ranks` (loopback only)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Optional, Sequence

import cloudpickle
import torch.distributed as dist

from ..core import SNNDistributedPlan
from ..core.checkpoints import FolderLock
from ..core.common import loads
from ..core.model import restore_stateful
from ..core.parallelize import device_type_for
from ..ranks import LaunchError, init_process_group, resolve_backend, run
from ..ranks.teardown import end_process_groups
from .plan_run import train_plan_rank
from .private_files import read_private

#: Set (by ``run.py --debug``) to print teardown diagnostics on every rank.
DEBUG_ENV = "SNN_EXPLORER_DEBUG"


def _backend() -> str:
    """NCCL when this node has a GPU per local rank, else gloo (the rank runner's ``auto``)."""
    return resolve_backend("auto", int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _train(model, job: dict, plan_data: dict, backend: str) -> list:
    """One rank of the job, inside its process group: apply the plan to ``model`` and run the steps."""
    return train_plan_rank(model, plan_data, job["train_fn"], job["steps"], job["dataset"],
                           device_type_for(backend), job["optimizer"], job["seed"], job["train_kwargs"],
                           job.get("checkpoints"), job.get("on_non_finite", "stop"))


def _write(out: str, rank: int, history: list) -> None:
    """This rank's metrics as ``out/rank<R>.json``, readable by the running user only (like the job's files)."""
    os.makedirs(out, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(out, f"rank{rank}.json"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(history, fh)


def _fail_now(rank: int) -> None:
    """Leave at once with code 1 after printing the error: torchrun then ends (or restarts) the group.
    No ``destroy_process_group``: it waits for this rank's collectives still in flight, which wait
    for peers that may be blocked themselves (the job would hang until the group's timeout)."""
    print(f"[rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _torchrun_rank(job: dict, plan_data: dict, out: str) -> None:
    """Under torchrun: join its process group (the rank runner's entry), train, write this rank's
    metrics, end the process groups. ``job["model"]`` is taken out of ``job``: the model (its
    DTensor parameters hold the groups) must be gone before they end."""
    backend = _backend()
    init_process_group(backend)
    rank = dist.get_rank()
    try:
        history = _train(job.pop("model"), job, plan_data, backend)
    except BaseException:  # noqa: BLE001 - any failure, KeyboardInterrupt included, ends this rank now
        _fail_now(rank)
    _write(out, rank, history)
    _end(rank)


def _end(rank: int) -> None:
    """Every rank got here, so no collective is left in flight: a barrier (the rank serving the store
    keeps it until all are done), then every group destroyed and its threads joined while the
    interpreter is whole. If a live object still holds a group, its c10d threads would meet the
    interpreter's teardown: leave without it (the metrics are written)."""
    left = end_process_groups(barrier=True)
    if left:
        if os.environ.get(DEBUG_ENV):  # a diagnostic: the job's results are complete either way
            print(f"[rank {rank}] c10d threads still alive after destroy_process_group ({', '.join(left)}): "
                  "leaving without interpreter teardown", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _local_run(job: dict, plan_data: dict, out: str, max_restarts: int = 0) -> None:
    """Without torchrun: every rank on this machine through ``snn_explorer.ranks`` (stores on
    127.0.0.1 at free ports), started again up to ``max_restarts`` times after a failure (resuming
    from the job's checkpoints); this process holds the checkpoint folder's lock."""
    world = SNNDistributedPlan.from_dict(plan_data).world_size
    backend = resolve_backend("auto", world)
    checkpoints = job.get("checkpoints")
    lock = FolderLock(checkpoints["dir"]).acquire() if checkpoints else None
    if lock is not None and lock.took_over:
        print(f"took over the checkpoint folder's lock left by {lock.took_over}, which is gone", file=sys.stderr)
    job = {**job, "checkpoints": checkpoints and {**checkpoints, "held": True}}
    try:
        for attempt in range(max_restarts + 1):
            try:
                result = run(_train, (job["model"], job, plan_data, backend), nprocs=world, backend=backend,
                             progress=True)
                break
            except LaunchError as error:
                if attempt == max_restarts or not checkpoints:
                    raise
                print(f"restarting ({attempt + 1} of {max_restarts}) after: {str(error).splitlines()[0]}",
                      file=sys.stderr)
    finally:
        if lock is not None:
            lock.release()
    for rank, history in enumerate(result.values):
        _write(out, rank, history)


def _job_relative(job: dict, here: str) -> dict:
    """The job with a relative ``checkpoint_dir`` made relative to the job directory ``here``."""
    checkpoints = job.get("checkpoints")
    if checkpoints and not os.path.isabs(checkpoints["dir"]):
        return {**job, "checkpoints": {**checkpoints, "dir": os.path.join(here, checkpoints["dir"])}}
    return job


def main(script: str, argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``--plan/--payload/--out`` and train: under torchrun, this rank; run directly
    (``python run.py``), all the plan's ranks on this machine. Writes ``rank<R>.json`` per rank."""
    here = os.path.dirname(os.path.abspath(script))
    parser = argparse.ArgumentParser(description="Run an exported snn_explorer plan: on this torchrun rank, "
                                                 "or (run directly) on all its ranks on this machine.")
    parser.add_argument("--plan", default=os.path.join(here, "plan.json"))
    parser.add_argument("--payload", default=os.path.join(here, "payload.pkl"))
    parser.add_argument("--out", default=os.path.join(here, "results"))
    parser.add_argument("--max-restarts", type=int, default=0, help="run directly: start the ranks again this many "
                                                                    "times after a failure")
    parser.add_argument("--debug", action="store_true", help="print teardown diagnostics")
    args = parser.parse_args(argv)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"
    plan_data = loads(read_private(args.plan, "plan file"))
    # Unpickling runs code: only a payload that no other user could have written or replaced.
    job = _job_relative(cloudpickle.loads(read_private(args.payload, "payload")), here)
    restore_stateful(job.get("stateful", {}))  # the exporting process's register_stateful calls
    if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:
        _torchrun_rank(job, plan_data, args.out)
        if os.environ.get("RANK", "0") == "0":
            print(f"rank 0 finished {job['steps']} steps; metrics in {args.out}", file=sys.stderr)
    else:
        _local_run(job, plan_data, args.out, args.max_restarts)
        print(f"finished {job['steps']} steps on every rank; metrics in {args.out}", file=sys.stderr)
    return 0
