"""The Launch tab's controls: run a shown plan on its ranks (live per-rank bars, a stop button,
the result or the error in the tab), save / load a plan as JSON, export a torchrun / Slurm job.

A launch runs in a background thread, so the notebook (and the stop button) stays responsive;
``LaunchPanel.thread`` is that thread. Stop ends the ranks: those that have started are sent
SIGTERM at once, and the launch ends at the next event any rank writes (its start, a step, its end).
"""
from __future__ import annotations

import html
import json
import os
import signal
import threading
import time
from typing import Callable, List, Optional

import ipywidgets as w
import pandas as pd

from ..core import SNNDistributedPlan, preflight
from ..core.common import loads
from ..launcher import LaunchOptions
from ..ranks import LaunchError
from .compare import plan_label
from .steps import example_batch, example_step

#: A plan file larger than this is refused before it is read (a plan is a few KiB of JSON).
MAX_PLAN_BYTES = 1 << 20
ERRORS = (ValueError, TypeError, KeyError, NotImplementedError, OSError)


class LaunchStopped(Exception):
    """The stop button ended the launch."""


def _message(text: str, kind: str = "info") -> str:
    color = {"error": "#a94442", "info": "#31708f", "done": "#3c763d"}[kind]
    return f'<pre style="color: {color}; white-space: pre-wrap">{html.escape(text)}</pre>'


def losses_table(values: List[list]) -> pd.DataFrame:
    """Step x rank losses of a launch result (``result.values``: per rank, per step metrics)."""
    return pd.DataFrame({f"rank {r}": [m.get("loss") for m in steps] for r, steps in enumerate(values)},
                        index=pd.RangeIndex(len(values[0]) if values else 0, name="step"))


def read_plan(path: str) -> SNNDistributedPlan:
    """The plan a JSON file holds (``SNNDistributedPlan.to_dict``); JSON only, nothing in it runs."""
    size = os.path.getsize(path)
    if size > MAX_PLAN_BYTES:
        raise ValueError(f"plan file {path!r} is {size} bytes; a plan is JSON of a few KiB (at most {MAX_PLAN_BYTES})")
    with open(path, encoding="utf-8") as fh:
        return SNNDistributedPlan.from_dict(loads(fh.read()))


