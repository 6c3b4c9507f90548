"""ExplorerUI: ipywidgets controls over an Explorer; every change re-plans, re-estimates, re-renders.

Results are written as widget state (``Output.outputs``), never printed, so a headless test, nbval
and a browser all see the same thing. Opening estimates only what the shown comparison needs;
a layout not estimated before is measured when the controls first reach it, and cached after
(:meth:`Explorer.prepare` measures every plan of a world size up front, for who wants that).
On a model of more than :data:`AUTO_ESTIMATE_MAX_MODULES` modules the UI opens without estimating
(a first estimate runs the model forward and backward at four sizes, seconds to minutes there):
the comparison and the charts wait for the ``estimate`` button, or for "estimate on change".
"""
from __future__ import annotations

import html
import json
from contextlib import contextmanager
from math import gcd
from typing import Dict, List, Optional, Union

import ipywidgets as w

from ..core import SNNDistributedPlan
from ..core.common import MODES, PRECISIONS, dp_tp_splits
from ..core.levers import ACTIVATION_CHECKPOINTING
from ..core.planning import SCHEDULES, SNN_DISTRIBUTED_PREFERENCES
from ..estimator import hardware_profiles
from . import charts
from .compare import compare_table, plan_label, readable, style_compare
from .fit_view import fit_chart, fit_summary, fit_summary_html, fit_table
from .launch_panel import LaunchPanel
from .modules import candidates_table
from .render import figure_data, message_data, message_html, show, styler_data, table_data
from .ui_choices import ControlChoices

TABS = ("Modules", "Candidates", "Compare", "Charts", "Launch", "Fit")
CHARTS = ("memory", "communication", "step time", "pareto", "mesh", "activations vs T", "pipeline")
GATES = ("allow_experimental_conv_tp", "allow_experimental_spikformer_tp", "allow_zero_optimizer",
         "allow_activation_checkpointing", "allow_cpu_offload", "allow_mixed_precision", "allow_spike_compression")
#: The precision choices: "auto" is the objective's (bf16 behind allow_mixed_precision, else fp32).
PRECISION_CHOICES = ("auto",) + PRECISIONS
CHECKPOINTING = ("auto",) + ACTIVATION_CHECKPOINTING
PP_SCHEDULE_CHOICES = ("auto",) + tuple(SCHEDULES)
#: The mesh sliders in the order they keep their sizes when another one moves (dp takes what is left).
KEEP = ("pp", "tp", "dp")
MAX_WORLD = 1024
#: The hardware choice that means this machine's calibration (``Explorer.hardware = None``).
THIS_MACHINE = "this machine (calibrated)"
ERRORS = (ValueError, TypeError, KeyError, NotImplementedError)
#: Said above the Fit tab: what it searches.
FIT_HELP = ("<small>the fastest plan for the world size whose estimated peak fits 'budget MiB': modes, meshes "
            "and the levers the gates allow (allow_activation_checkpointing, allow_spike_compression)</small>")
#: Above this many modules the UI does not estimate by itself (see the module doc).
AUTO_ESTIMATE_MAX_MODULES = 400


class EstimatePending(ValueError):
    """The shown plans are not estimated yet and estimating on change is off."""


def divisors(n: int) -> List[int]:
    """Every divisor of ``n``, ascending (the sizes a mesh slider offers on ``n`` ranks)."""
    return [split.get("tp", 1) for split in dp_tp_splits(n)]


def fit_sizes(world: int, sizes: Dict[str, int], moved: Optional[str] = None) -> Dict[str, int]:
    """pp, tp and dp sizes whose product is ``world``: ``moved`` keeps its size, the others in
    :data:`KEEP` order keep what of theirs divides the ranks left (the gcd), and the last takes the rest."""
    order = [moved] * (moved is not None) + [d for d in KEEP if d != moved]
    out, rest = {}, world
    for dim in order[:-1]:
        out[dim] = gcd(sizes[dim], rest)
        rest //= out[dim]
    out[order[-1]] = rest
    return out


