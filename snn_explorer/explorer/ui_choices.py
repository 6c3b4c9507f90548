"""What the Explorer UI's controls describe: the topology, the keyword arguments of
:meth:`~snn_explorer.explorer.Explorer.make_plan` (with a :class:`~snn_explorer.PlanOptions`) and the
memory budget. A base of :class:`~.ui.ExplorerUI`, which builds the widgets these read.
"""
from __future__ import annotations

from typing import Optional

from ..core import PlanOptions
from ..core.common import LEADING_DIMS, precision_of


class ControlChoices:
    """The values of the UI's controls, read as the planner takes them."""

    @property
    def topology(self) -> dict:
        dims = {n: self.mesh[n].value for n in LEADING_DIMS if self.mesh[n].value > 1}
        return dims or {"dp": 1}

    def choices(self) -> dict:
        """The keyword arguments of :meth:`Explorer.make_plan` the controls describe (``options``: a
        :class:`~snn_explorer.PlanOptions`)."""
        options = PlanOptions(
            activation_checkpointing=None if self.checkpointing.value == "auto" else self.checkpointing.value,
            checkpoint_every=self._checkpoint_every(), cpu_offload=self.gates["allow_cpu_offload"].value,
            precision=self._precision_choice(), **self._pipeline_choices())
        return dict(objective=self.objective.value, topology=self.topology, batch_size=self.batch_size.value,
                    features={g: c.value for g, c in self.gates.items()},
                    mode=None if self.mode.value == "auto" else self.mode.value, options=options)

    def _checkpoint_every(self) -> Optional[int]:
        """The control's k; None (the estimate's choice) when it is at 1 with checkpointing on "auto"."""
        k = self.checkpoint_every.value
        return None if k == 1 and self.checkpointing.value == "auto" else k

    def _precision_choice(self):
        """The chosen :class:`~snn_explorer.core.common.precision.Precision` (None: "auto", the objective's)."""
        if self.precision.value == "auto":
            return None
        return precision_of(self.precision.value, keep_neuron_state_fp32=self.neuron_state_fp32.value)

    def _pipeline_choices(self) -> dict:
        """The ``pp_*`` choices: None (the planner's) for "auto" / 0, and for all when pp is 1."""
        given = dict(pp_schedule=self.pp_schedule.value, pp_microbatches=self.pp_microbatches.value,
                     pp_virtual_stages=self.pp_virtual_stages.value)
        return {k: None if self.pp.value == 1 or v in ("auto", 0) else v for k, v in given.items()}

    @property
    def budget_bytes(self) -> Optional[int]:
        return int(self.memory_budget.value * 2 ** 20) if self.memory_budget.value > 0 else None