class LaunchPanel:
    """The Launch tab of an :class:`~snn_explorer.explorer.ui.ExplorerUI`.

    ``train_fn`` / ``train_kwargs``: the step function the launch and the export run (None: the
    Explorer's example batch with cross-entropy, see :mod:`~snn_explorer.explorer.steps`).
    ``result`` / ``error``: the last launch's :class:`TrainResult` / message.
    """

    def __init__(self, ui):
        self.ui = ui
        self.train_fn: Optional[Callable] = None
        self.train_kwargs: Optional[dict] = None
        self.result, self.error, self.thread = None, "", None
        self._stop, self._pids = threading.Event(), set()
        style = {"description_width": "110px"}
        self.plan = w.Dropdown(description="plan", style=style, layout=w.Layout(width="480px"))
        self.steps = w.BoundedIntText(value=5, min=1, max=10 ** 7, description="steps", style=style)
        self.lr = w.BoundedFloatText(value=1e-2, min=0.0, max=10.0, step=1e-3, description="learning rate",
                                     style=style)
        self.timeout = w.BoundedIntText(value=120, min=5, max=7 * 86400, description="timeout s", style=style,
                                        tooltip="seconds a rank may go without a heartbeat before the launch ends")
        self.launch_button = w.Button(description="launch", icon="play", button_style="success")
        self.stop_button = w.Button(description="stop", icon="stop", button_style="danger", disabled=True)
        self.bars = w.VBox()
        self.status = w.HTML()
        self.output = w.HTML()
        self.plan_file = w.Text(value="plan.json", description="plan file", style=style)
        self.save_button = w.Button(description="save plan", icon="save")
        self.load_button = w.Button(description="load plan", icon="folder-open")
        self.job_dir = w.Text(value="snn-job", description="job folder", style=style)
        self.export_button = w.Button(description="export job", icon="download",
                                      tooltip="a torchrun command and a Slurm script for the plan")
        self.files = w.HTML()
        self.widget = w.VBox([self.plan, w.HBox([self.steps, self.lr, self.timeout]),
                              w.HBox([self.launch_button, self.stop_button]), self.status, self.bars, self.output,
                              w.HBox([self.plan_file, self.save_button, self.load_button]),
                              w.HBox([self.job_dir, self.export_button]), self.files])
        self.launch_button.on_click(lambda _: self.launch())
        self.stop_button.on_click(lambda _: self.stop())
        self.save_button.on_click(lambda _: self.save())
        self.load_button.on_click(lambda _: self.load())
        self.export_button.on_click(lambda _: self.export())

    # ---- the plan choice
    def sync(self) -> None:
        """Offer the plans the comparison shows: when the plan on screen (the controls' current plan, or the
        pinned plan of its layout) changed, choose it; else keep the chosen one while it is shown."""
        options = [(label, plan) for label, plan in self.ui.shown()]
        keep = self.plan.value
        self.plan.options = options
        plans = [p for _, p in options]
        current = self.ui.current
        at = self.ui.ex.index_of(current) if current is not None else None
        on_screen = self.ui.ex.plans[at] if at is not None else current if current in plans else None
        moved = current != getattr(self, "_on_screen", None)
        self._on_screen = current
        if on_screen is not None and (moved or keep not in plans):
            self.plan.value = on_screen
        elif keep in plans:
            self.plan.value = keep

    def chosen(self) -> SNNDistributedPlan:
        if self.plan.value is None:
            raise ValueError(self.ui.error or "no plan: fix the choice above or pin a plan")
        return self.plan.value

    def _step(self):
        """The step function and its keyword arguments."""
        if self.train_fn is not None:
            return self.train_fn, self.train_kwargs
        return example_step(), example_batch(self.ui.ex.example_input, self.ui.ex.labels)

    # ---- launching
    def launch(self) -> Optional[threading.Thread]:
        """Start the chosen plan on its ranks in a background thread (returned; None if it could not start)."""
        if self.thread is not None and self.thread.is_alive():
            self.status.value = _message("a launch is running; stop it first", "error")
            return None
        try:
            plan = self.chosen()
            train_fn, train_kwargs = self._step()
            preflight(self.ui.ex.model, plan)
        except ERRORS as exc:
            self.error = f"cannot launch: {exc}"
            self.status.value = _message(self.error, "error")
            return None
        self.result, self.error = None, ""
        self._stop.clear()
        self._pids.clear()
        self.output.value = ""
        self._rows(plan.world_size)
        self.status.value = _message(f"starting {plan.world_size} ranks for {self.steps.value} steps ...")
        self.launch_button.disabled, self.stop_button.disabled = True, False
        args = (plan, train_fn, train_kwargs, self.steps.value, self.lr.value, self.timeout.value)
        self.thread = threading.Thread(target=self._run, args=args, daemon=True, name="snn-explorer-launch")
        self.thread.start()
        return self.thread

    def _run(self, plan, train_fn, train_kwargs, steps, lr, timeout) -> None:
        started = time.monotonic()
        try:
            self.result = self.ui.ex.launch(plan, train_fn, steps=steps, optimizer={"lr": lr},
                                            train_kwargs=train_kwargs,
                                            options=LaunchOptions(timeout=timeout, progress=self._progress))
            self._show_result(plan, time.monotonic() - started)
        except LaunchStopped:
            self.error = f"stopped after {time.monotonic() - started:.1f} s: every rank was ended"
            self.status.value = _message(self.error, "error")
        except LaunchError as exc:
            self.error = str(exc)
            self.status.value = _message("the launch failed:", "error")
            self.output.value = _message(self.error, "error")
        except Exception as exc:  # noqa: BLE001 - a thread's error must reach the tab, not vanish
            self.error = f"{type(exc).__name__}: {exc}"
            self.status.value = _message(f"the launch failed: {self.error}", "error")
        finally:
            self.launch_button.disabled, self.stop_button.disabled = False, True

    def _rows(self, world: int) -> None:
        self._bar = [w.IntProgress(value=0, min=0, max=self.steps.value, layout=w.Layout(width="40%"))
                     for _ in range(world)]
        self._text = [w.HTML("starting") for _ in range(world)]
        self.bars.children = [w.HBox([w.Label(f"rank {r}", layout=w.Layout(width="60px")), self._bar[r],
                                      self._text[r]]) for r in range(world)]

    def _progress(self, snapshot: List[dict]) -> None:
        """The launch's progress callback (its thread): bars, pids to stop, and the stop itself."""
        for state in snapshot:
            rank = state["rank"]
            if state.get("pid"):
                self._pids.add(state["pid"])
            if state.get("step") is not None:
                self._bar[rank].value = min(state["step"], self._bar[rank].max)
            self._bar[rank].bar_style = {"done": "success", "failed": "danger"}.get(state["status"], "")
            loss = state.get("loss")
            self._text[rank].value = html.escape(" · ".join(
                [state["status"]] + ([f"step {state['step']}/{state.get('total')}"] if state.get("step") else [])
                + ([f"loss {loss:.4g}"] if isinstance(loss, float) else []) + [state.get("message") or ""]).strip(" ·"))
        if self._stop.is_set():
            raise LaunchStopped()

    def stop(self) -> None:
        """End the running launch: SIGTERM its started ranks; the launch ends at the next rank event."""
        if self.thread is None or not self.thread.is_alive():
            return
        self._stop.set()
        self.status.value = _message("stopping: ending the ranks ...")
        for pid in list(self._pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass

    def _show_result(self, plan: SNNDistributedPlan, seconds: float) -> None:
        result = self.result
        self.status.value = _message(f"done: {plan_label(plan)} on {result.backend} ranks, "
                                     f"{len(result.values[0])} steps in {seconds:.1f} s", "done")
        self.output.value = losses_table(result.values).reset_index().to_html(index=False)

    # ---- files
    def _path(self, text: w.Text) -> str:
        if not text.value.strip():
            raise ValueError(f"{text.description} is empty; give a path")
        return os.path.abspath(os.path.expanduser(text.value.strip()))

    def save(self) -> Optional[str]:
        """Write the chosen plan as JSON to the plan file; returns its path."""
        try:
            path, plan = self._path(self.plan_file), self.chosen()
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(json.dumps(plan.to_dict(), indent=2, sort_keys=True))
        except ERRORS as exc:
            self.files.value = _message(f"cannot save the plan: {exc}", "error")
            return None
        self.files.value = _message(f"saved {plan_label(plan)} to {path}", "done")
        return path

    def load(self) -> Optional[SNNDistributedPlan]:
        """Read a plan from the plan file, check it against the model, pin it and choose it."""
        try:
            path = self._path(self.plan_file)
            plan = read_plan(path)
            preflight(self.ui.ex.model, plan)
        except ERRORS as exc:
            self.files.value = _message(f"cannot load a plan: {exc}", "error")
            return None
        pinned = self.ui.ex.add(plan)
        self.ui.refresh()
        self.plan.value = pinned
        self.files.value = _message(f"loaded {plan_label(plan)} from {path}: pinned as "
                                    f"#{self.ui.ex.index_of(pinned) + 1}", "done")
        return pinned

    def export(self):
        """Write the chosen plan as a torchrun / Slurm job into the job folder; returns the ExportedJob."""
        try:
            path, plan = self._path(self.job_dir), self.chosen()
            train_fn, train_kwargs = self._step()
            job = self.ui.ex.export(plan, train_fn, path, steps=self.steps.value, optimizer={"lr": self.lr.value},
                                    train_kwargs=train_kwargs)
        except ERRORS as exc:
            self.files.value = _message(f"cannot export: {exc}", "error")
            return None
        self.files.value = _message(f"exported to {job.path}: {', '.join(sorted(os.listdir(job.path)))}\n"
                                    f"run on every node: bash {job.command_file}   (or sbatch {job.sbatch_file})\n"
                                    f"{job.command}", "done")
        return job
