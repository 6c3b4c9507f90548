"""``fit``: the fastest plan whose estimated per-rank peak fits a memory budget, with the runners-up."""
from __future__ import annotations

import json

import pandas as pd

from ..explorer import Explorer
from .inputs import CliError, example_batch, load_model_and_batch, positive
from .options import GATES, features, memory_budget_bytes
from .plans import _hardware


def add_fit_parser(sub) -> None:
    p = sub.add_parser("fit", help="the fastest plan whose estimated peak fits a memory budget")
    p.add_argument("model", help="module:factory, or zoo:NAME for a built-in model")
    p.add_argument("--world-size", type=int, required=True, help="rank count; modes, meshes and levers are searched")
    p.add_argument("--memory-budget", type=float, required=True, help="MiB per device")
    p.add_argument("--batch-size", type=int, help="global batch (default: the model's example batch or 8)")
    p.add_argument("--input-shape", help="example input T,N,F... (default: the model's own example input)")
    p.add_argument("--hardware", help="a built-in hardware profile's name for the step times (default: this "
                                      "machine's calibration)")
    p.add_argument("--gate", action="append", default=[], choices=GATES, metavar="GATE",
                   help="with --gate / --no-gate the gates are these (default: checkpointing and spike compression on)")
    p.add_argument("--no-gate", action="append", default=[], choices=GATES, metavar="GATE")
    p.add_argument("--json", action="store_true", help="the chosen plan as JSON")
    p.set_defaults(run=cmd_fit)


def cmd_fit(args) -> int:
    model, _family, batch, carried = load_model_and_batch(args.model)
    batch = positive("--batch-size", args.batch_size) if args.batch_size is not None else (batch or 8)
    example = example_batch(args, carried, batch)
    if example is None:
        raise CliError(f"fit estimates plans, so it needs an example input: {args.model!r} carries none; give "
                       "--input-shape T,N,F... (e.g. 8,16,784)")
    gates = features(args) if args.gate or args.no_gate else None
    try:  # through the Explorer: a wait over 2 s shows its progress on a terminal (tqdm), a calibration's pieces too
        ex = Explorer(model, example_input=example[0], labels=example[1], batch_size=batch, hardware=_hardware(args))
        result = ex.fit(memory_budget_bytes(args), positive("--world-size", args.world_size), batch_size=batch,
                        features=gates)
    except (TypeError, ValueError) as exc:
        raise CliError(f"cannot fit {args.model!r}: {exc}") from None
    if args.json:
        print(json.dumps(result.plan.to_dict(), indent=2))
        return 0
    e = result.estimate
    print(f"chosen: {result.table['plan'].iloc[0]}: peak {e.peak_bytes / 2 ** 20:.3f} MiB of "
          f"{result.memory_budget / 2 ** 20:.3f} MiB, {e.step_time_s * 1e3:.3f} ms per step "
          f"({e.hardware.name}); {len(result.table)} candidates searched in {result.search_s:.2f} s")
    with pd.option_context("display.width", 250, "display.max_colwidth", 70):
        print(result.table.to_string(index=False))
    for note in result.notes:  # the search ran otherwise than documented (a lever estimated to speed a step)
        print(f"note: {note}")
    return 0
