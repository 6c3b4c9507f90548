"""Run functions and plans on N ranks from a notebook or terminal, on torch's elastic engine.

``launch(fn, nprocs=...)`` for any function, ``launch_plan(model, plan, train_fn, steps=...)``
for a plan, ``report(...)`` from inside a rank, ``export_job(...)`` for torchrun / Slurm. The
engine underneath (agent, payload, progress, failures) is :mod:`snn_explorer.ranks`.
"""
from ..ranks import LaunchError, LaunchResult, RankFailure, report, resolve_backend
from .export import ExportedJob, export_job
from .launching import launch
from .options import ExportOptions, LaunchOptions, split_keywords
from .plan_run import launch_plan
from .result import TrainResult

__all__ = ["ExportOptions", "ExportedJob", "LaunchOptions", "split_keywords", "LaunchError", "LaunchResult", "RankFailure", "TrainResult", "export_job", "launch",
           "launch_plan", "report", "resolve_backend"]
