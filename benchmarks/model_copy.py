"""The estimator's copies of a model: ``copy.deepcopy`` against the module-tree walk (not a test).

Run: ``python benchmarks/model_copy.py [--modules 10000] [--rounds 3]``. On the explorer latency benchmark's
generated all-steps MLP of about ``modules`` modules, after a forward (neuron state with autograd history, as a
user's model has it), times, with the garbage collector paused (as the profile's copy runs) and the fastest of
``rounds``: ``copy.deepcopy`` of the detached model (what the profile's private copy was), ``detached_copy``
(``core.module_copy.deep_copy_module``, the profile's private copy now), and ``shared_storage_copy`` (the TP
replica's copy: parameters over the same storage); then one full ``gc.collect()`` with the model and a copy
alive. Prints wall and CPU seconds and the load average.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import time

import pandas as pd
import torch

from snn_explorer.core.model import detached_copy, reset_all, shared_storage_copy, tensors_with_history
from snn_explorer.estimator.profile.step import batch_slice, forward_loss
from snn_explorer.zoo import SpikingMLP


def _deepcopy_detached(model: torch.nn.Module) -> torch.nn.Module:
    """The profile's private copy as it was made before: ``copy.deepcopy`` with the history tensors detached."""
    memo = {id(t): t.detach().clone() for t in tensors_with_history(model)}
    copied = copy.deepcopy(model, memo)
    reset_all(copied)
    return copied


def _timed(make, model, rounds: int) -> tuple:
    """(wall s, CPU s) of the fastest of ``rounds`` calls of ``make(model)``, the collector paused."""
    best = (float("inf"), float("inf"))
    for _ in range(rounds):
        gc.collect()
        gc.disable()
        try:
            wall, cpu = time.perf_counter(), time.process_time()
            copied = make(model)
            best = min(best, (time.perf_counter() - wall, time.process_time() - cpu))
        finally:
            gc.enable()
        del copied
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modules", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = SpikingMLP(in_features=16, hidden=(16,) * max(1, (args.modules - 5) // 3), num_classes=8,
                       stepping="all_steps")
    x, y = batch_slice(torch.rand(2, 4, 16), None, 2, 4)
    forward_loss(model, x, y)
    rows = [(name,) + _timed(make, model, args.rounds) for name, make in (
        ("copy.deepcopy (detached)", _deepcopy_detached), ("detached_copy (module walk)", detached_copy),
        ("shared_storage_copy (TP replica)", shared_storage_copy))]
    kept = detached_copy(model)
    wall, cpu = time.perf_counter(), time.process_time()
    gc.collect()
    rows.append(("gc.collect() with the model and a copy alive", time.perf_counter() - wall, time.process_time() - cpu))
    del kept
    table = pd.DataFrame(rows, columns=["what", "wall s", "CPU s"])
    print(f"{sum(1 for _ in model.modules())} modules; fastest of {args.rounds}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"load average {os.getloadavg()[0]:.2f} / {os.getloadavg()[1]:.2f} / {os.getloadavg()[2]:.2f}")


if __name__ == "__main__":
    main()
