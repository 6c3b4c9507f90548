"""Frozen plan data: feature gates and the plan itself, validated on construction."""
from __future__ import annotations

import dataclasses
import json
import reprlib
import warnings
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional, Tuple

from ..common.modes import Mode, mode_of, names_text
from ..common.precision import FP32, Precision, precision_of
from ..common.serialize import check_keys, check_kind, dataclass_dict, string_tuple
from ..common.topology import SNNDistributedTopology
from ..levers.memory_levers import check_memory_levers, lever_label
from ..model.layouts import TIME_MAJOR, DataLayout, layout_of
from .pipeline_plan import check_pp_fields
from .pipeline_schedules import schedule_of
from .recommend import NEURON_BACKENDS, SNN_DISTRIBUTED_PREFERENCES, check_batch_size

OPTIMIZER_STRATEGIES = ("none", "zero")
#: memopt_level acts on FSDP2 modes: 0 keeps gathered parameters for backward, 1 reshards after forward.
MEMOPT_LEVELS = (0, 1)


def _check_memopt_level(level, mode: Mode) -> None:
    if type(level) is not int or level not in MEMOPT_LEVELS:
        raise ValueError(f"memopt_level={level!r}; expected one of {MEMOPT_LEVELS}")
    if level and mode.pp and mode.fsdp:
        raise ValueError(f"memopt_level={level} (FSDP2 resharding after every forward) is not used by mode "
                         f"{mode.name!r}: a pipeline's stages keep their gathered parameters through all micro-batches "
                         "of a step (one all-gather per step, as torchtitan runs pp with FSDP); use memopt_level=0")


@dataclass(frozen=True)
class DistributedFeatureSet:
    """Feature gates for experimental or optional behaviour."""

    allow_experimental_conv_tp: bool = False
    allow_experimental_spikformer_tp: bool = False
    allow_zero_optimizer: bool = True
    allow_activation_checkpointing: bool = False
    allow_cpu_offload: bool = False
    #: saved 0/1 tensors packed 1 bit per element (``core.spike_compression``)
    allow_spike_compression: bool = False
    #: bf16 / fp16 training (``core.precision``); off: every plan trains in fp32, as before
    allow_mixed_precision: bool = False

    def __post_init__(self):
        for name in (f.name for f in dataclasses.fields(self)):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"DistributedFeatureSet.{name} must be a bool, got {value!r}")

    def to_dict(self) -> dict:
        return dataclass_dict(self, "features")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DistributedFeatureSet":
        return cls(**check_kind(data, "features"))


def topology_problem(mode: str, topology: SNNDistributedTopology) -> Optional[str]:
    """Why ``mode`` cannot run on ``topology`` (None when it can)."""
    return mode_of(mode).topology_problem(topology)


def _check_precision(plan: "SNNDistributedPlan") -> None:
    """The plan's precision as a :class:`Precision` (a name converted), behind its feature gate."""
    if not isinstance(plan.precision, Precision):
        object.__setattr__(plan, "precision", precision_of(plan.precision))
    if plan.precision.mixed and not plan.experimental_features.allow_mixed_precision:
        raise ValueError(f"precision={plan.precision.name!r} needs DistributedFeatureSet(allow_mixed_precision=True); "
                         "without it plans train in 'fp32'")


