"""The ``snn-explorer`` console script: analyze a model, compare plans, export a cluster job.

A model is given as ``module:factory`` (a callable returning an ``nn.Module`` or a zoo model, or a
module attribute holding one) or ``zoo:NAME`` for a built-in. Examples::

    snn-explorer analyze zoo:mlp
    snn-explorer compare mypkg.models:make_net --world-size 4 --objective memory
    snn-explorer compare zoo:mlp --world-size 8 --hardware A100-SXM-80GB --time-steps 32 --memory-budget 64
    snn-explorer compare zoo:mlp --topology dp=4 --gate allow_activation_checkpointing --checkpointing blocks
    snn-explorer fit zoo:spikformer --world-size 2 --memory-budget 1.8 --hardware H100-SXM
    snn-explorer export zoo:mlp --topology dp=2,tp=2 --train mypkg.train:step --steps 100 --out job/
    snn-explorer checkpoint info runs/step-100
    snn-explorer calibrate --device cuda --model zoo:vgg --out my-gpu.json
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Optional, Sequence

from .budget import add_fit_parser
from .calibration import add_calibrate_parser
from .inputs import CliError, Parser, load_model, load_model_and_batch, parse_topology
from .jobs import cmd_checkpoint_info, cmd_export
from .options import add_estimate_options, add_plan_options
from .plans import cmd_analyze, cmd_compare

__all__ = ["CliError", "build_parser", "load_model", "load_model_and_batch", "main", "parse_topology"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="snn-explorer", description="Analyze a spiking model, compare "
                                     "distribution plans, export a torchrun / Slurm job.")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, print its Python traceback too (anywhere on the command line)")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p, plans: bool):
        p.add_argument("model", help="module:factory, or zoo:NAME for a built-in model")
        p.add_argument("--family", help="model family (default: detected)")
        p.add_argument("--roots", help="comma-separated module paths to restrict tensor parallelism to")
        if plans:
            add_plan_options(p)
            p.add_argument("--input-shape", help="example input T,N,F... for the estimates, e.g. 8,16,784 "
                                                 "(default: the model's own example input, if it carries one)")

    p = sub.add_parser("analyze", help="stateful neurons and tensor-parallel candidates")
    model_args(p, plans=False)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_analyze)
    p = sub.add_parser("compare", help="side-by-side plans for a world size or topology")
    model_args(p, plans=True)
    p.add_argument("--json", action="store_true")
    add_estimate_options(p)
    p.set_defaults(run=cmd_compare)
    add_fit_parser(sub)
    add_calibrate_parser(sub)
    p = sub.add_parser("export", help="write a torchrun / Slurm job for one plan")
    model_args(p, plans=True)
    train = p.add_mutually_exclusive_group(required=True)
    train.add_argument("--train", help="module:function, a launch_plan step function")
    train.add_argument("--train-script", help="a script to run instead (gets --plan plan.json)")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--nproc-per-node", type=int)
    p.add_argument("--job-name", default="snn-explorer", help="letters, digits, '.', '_', '-' (names files and "
                                                                "the rendezvous)")
    p.add_argument("--master-port", type=int, help="several nodes: the rendezvous port (default: $MASTER_PORT "
                                                   "when the job runs, else 29500; Slurm: one per job)")
    p.add_argument("--rdzv-endpoint", help="several nodes: host:port of the rendezvous (default: "
                                           "$SNN_RDZV_ENDPOINT, else $MASTER_ADDR:<port>)")
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


def _where(exc: BaseException) -> str:
    """`` (in file.py:12, forward)``: the innermost frame of the error outside snn_explorer and
    torch, i.e. in the user's model or step function; "" when there is none."""
    frames = traceback.extract_tb(exc.__traceback__)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    own = [f for f in frames if not f.filename.startswith(package) and f"{os.sep}torch{os.sep}" not in f.filename
           and f"{os.sep}site-packages{os.sep}" not in f.filename]
    return f" (in {os.path.basename(own[-1].filename)}:{own[-1].lineno}, {own[-1].name})" if own else ""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 400 else text[:397] + "..."


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The console script: 0 on success; every error (a bad input, or an error raised by the user's
    model or code) is one line on stderr and exit status 2, with its traceback under ``--debug``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except CliError as exc:
        if debug:
            traceback.print_exc()
        print(f"snn-explorer: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the user's model or code: one line, the traceback on request
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (--debug prints the traceback)"
        print(f"snn-explorer: error: {type(exc).__name__}: {_one_line(exc)}{_where(exc)}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
