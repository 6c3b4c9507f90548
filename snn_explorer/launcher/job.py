"""What an exported job's ``run.py`` calls on every rank under ``torchrun`` (see ``export_job``)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence


def _backend() -> str:
    import torch

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world else "gloo"


def main(script: str, argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``--plan/--payload/--out``, join the torchrun process group, train, write ``rank<R>.json``."""
    import cloudpickle
    import torch
    import torch.distributed as dist

    from ..core.neurons import restore_stateful
    from ..core.serialize import loads
    from .plan_run import train_plan_rank
    from .private_files import read_private

    here = os.path.dirname(os.path.abspath(script))
    parser = argparse.ArgumentParser(description="Run an exported snn_explorer plan on this rank (via torchrun).")
    parser.add_argument("--plan", default=os.path.join(here, "plan.json"))
    parser.add_argument("--payload", default=os.path.join(here, "payload.pkl"))
    parser.add_argument("--out", default=os.path.join(here, "results"))
    args = parser.parse_args(argv)
    plan_data = loads(read_private(args.plan, "plan file"))
    # Unpickling runs code: only a payload that no other user could have written or replaced.
    job = cloudpickle.loads(read_private(args.payload, "payload"))
    restore_stateful(job.get("stateful", {}))  # the exporting process's register_stateful calls
    backend = _backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    try:
        history = train_plan_rank(job["model"], plan_data, job["train_fn"], job["steps"], job["dataset"],
                                  "cuda" if backend == "nccl" else "cpu", job["optimizer"], job["seed"],
                                  job["train_kwargs"])
        os.makedirs(args.out, exist_ok=True)
        rank = dist.get_rank()
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
            json.dump(history, fh)
        if rank == 0:
            print(f"rank 0 finished {job['steps']} steps; metrics in {args.out}", file=sys.stderr)
    finally:
        dist.destroy_process_group()
    return 0
