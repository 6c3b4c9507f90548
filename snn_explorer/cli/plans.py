"""``analyze`` and ``compare``: the model's analysis, and its plans side by side in a compact table."""
from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import pandas as pd

from ..core import analyze
from ..core.planning import SNN_DISTRIBUTED_PREFERENCES
from ..estimator import hardware_profiles
from ..explorer import Explorer, analysis_table, plans_table
from ..explorer.compare import MEMORY_ROWS, plan_label, readable
from .inputs import CliError, example_batch, load_model_and_batch, positive, topologies
from .options import memory_budget_bytes, plan_choices

#: The rows of the compact comparison (``--wide``: every row, the plans' rationale and notes too).
COMPACT_ROWS = ("objective", "mode", "mesh", "precision", "optimizer_strategy", "batch_per_rank", "time_steps",
                "pipeline", "bubble_fraction") + MEMORY_ROWS + (
    "peak_bytes_max", "comm_bytes_per_step", "wire_bytes_per_step", "collectives_per_step", "step_time_s",
    "samples_per_s", "fits_budget")


def roots(args) -> Optional[List[str]]:
    return args.roots.split(",") if getattr(args, "roots", None) else None


def _hardware(args) -> Optional[str]:
    if args.hardware is None:
        return None
    if args.hardware.endswith(".json"):
        if not os.path.isfile(args.hardware):
            raise CliError(f"--hardware {args.hardware!r}: no such profile file (snn-explorer calibrate writes one)")
        return args.hardware
    if args.hardware not in hardware_profiles():
        raise CliError(f"unknown --hardware {args.hardware!r}; expected one of {sorted(hardware_profiles())} "
                       "or a profile file (.json)")
    return args.hardware


def explorer(args) -> Explorer:
    """The Explorer of ``args.model`` (its own example batch, or ``--input-shape`` random inputs)."""
    model, family, batch, carried = load_model_and_batch(args.model)
    batch = positive("--batch-size", args.batch_size) if args.batch_size is not None else (batch or 8)
    example = example_batch(args, carried, batch)
    time_steps = getattr(args, "time_steps", None)
    try:
        return Explorer(model, example_input=example[0] if example else None,
                        labels=example[1] if example else None, model_family=args.family or family,
                        roots=roots(args), batch_size=batch, hardware=_hardware(args) if "hardware" in args else None,
                        time_steps=positive("--time-steps", time_steps) if time_steps is not None else None)
    except (KeyError, TypeError, ValueError) as exc:
        raise CliError(f"cannot analyze {args.model!r}: {exc}") from None


def objectives(value: str) -> Sequence[str]:
    return SNN_DISTRIBUTED_PREFERENCES if value == "all" else (value,)


def make_plans(args, ex: Explorer) -> Tuple[list, Dict[int, List[str]], List[str]]:
    """``(plans, objectives per plan, skipped)``: one plan per topology x objective, a plan of a layout
    met before (another objective choosing it) kept once, with every objective that chose it."""
    choices = plan_choices(args)
    plans, chosen_by, skipped, seen = [], {}, [], {}
    for topology in topologies(args):
        for objective in objectives(args.objective):
            try:
                p = ex.make_plan(objective=objective, topology=topology, batch_size=ex.batch_size, **choices)
            except (ValueError, NotImplementedError, TypeError) as exc:
                skipped.append(f"{dict(topology.dims)} / {objective}: {exc}")
                continue
            index = seen.setdefault(p.layout_key(), len(plans))
            if index == len(plans):
                plans.append(p)
            chosen_by.setdefault(index, []).append(objective)
    return plans, chosen_by, skipped


def cmd_analyze(args) -> int:
    model, family, _, _ = load_model_and_batch(args.model)
    try:
        analysis = analyze(model, model_family=args.family or family, roots=roots(args))
    except (KeyError, TypeError, ValueError) as exc:
        raise CliError(f"cannot analyze {args.model!r}: {exc}") from None
    if args.json:
        print(json.dumps(analysis.to_dict(), indent=2))
        return 0
    print(f"model family: {analysis.model_family}")
    print(analysis_table(analysis).to_string(index=False))
    for note in analysis.notes:
        print(f"note: {note}")
    return 0


def compact_text(ex: Explorer, plans: list, chosen_by: Dict[int, List[str]], budget: Optional[int],
                 wide: bool) -> str:
    """A legend line per plan (``#i label (objectives)``) above the comparison, columns ``#1 ...``."""
    labels = [f"#{i + 1}" for i in range(len(plans))]
    table = ex.compare(plans, labels=labels, memory_budget=budget)
    table.loc["objective"] = [",".join(chosen_by[i]) for i in range(len(plans))]
    if not wide:
        keep = [r for r in COMPACT_ROWS if r in table.index and (r != "fits_budget" or budget is not None)]
        table = table.loc[keep]
    hardware = ex.estimate(plans[0]).hardware
    legend = [f"{label:>4}  {plan_label(p)}{f' memopt={p.memopt_level}' if p.uses_fsdp else ''}  "
              f"({', '.join(chosen_by[i])})" for i, (label, p) in enumerate(zip(labels, plans))]
    head = [f"hardware: {hardware.name}" if hardware is not None else "hardware: none"]
    with pd.option_context("display.width", 250, "display.max_colwidth", 40):
        return "\n".join(head + legend + [readable(table, 40 if wide else 24).to_string()])


def cmd_compare(args) -> int:
    """The plans side by side with the estimator's rows (as ``Explorer.compare``); without an
    example input (none carried by the model, no ``--input-shape``), the plans alone, saying why."""
    ex = explorer(args)
    plans, chosen_by, skipped = make_plans(args, ex)
    budget = memory_budget_bytes(args)
    if args.json:
        print(json.dumps([p.to_dict() for p in plans], indent=2))
    elif plans and ex.example_input is None:
        with pd.option_context("display.width", 200, "display.max_colwidth", 60):
            print(plans_table(plans).to_string())
        print("no estimates: this model carries no example input; give --input-shape T,N,F... "
              "(e.g. 8,16,784) for per-rank memory and communication", file=sys.stderr)
    elif plans:
        try:
            print(compact_text(ex, plans, chosen_by, budget, args.wide))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise CliError(f"cannot estimate the plans of {args.model!r}: {exc}") from None
    for line in skipped:
        print(f"no plan: {line}", file=sys.stderr)
    if not plans:
        raise CliError("no plan fits: " + "; ".join(skipped))
    return 0