def _style_mapping(value: Any) -> dict:
    """The plan's TP styles as a dict path -> style name, both strings."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"tensor_parallel_plan must map module paths to style names, got "
                        f"{type(value).__name__}: {reprlib.repr(value)}")
    for path, style in value.items():
        if not isinstance(path, str) or not isinstance(style, str):
            raise TypeError(f"tensor_parallel_plan must map module paths (str) to style names (str), got "
                            f"{reprlib.repr(path)}: {reprlib.repr(style)}")
    return dict(value)


@dataclass(frozen=True)
class SNNDistributedPlan:
    """A frozen, JSON-serialisable distribution plan; ``apply`` executes it.

    ``batch_size`` is the global batch of one optimizer step; the ``dp`` ranks split it.
    ``tensor_parallel_plan`` maps module paths to TP styles (see ``core.tp_plan.TP_STYLES``).
    Mode ``pp`` reads ``pp_schedule`` (a name of ``core.pipeline_schedules.SCHEDULES``), ``pp_microbatches`` (per
    step, of each dp replica's batch), ``pp_virtual_stages`` (stages per rank) and ``pp_layout``
    (pipeline units per stage, ``"3|4"``; ``""``: an even split); other modes leave them unset.
    """

    mode: str
    objective: str
    topology: SNNDistributedTopology
    model_family: str = "generic"
    neuron_backend: str = "torch"
    batch_size: int = 1
    optimizer_strategy: str = "none"
    memopt_level: int = 0
    rationale: Tuple[str, ...] = ()
    notes: Tuple[str, ...] = ()
    tensor_parallel_roots: Optional[Tuple[str, ...]] = None
    tensor_parallel_plan: Mapping[str, str] = field(default_factory=dict)
    fsdp_units: Tuple[str, ...] = ()
    experimental_features: DistributedFeatureSet = field(default_factory=DistributedFeatureSet)
    pp_schedule: Optional[str] = None
    pp_microbatches: Optional[int] = None
    pp_virtual_stages: int = 1
    pp_layout: str = ""
    #: memory levers (see core.memory_levers): recomputation granularity, its k, FSDP2 CPU offload
    activation_checkpointing: str = "none"
    checkpoint_every: int = 1
    cpu_offload: bool = False
    time_step_module: Optional[str] = None
    spike_compression: bool = False  # saved spikes packed 1 bit each (core.spike_compression)
    activation_offload: bool = False  # saved activations in host memory (core.activation_offload)
    #: with activation_checkpointing='blocks': the blocks to recompute, each by its first unit's path (core.block_choice);
    #: () recomputes every ``checkpoint_every``-th block
    checkpoint_blocks: Tuple[str, ...] = ()
    #: where N and T sit in the model's input and output (None: not stated; runs take time-major [T, N, ...])
    data_layout: Optional[DataLayout] = None
    #: the training precision (``core.precision.Precision``; a name is accepted and converted)
    precision: Precision = FP32

    def __post_init__(self):
        mode = mode_of(self.mode)
        if self.data_layout is not None:
            object.__setattr__(self, "data_layout", layout_of(self.data_layout))
        if self.objective not in SNN_DISTRIBUTED_PREFERENCES:
            raise ValueError(f"unsupported objective={self.objective!r}; expected one of {SNN_DISTRIBUTED_PREFERENCES}")
        if not isinstance(self.topology, SNNDistributedTopology):
            object.__setattr__(self, "topology", SNNDistributedTopology.coerce(self.topology))
        if self.neuron_backend not in NEURON_BACKENDS:
            raise ValueError(f"unsupported neuron_backend={self.neuron_backend!r}; expected one of {NEURON_BACKENDS}")
        check_batch_size(self.batch_size)
        if self.optimizer_strategy not in OPTIMIZER_STRATEGIES:
            raise ValueError(f"optimizer_strategy={self.optimizer_strategy!r}; expected one of {OPTIMIZER_STRATEGIES}")
        if self.optimizer_strategy == "zero" and not mode.allows_zero:
            raise ValueError(f"optimizer_strategy='zero' (ZeroRedundancyOptimizer) applies to "
                             f"{names_text(lambda m: m.allows_zero)} only, not {self.mode!r}; "
                             "FSDP2 already shards optimizer state")
        _check_memopt_level(self.memopt_level, mode)
        problem = mode.topology_problem(self.topology)
        if problem:
            raise ValueError(problem)
        if self.batch_size % self.dp_size:
            raise ValueError(f"batch_size={self.batch_size} (global) is not divisible by dp={self.dp_size}; "
                             f"use a multiple of {self.dp_size}")
        tp_plan = _style_mapping(self.tensor_parallel_plan)
        if mode.tp and not tp_plan:
            raise ValueError(f"mode {self.mode!r} needs a non-empty tensor_parallel_plan")
        if not mode.tp and tp_plan:
            raise ValueError(f"tensor_parallel_plan is only used by {names_text(lambda m: m.tp)}, not {self.mode!r}")
        object.__setattr__(self, "tensor_parallel_plan", MappingProxyType(tp_plan))
        for name in ("rationale", "notes", "fsdp_units", "tensor_parallel_roots", "checkpoint_blocks"):
            value = string_tuple("SNNDistributedPlan", name, getattr(self, name),
                                 optional=name == "tensor_parallel_roots")
            object.__setattr__(self, name, value)
        for name, value in check_pp_fields(self).items():
            object.__setattr__(self, name, value)
        if not isinstance(self.model_family, str):
            raise TypeError(f"SNNDistributedPlan.model_family must be a string, got {reprlib.repr(self.model_family)}")
        check_memory_levers(self)
        _check_precision(self)

    # What the mode does, as named facts (see core.modes).
    @property
    def mode_spec(self) -> Mode:
        """The :class:`~snn_explorer.core.common.modes.Mode` row of ``mode``."""
        return mode_of(self.mode)

    @property
    def distributed(self) -> bool:
        """Whether the plan needs a process group and a device mesh."""
        return self.mode_spec.distributed

    @property
    def uses_ddp(self) -> bool:
        return self.mode_spec.ddp

    @property
    def uses_fsdp(self) -> bool:
        return self.mode_spec.fsdp

    @property
    def uses_tp(self) -> bool:
        return self.mode_spec.tp

    @property
    def uses_pp(self) -> bool:
        return self.mode_spec.pp

    @property
    def layout(self) -> DataLayout:
        """The :class:`~snn_explorer.core.model.layouts.DataLayout` runs of this plan use (time-major when unstated)."""
        return self.data_layout if self.data_layout is not None else TIME_MAJOR

    @property
    def pp_schedule_spec(self):
        """The :class:`~snn_explorer.core.planning.pipeline_schedules.PipelineSchedule` of ``pp_schedule`` (None
        without pipelining)."""
        return schedule_of(self.pp_schedule) if self.uses_pp else None

    @property
    def uses_zero(self) -> bool:
        return self.optimizer_strategy == "zero"

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2 frees gathered parameters after forward (``memopt_level >= 1``) and gathers again in backward
        (never under ``pp_fsdp2`` / ``pp_fsdp2_tp``, whose stages stay gathered through the step's micro-batches)."""
        return self.uses_fsdp and self.memopt_level >= 1

    @property
    def backend(self) -> str:
        """Deprecated name of :attr:`neuron_backend`."""
        warnings.warn("SNNDistributedPlan.backend is deprecated; use neuron_backend", DeprecationWarning, stacklevel=2)
        return self.neuron_backend

    # Mesh geometry, derived from the topology.
    @property
    def mesh_shape(self) -> Tuple[int, ...]:
        return self.topology.mesh_shape

    @property
    def mesh_dim_names(self) -> Tuple[str, ...]:
        return self.topology.ordered_dim_names

    @property
    def tp_mesh_dim(self) -> int:
        names = self.mesh_dim_names
        return names.index("tp") if "tp" in names else 0

    @property
    def dp_mesh_dim(self) -> Optional[int]:
        names = self.mesh_dim_names
        return names.index("dp") if "dp" in names else None

    def dim_size(self, name: str) -> int:
        """How many ranks the mode spreads over mesh dim ``name`` (1 for a dim it does not use)."""
        return self.topology.size(name) if name in self.mode_spec.dims else 1

    @property
    def dp_size(self) -> int:
        return self.dim_size("dp")

    @property
    def tp_size(self) -> int:
        return self.dim_size("tp")

    @property
    def pp_size(self) -> int:
        return self.dim_size("pp")

    @property
    def pp_stages(self) -> int:
        """Pipeline stages in all: ``pp * pp_virtual_stages`` (1 without pipelining)."""
        return self.pp_size * self.pp_virtual_stages

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def per_rank_batch(self) -> int:
        """Samples each rank processes per step (tensor-parallel peers see the same samples)."""
        return self.batch_size // self.dp_size

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, SNNDistributedPlan) and self._key() == other._key()

    def _key(self) -> str:
        """The plan's identity as canonical JSON; computed once (the plan is frozen)."""
        key = self.__dict__.get("_cached_key")
        if key is None:
            data = self.to_dict()
            data["topology"] = list(self.topology.dims.items())  # dim order is part of the mesh
            key = json.dumps(data, sort_keys=True)
            object.__setattr__(self, "_cached_key", key)
        return key

    def layout_key(self) -> str:
        """What ``apply`` does with the plan, as canonical JSON: the plan without the words that
        explain it (objective, rationale, notes) and with ``memopt_level`` only where FSDP2 reads it.
        Two plans with one layout train identically. Computed once (the plan is frozen)."""
        key = self.__dict__.get("_cached_layout_key")
        if key is None:
            data = json.loads(self._key())
            for name in ("objective", "rationale", "notes"):
                data.pop(name)
            if not self.uses_fsdp or self.uses_pp:
                data.pop("memopt_level")
            key = json.dumps(data, sort_keys=True)
            object.__setattr__(self, "_cached_layout_key", key)
        return key

    def to_dict(self) -> dict:
        return dataclass_dict(self, "plan")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SNNDistributedPlan":
        data = check_kind(data, "plan")
        if "backend" in data and "neuron_backend" not in data:  # files written before the rename
            data["neuron_backend"] = data.pop("backend")
        check_keys(data, "plan", ("mode", "objective", "topology"),
                   tuple(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")))
        data["topology"] = SNNDistributedTopology.from_dict(data["topology"])
        if isinstance(data.get("precision"), Mapping):
            data["precision"] = Precision.from_dict(data["precision"])
        if "experimental_features" in data:
            data["experimental_features"] = DistributedFeatureSet.from_dict(data["experimental_features"])
        return cls(**data)

    @property
    def label(self) -> str:
        """``dp+zero dp=4``, ``fsdp2+reshard dp=4``, ``pp pp=2 x dp=2 1f1b m=8``, ``tp tp=2 bf16``: mode, ZeRO,
        FSDP2's resharding after forward (memopt_level 1; kept gathered: no mark), levers, mesh, the pipeline's
        schedule and a half precision; every table and chart names a plan by it."""
        mode = (f"{self.mode}{'+zero' if self.uses_zero else ''}{'+reshard' if self.reshard_after_forward else ''}"
                f"{lever_label(self)}")
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape))
        pipeline = ""
        if self.uses_pp:
            virtual = f" v={self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else ""
            pipeline = f"{self.pp_schedule} m={self.pp_microbatches}{virtual}"
        precision = self.precision.label if self.precision.mixed else ""
        return " ".join(filter(None, (mode, mesh, pipeline, precision)))

    def __repr__(self) -> str:
        dims = "x".join(f"{n}{s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape))
        extra = "+zero" if self.uses_zero else ""
        if self.uses_pp:
            extra = f" {self.pp_schedule} x{self.pp_microbatches}"
        if self.precision.mixed:
            extra += f" {self.precision.label}"
        extra += "+reshard" if self.reshard_after_forward else ""
        return (f"SNNDistributedPlan({self.mode}{extra}{lever_label(self)} on {dims}, objective={self.objective}, "
                f"batch={self.batch_size})")
