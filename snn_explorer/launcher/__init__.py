"""Run functions and plans on N ranks from a notebook or terminal, on torch's elastic engine.

``launch(fn, nprocs=...)`` for any function, ``launch_plan(model, plan, train_fn, steps=...)``
for a plan, ``report(...)`` from inside a rank, ``export_job(...)`` for torchrun / Slurm.
"""
from .errors import LaunchError, RankFailure
from .export import ExportedJob, export_job
from .launching import launch, resolve_backend
from .plan_run import launch_plan
from .progress import report
from .result import LaunchResult, TrainResult

__all__ = ["ExportedJob", "LaunchError", "LaunchResult", "RankFailure", "TrainResult", "export_job", "launch",
           "launch_plan", "report", "resolve_backend"]
