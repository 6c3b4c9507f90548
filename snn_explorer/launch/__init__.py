"""Run functions and plans on N ranks from a notebook or terminal, on torch's elastic engine.

``launch(fn, nprocs=...)`` for any function, ``launch_plan(model, plan, train_fn, steps=...)``
for a plan, ``report(...)`` from inside a rank, ``export_job(...)`` for torchrun / Slurm.
"""
from .errors import LaunchError, RankFailure
from .launcher import launch, resolve_backend
from .progress import report
from .result import LaunchResult, TrainResult

__all__ = ["LaunchError", "LaunchResult", "RankFailure", "TrainResult", "launch", "report", "resolve_backend"]
