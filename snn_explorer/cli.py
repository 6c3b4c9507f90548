"""The ``snn-explorer`` console script: analyze a model, compare plans, export a cluster job.

A model is given as ``module:factory`` (a callable returning an ``nn.Module`` or a zoo model, or a
module attribute holding one) or ``zoo:NAME`` for a built-in. Examples::

    snn-explorer analyze zoo:mlp
    snn-explorer compare mypkg.models:make_net --world-size 4 --objective memory
    snn-explorer export zoo:mlp --topology dp=2,tp=2 --train mypkg.train:step --steps 100 --out job/
    snn-explorer checkpoint info runs/step-100
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .core import MODES, SNN_DISTRIBUTED_PREFERENCES, SNNDistributedTopology, analyze, plan
from .core.topology import MAX_WORLD_SIZE, dp_tp_splits
from .core.validate import positive_int


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are CliErrors too (one line, exit 2)."""

    def error(self, message: str):
        raise CliError(f"{message} (see '{self.prog} --help')")


def _positive(name: str, value, **kw) -> int:
    try:
        return positive_int(name, value, **kw)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _call_factory(factory, spec: str):
    """``factory()``, with its failure (or its required arguments) as a CliError."""
    try:
        required = [n for n, p in inspect.signature(factory).parameters.items()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        required = []
    if required:
        raise CliError(f"model factory {spec!r} needs the argument(s) {required}; give a factory that "
                       "takes no arguments (or defaults for all of them)")
    try:
        return factory()
    except Exception as exc:  # noqa: BLE001 - the user's code: reported in one line
        raise CliError(f"model factory {spec!r} raised {type(exc).__name__}: {exc}") from None


def _resolve(spec: str, what: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"{what} {spec!r} must look like 'module:attribute' (e.g. 'mypkg.models:make_net'"
                       + (" or 'zoo:mlp')" if what == "model" else ")"))
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliError(f"cannot import module {module_name!r} of {what} {spec!r}: {exc}") from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise CliError(f"module {module_name!r} has no attribute {attr!r} ({what} {spec!r})")
        target = getattr(target, part)
    return target


def load_model(spec: str) -> Tuple[Any, Optional[str], Optional[int]]:
    """``(model, family or None, example batch size or None)`` for ``module:factory`` / ``zoo:NAME``."""
    model, family, batch, _ = load_model_and_batch(spec)
    return model, family, batch


def load_model_and_batch(spec: str) -> Tuple[Any, Optional[str], Optional[int], Optional[tuple]]:
    """:func:`load_model` plus ``(example_input, labels)`` when the factory's object carries them
    (a zoo model, or any object with ``.model`` and ``.example_input``), else None."""
    from torch import nn

    if spec.startswith("zoo:"):
        from .zoo import ZOO_NAMES, build

        name = spec[4:]
        if name not in ZOO_NAMES:
            raise CliError(f"unknown zoo model {name!r} in {spec!r}; expected one of {ZOO_NAMES}")
        obj = build(name)
    else:
        obj = _resolve(spec, "model")
        if callable(obj) and not isinstance(obj, nn.Module):
            obj = _call_factory(obj, spec)
    if isinstance(obj, nn.Module):
        return obj, None, None, None
    if isinstance(getattr(obj, "model", None), nn.Module):
        example = getattr(obj, "example_input", None)
        batch = (example, getattr(obj, "labels", None)) if example is not None else None
        return obj.model, getattr(obj, "family", None), getattr(obj, "batch_size", None), batch
    raise CliError(f"model {spec!r} gave a {type(obj).__name__}, not a torch.nn.Module (or an object with .model)")


def parse_topology(text: str) -> SNNDistributedTopology:
    """``"dp=2,tp=2"`` -> a validated topology."""
    dims: Dict[str, int] = {}
    for item in text.split(","):
        name, sep, size = item.strip().partition("=")
        if not sep or not name.strip():
            raise CliError(f"bad topology {text!r}: {item.strip()!r} is not NAME=SIZE; expected e.g. 'dp=2,tp=2'")
        if name.strip() in dims:
            raise CliError(f"bad topology {text!r}: dim {name.strip()!r} is given twice; name each dim once")
        try:
            dims[name.strip()] = int(size)
        except ValueError:
            raise CliError(f"bad topology {text!r}: size {size!r} of dim {name.strip()!r} is not an integer") from None
    try:
        return SNNDistributedTopology(dims)
    except (TypeError, ValueError) as exc:
        raise CliError(f"bad topology {text!r}: {exc}") from None


def topologies(args) -> List[SNNDistributedTopology]:
    """The topology given, or every dp x tp factorisation of the world size."""
    if args.topology:
        return [parse_topology(args.topology)]
    n = args.world_size
    if n < 1 or n > MAX_WORLD_SIZE:
        raise CliError(f"bad world size {n}: must be between 1 and {MAX_WORLD_SIZE}")
    return [SNNDistributedTopology(dims) for dims in dp_tp_splits(n)]


def _objectives(value: str) -> Sequence[str]:
    return SNN_DISTRIBUTED_PREFERENCES if value == "all" else (value,)


def _roots(args) -> Optional[List[str]]:
    return args.roots.split(",") if getattr(args, "roots", None) else None


def _analysis(args):
    model, family, batch = load_model(args.model)
    try:
        return model, analyze(model, model_family=args.family or family, roots=_roots(args)), batch
    except (KeyError, TypeError, ValueError) as exc:
        raise CliError(f"cannot analyze {args.model!r}: {exc}") from None


def _example_batch(args, carried: Optional[tuple], batch: int):
    """``(example_input, labels)``: the model's own, else random inputs of ``--input-shape``, else None."""
    if args.input_shape:
        try:
            shape = tuple(int(v) for v in args.input_shape.split(","))
        except ValueError:
            raise CliError(f"bad --input-shape {args.input_shape!r}: expected integers T,N,F... "
                           "(e.g. 8,16,784)") from None
        if len(shape) < 3 or min(shape) < 1:
            raise CliError(f"bad --input-shape {args.input_shape!r}: expected T,N and at least one feature "
                           "size, all positive (e.g. 8,16,784)")
        import torch

        return torch.rand(shape, generator=torch.Generator().manual_seed(0)), None
    return carried


def _plans(args, analysis, batch):
    batch = _positive("--batch-size", args.batch_size) if args.batch_size is not None else (batch or 8)
    plans, skipped = [], []
    for topology in topologies(args):
        for objective in _objectives(args.objective):
            try:
                p = plan(analysis=analysis, objective=objective, topology=topology, neuron_backend="torch",
                         batch_size=batch, mode=getattr(args, "mode", None))
            except (ValueError, NotImplementedError) as exc:
                skipped.append(f"{dict(topology.dims)} / {objective}: {exc}")
                continue
            if p not in plans:
                plans.append(p)
    return plans, skipped


def cmd_analyze(args) -> int:
    from .explorer import analysis_table

    _, analysis, _ = _analysis(args)
    if args.json:
        print(json.dumps(analysis.to_dict(), indent=2))
        return 0
    print(f"model family: {analysis.model_family}")
    print(analysis_table(analysis).to_string(index=False))
    for note in analysis.notes:
        print(f"note: {note}")
    return 0


def cmd_compare(args) -> int:
    """The plans side by side with the estimator's rows (as ``Explorer.compare``); without an
    example input (none carried by the model, no ``--input-shape``), the plans alone, saying why."""
    from .explorer import Explorer, plans_table

    model, analysis, batch = _analysis(args)
    plans, skipped = _plans(args, analysis, batch)
    example = _example_batch(args, load_model_and_batch(args.model)[3], batch)
    if args.json:
        print(json.dumps([p.to_dict() for p in plans], indent=2))
    elif plans:
        import pandas as pd

        with pd.option_context("display.width", 200, "display.max_colwidth", 60):
            if example is None:
                print(plans_table(plans).to_string())
                print("no estimates: this model carries no example input; give --input-shape T,N,F... "
                      "(e.g. 8,16,784) for per-rank memory and communication", file=sys.stderr)
            else:
                explorer = Explorer(model, example_input=example[0], labels=example[1],
                                    model_family=analysis.model_family, roots=_roots(args))
                try:
                    print(explorer.compare_text(plans))
                except (TypeError, ValueError, RuntimeError) as exc:
                    raise CliError(f"cannot estimate the plans of {args.model!r}: {exc}") from None
    for line in skipped:
        print(f"no plan: {line}", file=sys.stderr)
    if not plans:
        raise CliError("no plan fits: " + "; ".join(skipped))
    return 0


def cmd_export(args) -> int:
    from .launcher import export_job

    if not args.objective or args.objective == "all":
        raise CliError("export needs one --objective (speed, memory or capacity)")
    _positive("--steps", args.steps)
    model, analysis, batch = _analysis(args)
    plans, skipped = _plans(args, analysis, batch)
    if not plans:
        raise CliError("no plan fits: " + "; ".join(skipped))
    chosen = plans[0]
    if args.train_script:
        train = args.train_script
        if not os.path.isfile(train):
            raise CliError(f"training script {train!r} does not exist")
    else:
        train = _resolve(args.train, "train function")
        if not callable(train):
            raise CliError(f"train function {args.train!r} is a {type(train).__name__}, not callable")
    try:
        job = export_job(chosen, train, args.out, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                         model=model, steps=args.steps, job_name=args.job_name, gpus_per_node=args.gpus_per_node,
                         partition=args.partition)
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
    from .core.checkpoint import CheckpointError, read_manifest
    from .core.plan_types import SNNDistributedPlan

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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="snn-explorer", description="Analyze a spiking model, compare "
                                     "distribution plans, export a torchrun / Slurm job.")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p, plans: bool):
        p.add_argument("model", help="module:factory, or zoo:NAME for a built-in model")
        p.add_argument("--family", help="model family (default: detected)")
        p.add_argument("--roots", help="comma-separated module paths to restrict tensor parallelism to")
        if plans:
            where = p.add_mutually_exclusive_group(required=True)
            where.add_argument("--world-size", type=int, help="rank count; every dp x tp factorisation is tried")
            where.add_argument("--topology", help="named mesh dims, e.g. dp=2,tp=2")
            p.add_argument("--objective", default="all", choices=SNN_DISTRIBUTED_PREFERENCES + ("all",))
            p.add_argument("--batch-size", type=int, help="global batch (default: the model's example batch or 8)")
            p.add_argument("--mode", choices=MODES, help="force a mode")

    p = sub.add_parser("analyze", help="stateful neurons and tensor-parallel candidates")
    model_args(p, plans=False)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_analyze)
    p = sub.add_parser("compare", help="side-by-side plans for a world size or topology")
    model_args(p, plans=True)
    p.add_argument("--json", action="store_true")
    p.add_argument("--input-shape", help="example input T,N,F... for the estimates, e.g. 8,16,784 "
                                         "(default: the model's own example input, if it carries one)")
    p.set_defaults(run=cmd_compare)
    p = sub.add_parser("export", help="write a torchrun / Slurm job for one plan")
    model_args(p, plans=True)
    train = p.add_mutually_exclusive_group(required=True)
    train.add_argument("--train", help="module:function, a launch_plan step function")
    train.add_argument("--train-script", help="a script to run instead (gets --plan plan.json)")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--nproc-per-node", type=int)
    p.add_argument("--job-name", default="snn-explorer")
    p.add_argument("--gpus-per-node", type=int, help="Slurm --gpus-per-node (default: none requested)")
    p.add_argument("--partition", help="Slurm partition")
    p.set_defaults(run=cmd_export)
    p = sub.add_parser("checkpoint", help="inspect a checkpoint directory")
    actions = p.add_subparsers(dest="action", required=True)
    info = actions.add_parser("info", help="plan, step and tensors of a checkpoint")
    info.add_argument("dir", help="the checkpoint directory (runtime.save_checkpoint's path)")
    info.add_argument("--json", action="store_true", help="the whole manifest as JSON")
    info.set_defaults(run=cmd_checkpoint_info)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except CliError as exc:
        print(f"snn-explorer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