class ExplorerUI(ControlChoices):
    """The controls, the plan list, the message line and the tabs of one :class:`Explorer`.

    ``current`` is the plan the controls describe (None when they are invalid, ``error`` says
    why); the comparison shows the pinned plans (``explorer.plans``) and ``current``.
    """

    def __init__(self, explorer, world_size: int = 4, auto_estimate: Optional[bool] = None):
        self.ex = explorer
        if auto_estimate is None:
            auto_estimate = sum(1 for _ in explorer.model.modules()) <= AUTO_ESTIMATE_MAX_MODULES
        self._estimating = False  # set while the estimate button's refresh runs
        self.current: Optional[SNNDistributedPlan] = None
        self.error = ""
        self.compare_table = None  # the DataFrame behind the Compare tab (None when nothing is compared)
        self._syncing = False
        self._dirty = set(TABS)
        self._build(world_size, bool(auto_estimate))
        self.refresh()

    # ---- widgets
    def _build(self, world: int, auto_estimate: bool) -> None:
        """Every widget, then the layout that holds them and their wiring."""
        style = {"description_width": "125px"}  # "checkpoint every" whole
        self._build_mesh_controls(world, style)
        self._build_step_controls(style)
        self._build_actions(auto_estimate)
        self._build_views()
        self._lay_out()
        self._wire()

    def _build_mesh_controls(self, world: int, style: dict) -> None:
        """The objective, the world size, the mesh sizes (a button per divisor: a slider's readout invites typing
        that a selection slider ignores), the pipeline's fields and the mode."""
        self.objective = w.Dropdown(options=SNN_DISTRIBUTED_PREFERENCES, value="speed", description="objective",
                                    style=style)
        self.world_size = w.IntSlider(value=world, min=1, max=MAX_WORLD, description="world size", style=style)
        sizes = dict(style=dict(style, button_width="36px"), layout=w.Layout(width="max-content"))
        self.dp = w.ToggleButtons(options=divisors(world), value=world, description="dp", **sizes)
        self.tp = w.ToggleButtons(options=divisors(world), value=1, description="tp", **sizes)
        self.pp = w.ToggleButtons(options=divisors(world), value=1, description="pp", **sizes)
        self.mesh = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        self.pp_schedule = w.Dropdown(options=PP_SCHEDULE_CHOICES, value="auto", description="pp schedule",
                                      style=style)
        self.pp_microbatches = w.BoundedIntText(value=0, min=0, max=2 ** 24, description="micro-batches",
                                                tooltip="0: the planner's choice", style=style)
        self.pp_virtual_stages = w.BoundedIntText(value=0, min=0, max=1024, description="virtual stages",
                                                  tooltip="0: the planner's choice", style=style)
        self.mode = w.Dropdown(options=("auto",) + tuple(MODES), value="auto", description="mode", style=style)

    def _build_step_controls(self, style: dict) -> None:
        """The gates and what shapes a rank's step: levers, batch, time steps, budget, hardware, precision."""
        self.gates = {g: w.Checkbox(value=g == "allow_zero_optimizer", description=g, indent=False) for g in GATES}
        self.checkpointing = w.Dropdown(options=CHECKPOINTING, value="auto", description="checkpointing",
                                        style=style)
        self.checkpoint_every = w.BoundedIntText(value=1, min=1, max=1024, description="checkpoint every",
                                                 style=style,
                                                 tooltip="every k-th block, or time chunks of k steps; 1 under "
                                                         "'auto': k chosen by estimate")
        self.batch_size = w.BoundedIntText(value=self.ex.batch_size, min=1, max=2 ** 24, description="batch size",
                                           style=style)
        self.time_steps = w.BoundedIntText(value=self.ex.time_steps, min=1, max=100_000, description="time steps",
                                           style=style)
        self.memory_budget = w.BoundedFloatText(value=0.0, min=0.0, max=1e9, step=64.0,
                                                description="budget MiB", style=style)
        self.hardware = self._hardware_control(style)
        self.precision = w.Dropdown(options=PRECISION_CHOICES, value="auto", description="precision", style=style,
                                    tooltip="bf16 / fp16 need the allow_mixed_precision gate; auto: the objective's")
        self.neuron_state_fp32 = w.Checkbox(value=True, description="keep neuron state fp32", indent=False,
                                            tooltip="membranes and traces in fp32 while layers compute in bf16 / fp16")
        self.hardware_note = w.HTML()  # says when the next estimate calibrates this machine first

    def _build_actions(self, auto_estimate: bool) -> None:
        """The pin, clear and estimate buttons and the estimate-on-change switch."""
        self.pin_button = w.Button(description="pin plan", icon="thumb-tack",
                                   tooltip="keep the current plan in the comparison")
        self.clear_button = w.Button(description="clear pins")
        self.auto_estimate = w.Checkbox(value=auto_estimate, description="estimate on change", indent=False,
                                        tooltip="re-estimate after every change (off: only when 'estimate' is pressed)")
        self.estimate_button = w.Button(description="estimate", icon="calculator",
                                        tooltip="estimate the plans the comparison shows")

    def _build_views(self) -> None:
        """Where results show: the message, the plan list, the tabs' outputs, the chart pickers, the launcher."""
        self.message = w.HTML()
        self.progress = w.VBox()  # a wait's bar while the controls wait over two seconds
        self.plan_list = w.HTML()
        self.outputs = {name: w.Output() for name in TABS}
        self.chart = w.Dropdown(options=CHARTS, value="memory", description="chart")
        modules = [n for n, m in self.ex.model.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
        self.chart_module = w.Dropdown(options=modules or [""], description="module")
        self.launcher = LaunchPanel(self)
        self.fit_pin_button = w.Button(description="pin fitted plan", icon="thumb-tack",
                                       tooltip="keep the plan the Fit tab found in the comparison")

    def _lay_out(self) -> None:
        """The controls beside the gates, above the messages and the tabs."""
        above = {"Charts": w.HBox([self.chart, self.chart_module]), "Launch": self.launcher.widget,
                 "Fit": w.HBox([self.fit_pin_button, w.HTML(FIT_HELP)])}
        self.tabs = w.Tab(children=[w.VBox([above[n], self.outputs[n]]) if n in above else self.outputs[n]
                                    for n in TABS], titles=TABS, selected_index=TABS.index("Compare"))
        controls = w.VBox([self.objective, self.world_size, self.dp, self.tp, self.pp, self.pp_schedule,
                           self.pp_microbatches, self.pp_virtual_stages,
                           w.HTML("<small>micro-batches, virtual stages: 0 = the planner's choice</small>"),
                           self.mode, self.batch_size, self.time_steps, self.memory_budget, self.hardware,
                           self.hardware_note, self.precision, self.neuron_state_fp32, self.checkpointing,
                           self.checkpoint_every])
        gates = w.VBox([w.HTML("<b>feature gates</b>"), *self.gates.values(),
                        w.HBox([self.pin_button, self.clear_button]),
                        w.HBox([self.estimate_button, self.auto_estimate])])
        self.widget = w.VBox([w.HBox([controls, gates]), self.progress, self.message, self.plan_list, self.tabs])

    def _wire(self) -> None:
        """Every control's effect: a mesh slider keeps the world size, the rest re-plan or re-render."""
        self.world_size.observe(self._on_world, "value")
        for name, slider in self.mesh.items():
            slider.observe(lambda _, moved=name: self._link(moved), "value")
        for control in (self.objective, self.mode, self.batch_size, self.time_steps, self.memory_budget,
                        self.checkpointing, self.checkpoint_every, self.pp_schedule, self.pp_microbatches,
                        self.pp_virtual_stages, self.precision, self.neuron_state_fp32, *self.gates.values()):
            control.observe(self.refresh, "value")
        self.hardware.observe(self._on_hardware, "value")
        self.chart.observe(lambda _: self._render_tab("Charts"), "value")
        self.chart_module.observe(lambda _: self._render_tab("Charts"), "value")
        self.launcher.plan.observe(lambda _: self._render_tab("Launch") if self._shown_tab() == "Launch" else None,
                                   "value")
        self.tabs.observe(lambda c: self._render_tab(TABS[c["new"]]) if c["new"] is not None else None,
                          "selected_index")
        self.pin_button.on_click(lambda _: self.pin())
        self.estimate_button.on_click(lambda _: self.estimate())
        self.auto_estimate.observe(self.refresh, "value")
        self.clear_button.on_click(lambda _: self.clear())
        self.fit_pin_button.on_click(lambda _: self.pin_fitted())

    def _hardware_control(self, style) -> "w.Dropdown":
        """Where step times are predicted: this machine, a built-in profile, or the Explorer's own profile."""
        options = [THIS_MACHINE, *hardware_profiles()]
        own = self.ex.hardware
        if own is not None and not isinstance(own, str):
            options.append(f"given: {own.name}")
        value = options[-1] if own is not None and not isinstance(own, str) else own or THIS_MACHINE
        self._given_hardware = own
        return w.Dropdown(options=options, value=value, description="hardware", style=style)

    def _on_hardware(self, change) -> None:
        new = change["new"]
        self.ex.hardware = (None if new == THIS_MACHINE else self._given_hardware if new.startswith("given: ")
                            else new)
        self.refresh()

    def _on_world(self, change) -> None:
        self._set_mesh(fit_sizes(change["new"], self._sizes()), divisors(change["new"]))

    def _link(self, moved: str) -> None:
        """Keep pp x dp x tp equal to the world size after the ``moved`` slider changed."""
        if not self._syncing:
            self._set_mesh(fit_sizes(self.world_size.value, self._sizes(), moved))

    def _sizes(self) -> Dict[str, int]:
        return {name: slider.value for name, slider in self.mesh.items()}

    def _set_mesh(self, sizes: Dict[str, int], options: Optional[List[int]] = None) -> None:
        """Set the mesh sliders (and their ``options``) without re-planning in between, then refresh once."""
        self._syncing = True
        try:
            for name, slider in self.mesh.items():
                if options is not None:
                    slider.options = options
                slider.value = sizes[name]
        finally:
            self._syncing = False
        self.refresh()

    # ---- state (topology, choices, budget_bytes: :class:`~.ui_choices.ControlChoices`)
    def shown(self) -> List[tuple]:
        """(label, plan) of every plan in the comparison: the pinned ones, then the current one."""
        rows = [(f"#{i + 1} {plan_label(p)}", p) for i, p in enumerate(self.ex.plans)]
        if self.current is not None and self.ex.index_of(self.current) is None:
            rows.append((f"current {plan_label(self.current)}", self.current))
        return rows

    # ---- actions
    def pin(self) -> Optional[SNNDistributedPlan]:
        """Keep the current plan in the comparison (adds it to ``explorer.plans`` unless a plan of the
        same layout is pinned already); returns the pinned plan."""
        if self.current is None:
            self.refresh()
            return None
        pinned = self.ex.add(self.current)
        self.refresh()
        return pinned

    def fit(self):
        """The Fit tab's :meth:`Explorer.fit`: the budget, world size, batch and gates of the controls;
        ValueError saying what is missing or that nothing fits."""
        if self.budget_bytes is None:
            raise ValueError("no memory budget: set 'budget MiB' above to find the fastest plan within it")
        return self.ex.fit(self.budget_bytes, self.world_size.value, batch_size=self.batch_size.value,
                           features={g: c.value for g, c in self.gates.items()})

    def pin_fitted(self) -> Optional[SNNDistributedPlan]:
        """Pin the plan the Fit tab found (what its button does); None, saying why, when there is none."""
        try:
            pinned = self.ex.add(self.fit().plan)
        except ERRORS as exc:
            self.message.value = message_html(f"no fitted plan to pin: {exc}", "error")
            return None
        self.refresh()
        return pinned

    def clear(self) -> None:
        self.ex.clear()
        self.refresh()

    def estimate(self) -> None:
        """Estimate the plans the comparison shows now (what the ``estimate`` button does) and re-render."""
        self._estimating = True
        try:
            self.refresh()
        finally:
            self._estimating = False

    @contextmanager
    def _waits_here(self):
        """While the UI acts, the Explorer's waits over two seconds show their progress in the UI."""
        outer, self.ex.progress_box = self.ex.progress_box, self.progress
        try:
            yield
        finally:
            self.ex.progress_box = outer

    def refresh(self, *_) -> None:
        """Re-plan from the controls, re-estimate (cached), re-render the comparison and the visible tab."""
        if self._syncing:
            return
        with self._waits_here():
            self._refresh()

    def _refresh(self) -> None:
        self.hardware_note.value = ("<small>not calibrated yet: the first estimate calibrates this machine "
                                    "(about a minute, once; progress below)</small>" if self.ex.will_calibrate else "")
        for control in (self.pp_schedule, self.pp_microbatches, self.pp_virtual_stages):
            control.disabled = self.pp.value == 1  # used by pipelines only
        self.neuron_state_fp32.disabled = self.precision.value in ("auto", "fp32")  # a half precision's option
        try:
            self.current, self.error = self.ex.make_plan(**self.choices()), ""
        except ERRORS as exc:
            self.current, self.error = None, f"invalid choice: {exc}"
        self._render_compare()
        self._render_plan_list()
        self.launcher.sync()
        self._dirty = set(TABS) - {"Compare"}
        selected = self.tabs.selected_index
        if selected is not None and TABS[selected] != "Compare":
            self._render_tab(TABS[selected])

    # ---- rendering
    def _estimates(self):
        shown = self.shown()
        plans = [p for _, p in shown]
        if not (self._estimating or self.auto_estimate.value):
            missing = [label for label, p in shown if not self.ex.is_estimated(p, self.time_steps.value)]
            if missing:
                raise EstimatePending(f"not estimated yet: {', '.join(missing)}; press 'estimate' (or tick "
                                      "'estimate on change'); a model's first estimate runs it forward and backward a dozen times")
        return [label for label, _ in shown], self.ex.estimates(plans, self.time_steps.value)

    def _render_compare(self) -> None:
        out, self.compare_table = self.outputs["Compare"], None
        if not self.shown():
            show(out, message_data("no plan to compare: fix the choice above or pin a plan", "info"))
            self.message.value = message_html(self.error, "error")
            return
        try:
            labels, ests = self._estimates()
        except EstimatePending as exc:
            show(out, message_data(str(exc), "info"))
            self.message.value = message_html(self.error, "error")
            return
        except ERRORS as exc:
            show(out, message_data(f"cannot estimate: {exc}", "error"))
            self.message.value = message_html(self.error, "error")
            return
        table = compare_table(ests, labels, self.budget_bytes)
        show(out, styler_data(style_compare(table), readable(table, 40).to_string()))
        self.message.value = message_html(self.error, "error")
        self.compare_table = table

    def _render_plan_list(self) -> None:
        items = [f"<li>{html.escape(label)}{'' if label.startswith('#') else ' (not pinned)'}</li>"
                 for label, _ in self.shown()]
        same = None if self.current is None else self.ex.index_of(self.current)
        if same is not None:
            items.append(f"<li>current = #{same + 1} (already pinned)</li>")
        self.plan_list.value = f"<b>plans</b><ul>{''.join(items)}</ul>" if items else "<b>plans</b>: none"

    def _render_tab(self, name: str) -> None:
        with self._waits_here():
            self._render(name)

    def _render(self, name: str) -> None:
        if name == "Compare":
            return self._render_compare()
        out = self.outputs[name]
        try:
            data = self._tab_data(name)
            show(out, *(data if isinstance(data, list) else [data]))
        except ERRORS as exc:
            show(out, message_data(f"cannot show {name}: {exc}", "error"))
        self._dirty.discard(name)

    def _shown_tab(self) -> Optional[str]:
        return None if self.tabs.selected_index is None else TABS[self.tabs.selected_index]

    def _tab_data(self, name: str) -> Union[dict, List[dict]]:
        plan = self.current
        if name in ("Modules", "Candidates"):
            table = self.ex.modules_for(plan)
            return table_data(table if name == "Modules" else candidates_table(table))
        if name == "Launch":
            return self._launch_code(self.launcher.plan.value or plan)
        if name == "Fit":
            result = self.fit()
            return [{"text/html": fit_summary_html(result), "text/plain": fit_summary(result)},
                    table_data(fit_table(result)), figure_data(fit_chart(result))]
        return figure_data(self.figure())

    def _launch_code(self, plan: Optional[SNNDistributedPlan]) -> dict:
        """What the Launch tab's buttons do, as code a cell can run, and the plan as its file holds it."""
        if plan is None:
            return message_data(self.error or "no plan", "error")
        code = ("plan = ex.ui.launcher.plan.value   # the plan chosen above (ex: this Explorer)\n"
                f"result = ex.launch(plan, steps=5)   # {plan.world_size} ranks, on ex.example_input / ex.labels\n"
                "# your own step: ex.launch(plan, train_fn, steps=5, train_kwargs={...}) with\n"
                "#   train_fn(runtime, step, batch, state, **train_kwargs) -> loss\n"
                "job = ex.export(plan, None, 'snn-job', steps=5)   # torchrun / Slurm (train_fn in place of None)\n"
                "# the plan file (save plan / load plan):\n")
        text = code + json.dumps(plan.to_dict(), indent=1, sort_keys=True)
        return {"text/html": f"<pre>{html.escape(text)}</pre>", "text/plain": text}

    def _plan(self) -> SNNDistributedPlan:
        """The current plan; ValueError saying why there is none."""
        if self.current is None:
            raise ValueError(self.error or "no plan")
        return self.current

    def figure(self):
        """The chart the Charts tab shows for the current choices."""
        kind = self.chart.value
        if kind == "mesh":
            return self.ex.mesh_chart(self._plan(), self.chart_module.value or None)
        if kind == "activations vs T":
            steps = self.time_steps.value
            return self.ex.activation_chart(self._plan(), sorted({max(1, steps // 4), max(1, steps // 2), steps,
                                                                   2 * steps}))
        if kind == "pipeline":
            return self.ex.pipeline_chart(self._plan())
        labels, ests = self._estimates()
        if kind in ("memory", "pareto"):
            make = charts.memory_chart if kind == "memory" else charts.pareto_chart
            return make(ests, labels, memory_budget=self.budget_bytes)
        make = {"communication": charts.comm_chart, "step time": charts.step_time_chart}
        return make[kind](ests, labels)
