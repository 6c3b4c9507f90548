"""The Explorer's controls as command-line options: the choices the UI offers, by the same names."""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Optional

from ..core import DistributedFeatureSet, PlanOptions
from ..core.common import MODES, PRECISIONS, Precision, precision_of
from ..core.levers import ACTIVATION_CHECKPOINTING
from ..core.planning import SCHEDULES, SNN_DISTRIBUTED_PREFERENCES
from .inputs import CliError, positive

#: The feature gates, as ``DistributedFeatureSet`` names them (and ``--gate`` / ``--no-gate`` take).
GATES = tuple(f.name for f in dataclasses.fields(DistributedFeatureSet))
CHECKPOINTING = ACTIVATION_CHECKPOINTING


def add_plan_options(p) -> None:
    """What a plan is made of: where (world size or topology), objective, batch, mode, gates, levers, pipeline."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--world-size", type=int, help="rank count; every dp x tp factorisation is tried")
    where.add_argument("--topology", help="named mesh dims, e.g. dp=2,tp=2 or pp=2,dp=2")
    p.add_argument("--objective", default="all", choices=SNN_DISTRIBUTED_PREFERENCES + ("all",))
    p.add_argument("--batch-size", type=int, help="global batch (default: the model's example batch or 8)")
    p.add_argument("--mode", choices=MODES, help="force a mode")
    p.add_argument("--gate", action="append", default=[], choices=GATES, metavar="GATE",
                   help=f"turn a feature gate on (repeatable): {', '.join(GATES)}")
    p.add_argument("--no-gate", action="append", default=[], choices=GATES, metavar="GATE",
                   help="turn a feature gate off (allow_zero_optimizer is on unless turned off)")
    p.add_argument("--checkpointing", choices=CHECKPOINTING,
                   help="activation checkpointing (default: the objective's choice; needs the "
                        "allow_activation_checkpointing gate)")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="checkpoint every k-th block, or time chunks of k steps (default: k chosen by estimate, else 1)")
    p.add_argument("--pp-schedule", choices=tuple(SCHEDULES), help="pipeline schedule (a topology with pp)")
    p.add_argument("--pp-microbatches", type=int, help="pipeline micro-batches (default: the planner's)")
    p.add_argument("--pp-virtual-stages", type=int, help="stages per pipeline rank (default: the planner's)")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="training precision (default: the objective's: bf16 with --gate allow_mixed_precision, "
                        "else fp32); bf16 / fp16 need --gate allow_mixed_precision")
    p.add_argument("--neuron-state-fp32", action=argparse.BooleanOptionalAction, default=None,
                   help="keep membranes and traces in fp32 while layers compute in bf16 / fp16 (default: on)")


def add_estimate_options(p) -> None:
    """Where and how long the estimates look: hardware, time steps, the memory budget, the table's width."""
    p.add_argument("--hardware", help="a built-in hardware profile's name (e.g. A100-SXM-80GB) or a profile file "
                                      "(.json, from snn-explorer calibrate) for the step times (default: "
                                      "$SNN_EXPLORER_HARDWARE, else this machine's calibration)")
    p.add_argument("--time-steps", type=int, help="time steps T of the estimates (default: the example input's)")
    p.add_argument("--memory-budget", type=float, help="MiB per device: the fits_budget row and the ranking")
    p.add_argument("--wide", action="store_true", help="every row, the plans' rationale and notes included")


def features(args) -> DistributedFeatureSet:
    both = set(args.gate) & set(args.no_gate)
    if both:
        raise CliError(f"gate(s) {sorted(both)} given both as --gate and --no-gate; give each once")
    gates = {g: (g in args.gate) or (getattr(DistributedFeatureSet(), g) and g not in args.no_gate) for g in GATES}
    return DistributedFeatureSet(**gates)


def _optional_positive(name: str, value) -> Optional[int]:
    return None if value is None else positive(name, value)


def precision_choice(args, gates: DistributedFeatureSet) -> Optional[Precision]:
    """The ``--precision`` / ``--neuron-state-fp32`` choice (None: the objective's); CliError for a
    half precision without its gate, or a neuron-state choice without a half precision."""
    if args.precision is None:
        if args.neuron_state_fp32 is not None:
            raise CliError("--neuron-state-fp32 / --no-neuron-state-fp32 is a choice of --precision bf16 or fp16; "
                           "give --precision too")
        return None
    chosen = precision_of(args.precision, keep_neuron_state_fp32=args.neuron_state_fp32)
    if chosen.mixed and not gates.allow_mixed_precision:
        raise CliError(f"--precision {chosen.name} needs --gate allow_mixed_precision (plans train in fp32 without it)")
    if not chosen.mixed and args.neuron_state_fp32 is not None:
        raise CliError("--neuron-state-fp32 / --no-neuron-state-fp32 is a choice of --precision bf16 or fp16, "
                       "not fp32 (the state is fp32 there)")
    return chosen


def plan_choices(args) -> dict:
    """The keyword arguments of ``Explorer.make_plan`` the options give (objective and topology aside):
    ``features``, ``mode`` and ``options``, a :class:`~snn_explorer.PlanOptions`."""
    gates = features(args)
    options = PlanOptions(precision=precision_choice(args, gates), activation_checkpointing=args.checkpointing,
                          checkpoint_every=_optional_positive("--checkpoint-every", args.checkpoint_every),
                          cpu_offload=gates.allow_cpu_offload, pp_schedule=args.pp_schedule,
                          pp_microbatches=_optional_positive("--pp-microbatches", args.pp_microbatches),
                          pp_virtual_stages=_optional_positive("--pp-virtual-stages", args.pp_virtual_stages))
    return dict(features=gates, mode=args.mode, options=options)


def memory_budget_bytes(args) -> Optional[int]:
    if args.memory_budget is None:
        return None
    if not (math.isfinite(args.memory_budget) and args.memory_budget > 0):
        raise CliError(f"bad --memory-budget {args.memory_budget!r}: expected MiB per device, a number > 0")
    if args.memory_budget * 2 ** 20 > 2 ** 63:
        raise CliError(f"bad --memory-budget {args.memory_budget!r}: more than 2**63 bytes; expected MiB per device")
    return int(args.memory_budget * 2 ** 20)
