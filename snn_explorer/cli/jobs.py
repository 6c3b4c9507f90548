"""``export`` (a torchrun / Slurm job of one plan) and ``checkpoint info`` (what a checkpoint holds)."""
from __future__ import annotations

import json
import os

from ..core.checkpoints import CheckpointError, read_manifest
from ..core.planning import SNNDistributedPlan
from ..launcher import ExportOptions, export_job
from ..launcher.export import check_job_name
from .inputs import CliError, positive, resolve
from .plans import explorer, make_plans


def cmd_export(args) -> int:
    if not args.objective or args.objective == "all":
        raise CliError("export needs one --objective (speed, memory or capacity)")
    try:  # before any model is built: every input is checked first
        check_job_name(args.job_name)
    except ValueError as exc:
        raise CliError(f"bad --job-name: {exc}") from None
    positive("--steps", args.steps)
    ex = explorer(args)
    plans, _, skipped = make_plans(args, ex)
    if not plans:
        raise CliError("no plan fits: " + "; ".join(skipped))
    chosen = plans[0]
    if args.train_script:
        train = args.train_script
        if not os.path.isfile(train):
            raise CliError(f"training script {train!r} does not exist")
    else:
        train = resolve(args.train, "train function")
        if not callable(train):
            raise CliError(f"train function {args.train!r} is a {type(train).__name__}, not callable")
    try:
        job = export_job(chosen, train, args.out, model=ex.model, steps=args.steps, options=ExportOptions(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, job_name=args.job_name, gpus_per_node=args.gpus_per_node, partition=args.partition, port=args.master_port, rdzv_endpoint=args.rdzv_endpoint))
    except (TypeError, ValueError) as exc:
        raise CliError(f"cannot export: {exc}") from None
    except OSError as exc:
        raise CliError(f"cannot write the job to --out {args.out!r}: {exc}") from None
    print(f"plan: {chosen!r}")
    print(f"wrote {job.path}: {os.path.basename(job.script)}, plan.json, command.sh, job.sbatch")
    print(job.command)
    return 0


def cmd_checkpoint_info(args) -> int:
    """What a checkpoint directory holds: plan, step, world size, every tensor."""
    try:
        manifest = read_manifest(args.dir)
        plan = SNNDistributedPlan.from_dict(manifest["plan"])
    except (CheckpointError, KeyError, TypeError, ValueError) as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    optimizer = manifest.get("optimizer")
    print(f"checkpoint: {args.dir}")
    print(f"plan: {plan!r}")
    print(f"step: {manifest['step']}  world size: {manifest['world_size']}  torch: {manifest['torch_version']}")
    print(f"optimizer: {optimizer['class'] if optimizer else 'none saved'}")
    if manifest.get("extra") is not None:
        print(f"extra: {json.dumps(manifest['extra'])}")
    tensors = manifest["tensors"]
    width = max((len(p) for p in tensors), default=4)
    print(f"{'tensor':<{width}}  shape  dtype")
    for path, meta in tensors.items():
        print(f"{path:<{width}}  {tuple(meta['shape'])}  {meta['dtype']}")
    return 0


