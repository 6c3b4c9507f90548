"""``PlanOptions``: the levers, precision and pipeline settings of one ``plan()`` call, as one object.

``plan()`` keeps the seed's arguments (analysis, objective, topology, batch size, backend, family,
mode, features); everything else it can be told travels in a ``PlanOptions``, so that a notebook,
the CLI and the Explorer build the same object and a new setting adds a field, not an argument.
Each value is checked by ``plan()`` (a bad one raises there, naming the field and what it accepts).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """Settings of ``plan()`` beyond the seed's arguments; every field defaults to "the planner's choice".

    Tensor parallelism: ``tensor_parallel_plan`` (module path -> style name, see
    ``snn_explorer.core.tp.TP_STYLES``) replaces the planner's per-layer TP plan.

    Pipeline (a topology with a ``pp`` dim): ``pp_schedule``, ``pp_microbatches``, ``pp_virtual_stages``
    and ``pp_layout`` (``"3|4"`` or the unit paths where stages 2.. begin); those left None follow
    :func:`~snn_explorer.core.planning.pipeline_plan.recommend_pipeline`.

    Memory levers (each behind its ``features`` gate; ``snn_explorer.core.levers``):
    ``activation_checkpointing``, ``checkpoint_every``, ``cpu_offload``, ``time_step_module`` and
    ``checkpoint_blocks``. ``activation_checkpointing=None`` leaves the choice to the objective:
    ``speed`` takes none; ``memory`` and ``capacity`` never take a lever by rule, only by its estimated
    effect: given ``peak_estimate`` (a callable plan -> an object with ``peak_bytes`` and
    ``step_time_s``, e.g. ``snn_explorer.plan_estimator(model, example_input)``), each lever
    combination the gates allow (checkpointing by blocks, every 1st / 2nd or every
    ``checkpoint_every``-th when given, 1 included; by time chunks of ``time_step_module``, of the size
    the estimate chooses unless ``checkpoint_every`` is given; spike compression; both; and the blocks
    chosen one by one) is estimated and the one of lowest peak is kept if it is below the plan's peak
    without levers (a note says by how much and its time cost); without ``peak_estimate`` no lever is
    on (a note says so). ``checkpoint_blocks`` (with ``activation_checkpointing='blocks'``) recomputes
    exactly the named blocks (each by its first unit's path) instead of every ``checkpoint_every``-th.
    ``checkpoint_every=None`` is 1 with an explicit ``activation_checkpointing`` and the estimate's
    choice without one.

    ``precision``: a :class:`~snn_explorer.core.common.Precision` or its name (None: the objective's
    choice). ``data_layout``: a :class:`~snn_explorer.core.model.DataLayout` or its name (None: the
    analysis's); it says where N and T sit in the model's input and output.
    """

    tensor_parallel_plan: Optional[Mapping[str, str]] = None
    pp_schedule: Optional[str] = None
    pp_microbatches: Optional[int] = None
    pp_virtual_stages: Optional[int] = None
    pp_layout: Any = None
    activation_checkpointing: Optional[str] = None
    checkpoint_every: Optional[int] = None
    cpu_offload: bool = False
    time_step_module: Optional[str] = None
    checkpoint_blocks: Sequence[str] = ()
    data_layout: Any = None
    precision: Any = None
    peak_estimate: Optional[Callable[[Any], Any]] = None

    def replace(self, **changes: Any) -> "PlanOptions":
        """A copy with ``changes`` (field name -> value); an unknown name raises ``TypeError`` naming it."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"PlanOptions has no field(s) {unknown}; fields: {field_names()}")
        return dataclasses.replace(self, **changes)


def field_names() -> tuple:
    return tuple(f.name for f in dataclasses.fields(PlanOptions))


def check_options(options: Any) -> PlanOptions:
    """``options`` as a :class:`PlanOptions` (None: every default); anything else raises ``TypeError``."""
    if options is None:
        return PlanOptions()
    if not isinstance(options, PlanOptions):
        raise TypeError(f"options={options!r} must be a PlanOptions (snn_explorer.PlanOptions(...)) or None")
    return options


def split_options(keywords: Mapping[str, Any]) -> dict:
    """``plan()`` keywords with every :class:`PlanOptions` field among them moved into ``options``
    (for callers holding one flat mapping of choices, as a test table or a sweep does)."""
    fields = set(field_names())
    rest = {k: v for k, v in keywords.items() if k not in fields}
    moved = {k: v for k, v in keywords.items() if k in fields}
    if moved:
        base = check_options(rest.pop("options", None))
        rest["options"] = base.replace(**moved)
    return rest
