"""The Explorer's charts and shard layouts (a mixin of :class:`~snn_explorer.explorer.Explorer`)."""
from __future__ import annotations

from typing import Optional, Sequence

from ..core import SNNDistributedPlan
from ..core.common import names_text
from ..core.tp import STYLES
from ..estimator import activation_curve
from . import charts
from .compare import unique_labels
from .layout import shard_layout
from .pipeline_view import pipeline_chart


class ExplorerCharts:
    """Charts of an Explorer's plans; needs ``model``, ``analysis``, ``example_input``, ``estimates``,
    ``estimate``, ``time_step_module`` and ``_profile`` from the Explorer."""

    def _chart(self, name, plans, time_steps, **kwargs):
        ests = self.estimates(plans, time_steps)
        return getattr(charts, name)(ests, unique_labels([e.plan for e in ests]), **kwargs)

    def memory_chart(self, plans=None, *, time_steps=None, memory_budget=None):
        """Stacked per-rank memory of each plan (a Figure), ``memory_budget`` (bytes) as a line."""
        return self._chart("memory_chart", plans, time_steps, memory_budget=memory_budget)

    def comm_chart(self, plans=None, *, time_steps=None, measure="wire"):
        """Communication per step of each plan (a Figure): ``measure="wire"`` the bytes each rank sends on the
        wire, ``"buffer"`` the collectives' buffers (:func:`~snn_explorer.explorer.charts.comm_chart`)."""
        return self._chart("comm_chart", plans, time_steps, measure=measure)

    def step_time_chart(self, plans=None, *, time_steps=None, measured=None):
        """Predicted step time per plan split into compute / exposed communication / bubble;
        ``measured`` (seconds per plan, None where not measured) marks the measured time."""
        return self._chart("step_time_chart", plans, time_steps, measured=measured)

    def pareto_chart(self, plans=None, *, time_steps=None, memory_budget=None):
        """Peak memory against predicted step time, a Pareto front per world size (a Figure)."""
        return self._chart("pareto_chart", plans, time_steps, memory_budget=memory_budget)

    def default_module(self, plan: SNNDistributedPlan) -> str:
        """The first module ``plan`` shards with TP, else the first TP candidate, else the first module with parameters."""
        sharded = [p for p, s in plan.tensor_parallel_plan.items() if STYLES[s].shards_parameters]
        if sharded:
            return sharded[0]
        if self.analysis.tensor_parallel_candidate_names:
            return self.analysis.tensor_parallel_candidate_names[0]
        return next((n for n, m in self.model.named_modules() if n and any(m.parameters(recurse=False))), "")

    def layout(self, plan: SNNDistributedPlan, module: Optional[str] = None):
        """Which rank holds which slice of ``module``'s parameters under ``plan`` (a DataFrame)."""
        return shard_layout(self.model, plan, module or self.default_module(plan))

    def mesh_chart(self, plan: SNNDistributedPlan, module: Optional[str] = None):
        """The dp x tp grid of ranks and the slice of ``module`` each holds (a Figure)."""
        module = module or self.default_module(plan)
        return charts.mesh_chart(self.layout(plan, module), plan, module)

    def pipeline_chart(self, plan: SNNDistributedPlan):
        """Each rank's forwards, backwards and bubbles under ``plan``'s schedule, above its stage layout
        over the model's pipeline units (a Figure), its title the estimate's idle share of the ranks' step time;
        ValueError for a plan without a pipeline."""
        if not plan.uses_pp:
            raise ValueError(f"the plan has no pipeline: pp={plan.pp_size} (mode {plan.mode!r}); a pipeline chart "
                             f"needs {names_text(lambda m: m.pp)} on a topology with pp > 1")
        time = self.estimate(plan).time if self.example_input is not None else None
        return pipeline_chart(plan, self.analysis.pipeline_units, time=time)

    def activation_chart(self, plan: SNNDistributedPlan, time_steps: Sequence[int] = (4, 8, 16, 32)):
        """Activation memory of one rank of ``plan`` against ``time_steps``, with and without checkpointing."""
        self.estimate(plan)  # the profile, measured once
        step_module = self.time_step_module if self.example_input is not None else None
        return charts.activation_curve_chart(activation_curve(self._profile, plan, time_steps, step_module))
