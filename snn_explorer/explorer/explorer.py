"""Explorer: one model's analysis, a list of plans, their estimates, tables and charts."""
from __future__ import annotations

import gc
import json
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..core import DistributedFeatureSet, PlanOptions, SNNDistributedPlan, analyze, apply
from ..core import plan as core_plan
from ..core.common import check_batch_tensor, positive_int
from ..core.levers import find_time_step_module, objective_checkpoints
from ..core.model import modules_copied
from ..core.planning import check_backend, check_options, neuron_backend_arg
from ..core.planning.recommend import UNSET
from ..core.tp import default_tp_plan
from ..estimator import (
    PlanList,
    balanced_pp_plan,
    cached_hardware,
    default_hardware,
    enumerate_plans,
    fastest_first,
    fit_budget,
    measure,
    model_profile,
)
from ..estimator import estimate as estimate_plan
from ..launcher import ExportOptions, LaunchOptions, export_job, launch_plan, split_keywords
from ..zoo import build
from .compare import compare_table, plan_label, readable, style_compare
from .explorer_charts import ExplorerCharts
from .modules import candidates_table, modules_table
from .progress import Progress
from .steps import example_batch, example_step
from .ui import ExplorerUI

FeaturesLike = Union[DistributedFeatureSet, Mapping[str, bool], None]
#: Said while an estimate on this machine's calibration (``hardware=None``) has to make it first
#: (timed collectives on 2 and 4 ranks, see ``calibrate``; its duration: benchmarks/results/calibration.md); the hook's
#: pieces follow.
CALIBRATION_NOTE = "; calibrating this machine first (once, about a minute; cached after)"
#: An estimate or fit that copied at least this many modules (the profile's private copy, a TP replica, a
#: lever's copy: a dozen long-lived objects per module) ends with a full garbage collection, in its own wait.
#: Without it the collector's count of long-lived objects lags behind what the copies added, and its next
#: full collection (over the ~1 million objects of a 10,000-module model, its copy and replica: the latency
#: benchmark's ``full_gc_max_ms``) falls in a later control change that re-plans from the cache. An estimate or
#: fit that copied fewer modules in all skips it (its copies barely move that count).
COLLECT_AFTER_COPYING = 2000


def hardware_key(hardware: Any):
    """What tells two hardware choices apart in the estimate cache (a profile by its figures)."""
    to_dict = getattr(hardware, "to_dict", None)
    return json.dumps(to_dict(), sort_keys=True) if to_dict else hardware


@contextmanager
def _collected_after_copies() -> Iterator[None]:
    """Run the body, then collect garbage if it copied :data:`COLLECT_AFTER_COPYING` modules or more."""
    before = modules_copied()
    yield
    if modules_copied() - before >= COLLECT_AFTER_COPYING:
        gc.collect()


def as_features(features: FeaturesLike) -> DistributedFeatureSet:
    if features is None:
        return DistributedFeatureSet()
    if isinstance(features, DistributedFeatureSet):
        return features
    if isinstance(features, Mapping):
        return DistributedFeatureSet(**features)
    raise TypeError(f"features must be a DistributedFeatureSet or a mapping gate -> bool, got {features!r}")


class Explorer(ExplorerCharts):
    """Analyse ``model`` once, then plan, estimate, compare, chart and launch without re-analysing.

    ``example_input`` ``[T, N, ...]`` (the global batch of one step) is what the estimator
    profiles, once; without it plans and module tables work but estimates do not. ``time_steps``
    (default ``T``) and ``batch_size`` (default ``N``) are the defaults of new plans and estimates;
    ``neuron_backend`` (``backend``: its deprecated name) that of new plans. ``hardware`` (a
    ``HardwareProfile``, a built-in profile's name, or None: this machine's calibration, made on
    the first estimate) is where step times are predicted; set the attribute to change it.
    ``data_layout`` (a :class:`~snn_explorer.core.model.layouts.DataLayout`) says where N and T sit in
    ``example_input`` and the model's output; without it they are detected from the example input
    (``analysis.data_layout_how`` says how), and every plan and estimate carries the result.
    ``pool``: a :class:`~snn_explorer.ranks.RankPool` that :meth:`launch` (the UI's Launch) and :meth:`measure`
    run on (its warm ranks: no start-up per click; a plan of another world size is refused).
    """

    def __init__(self, model: nn.Module, *, example_input: Optional[torch.Tensor] = None,
                 time_steps: Optional[int] = None, model_family: Optional[str] = None,
                 roots: Optional[Sequence[str]] = None, labels: Optional[torch.Tensor] = None,
                 batch_size: Optional[int] = None, neuron_backend: str = "torch", optimizer: str = "adam",
                 backend: Any = UNSET, hardware: Any = None, data_layout: Any = None, pool: Any = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Explorer expects a torch.nn.Module, got {type(model).__name__}")
        if example_input is not None:
            check_batch_tensor("example_input", example_input)
        self.model, self.example_input, self.labels = model, example_input, labels
        self.analysis = analyze(model, model_family=model_family, roots=roots, example_input=example_input,
                                labels=labels, data_layout=data_layout)
        layout = self.analysis.data_layout
        self.time_steps = positive_int("time_steps", time_steps if time_steps is not None else
                                       layout.steps(example_input) if example_input is not None else 1)
        self.batch_size = positive_int("batch_size", batch_size if batch_size is not None else
                                       layout.samples(example_input) if example_input is not None else 1)
        self.neuron_backend = check_backend(neuron_backend_arg(neuron_backend, backend))
        self.optimizer = optimizer
        self.hardware, self.pool = hardware, pool
        self._plans: List[SNNDistributedPlan] = []
        self._estimates: Dict[tuple, Any] = {}
        self._fits: Dict[tuple, Any] = {}  # Explorer.fit's results per choice
        self._profile = None
        self._modules: Dict[tuple, Any] = {}
        self._ui = None
        self._wait: Optional[Progress] = None
        #: Where waits over two seconds show their progress (the UI sets its own box; None: the cell or terminal).
        self.progress_box = None

    @classmethod
    def from_zoo(cls, zoo, **kwargs) -> "Explorer":
        """An Explorer of a :class:`~snn_explorer.zoo.ZooModel` (or a zoo name) with its input and labels."""
        if isinstance(zoo, str):
            zoo = build(zoo)
        kwargs = dict(example_input=zoo.example_input, labels=zoo.labels, model_family=zoo.family, **kwargs)
        return cls(zoo.model, **kwargs)

    # ---- the module tree
    def default_tp_plan(self, features: FeaturesLike = None) -> Dict[str, str]:
        """The TP layout a TP mode gets without an explicit plan (what the planner builds)."""
        return default_tp_plan(self.analysis, as_features(features))

    def modules_for(self, plan: Optional[SNNDistributedPlan] = None, tp_size: int = 1):
        """The module table (a DataFrame) under ``plan``'s TP layout (the default layout when it has none)."""
        layout = dict(plan.tensor_parallel_plan) if plan is not None and plan.tensor_parallel_plan else \
            self.default_tp_plan(plan.experimental_features if plan is not None else None)
        tp_size = plan.tp_size if plan is not None else tp_size
        key = (tuple(sorted(layout.items())), tp_size)
        if key not in self._modules:
            self._modules[key] = modules_table(self.model, self.analysis, layout, tp_size)
        return self._modules[key]

    @property
    def modules(self):
        """Every module: path, type, depth, params, stateful, snn_library, TP candidate and style, sharded dim."""
        return self.modules_for(None)

    @property
    def candidates(self):
        """The TP candidates of :attr:`modules`."""
        return candidates_table(self.modules)

    # ---- plans
    @property
    def plans(self) -> List[SNNDistributedPlan]:
        """The plans added so far (by :meth:`add_plan`, :meth:`add`, :meth:`enumerate` or pinning), in order."""
        return list(self._plans)

    def add(self, plan: SNNDistributedPlan) -> SNNDistributedPlan:
        """Add ``plan`` to :attr:`plans` unless a plan of the same layout is there; returns the one kept."""
        if not isinstance(plan, SNNDistributedPlan):
            raise TypeError(f"expected an SNNDistributedPlan, got {type(plan).__name__}")
        index = self.index_of(plan)
        if index is not None:
            return self._plans[index]
        self._plans.append(plan)
        return plan

    def index_of(self, plan: SNNDistributedPlan) -> Optional[int]:
        """Where in :attr:`plans` a plan of ``plan``'s layout stands (see ``layout_key``), or None."""
        key = plan.layout_key()
        return next((i for i, p in enumerate(self._plans) if p.layout_key() == key), None)

    def remove(self, plan: SNNDistributedPlan) -> None:
        self._plans = [p for p in self._plans if p != plan]

    def clear(self) -> None:
        self._plans = []

    def make_plan(self, *, objective: str = "speed", topology: Any = None, batch_size: Optional[int] = None,
                  features: FeaturesLike = None, mode: Optional[str] = None,
                  options: Optional[PlanOptions] = None) -> SNNDistributedPlan:
        """The plan :func:`snn_explorer.plan` gives for these choices, without adding it. ``options`` (a
        :class:`~snn_explorer.PlanOptions`) as ``plan()`` takes it, with this Explorer's parts filled in:
        ``time_chunks`` checkpointing, and the objective's own choice for a model stepped per time step,
        step :attr:`time_step_module`; a pipeline's stages are balanced by the profile unless
        ``options.pp_layout`` is given; memory levers the objective may choose are kept only where this
        Explorer's estimate says they lower the peak (its ``peak_estimate``)."""
        features = as_features(features)
        options = check_options(options)
        chunks = options.activation_checkpointing == "time_chunks" or (
            options.activation_checkpointing is None and self.example_input is not None and
            objective_checkpoints(objective, features))  # else no model run to find the stepped module
        filled = options.replace(
            time_step_module=options.time_step_module or (self.time_step_module if chunks else None),
            peak_estimate=options.peak_estimate or (self.estimate if self.example_input is not None else None))
        planned = core_plan(analysis=self.analysis, objective=objective,
                            topology=topology if topology is not None else 1, neuron_backend=self.neuron_backend,
                            batch_size=batch_size if batch_size is not None else self.batch_size,
                            mode=mode, features=features, options=filled)
        return planned if options.pp_layout is not None else self._balanced(planned)

    def _balanced(self, plan: SNNDistributedPlan) -> SNNDistributedPlan:
        """``plan`` (made without a chosen ``pp_layout``), a pipeline getting its stages balanced by
        the estimator's profile of each unit (:func:`snn_explorer.balanced_pp_plan`; core's ``plan()``
        alone cuts by unit count). Plans without a pipeline, or without an example input, as they are;
        so is a pipeline no balanced layout gives every stage a trainable unit (core's layout gives every rank one)."""
        if not plan.uses_pp or self.example_input is None:
            return plan
        try:
            return balanced_pp_plan(self.model, plan, self.example_input, self.labels)
        except ValueError:
            return plan

    @property
    def time_step_module(self) -> Optional[str]:
        """The module the model's forward calls once per time step (None: it runs all steps in one call)."""
        if "_step_module" not in self.__dict__:
            if self.example_input is None:
                raise ValueError("finding the module stepped per time step needs an example input")
            self._step_module = find_time_step_module(self.model, self.example_input)
        return self._step_module

    def add_plan(self, **choices) -> SNNDistributedPlan:
        """:meth:`make_plan` and add the plan to :attr:`plans`; returns it."""
        return self.add(self.make_plan(**choices))

    def plan(self, **choices) -> SNNDistributedPlan:
        """Deprecated name of :meth:`add_plan` (unlike the pure :func:`snn_explorer.plan`, it adds the plan)."""
        warnings.warn("Explorer.plan() is deprecated: it adds the plan to the explorer; call add_plan() "
                      "(or make_plan() for the plan alone)", DeprecationWarning, stacklevel=2)
        return self.add_plan(**choices)

    def enumerate(self, world_size: int, *, batch_size: Optional[int] = None, features: FeaturesLike = None,
                  objective: str = "speed", memory_budget: Optional[int] = None):
        """Add every feasible plan for ``world_size`` ranks; returns them (``.infeasible``: why others are not).

        With ``objective="speed"`` and an example input the plans come fastest first by predicted
        step time, those that fit ``memory_budget`` (bytes per device) before those that do not."""
        plans = enumerate_plans(self.analysis, world_size=world_size,
                                batch_size=batch_size if batch_size is not None else self.batch_size,
                                neuron_backend=self.neuron_backend, features=as_features(features), objective=objective)
        with self.waiting(f"searching the plans for {world_size} ranks", len(plans)) as wait:
            plans = PlanList([self._balanced(p) for p in plans], plans.infeasible)
            if objective == "speed" and self.example_input is not None:
                ranked = fastest_first([self.estimate(p) for p in wait.each(plans)], memory_budget)
                plans = PlanList([e.plan for e in ranked], plans.infeasible)
        for p in plans:
            self.add(p)
        return plans

    # ---- estimates
    def estimate(self, plan: SNNDistributedPlan, time_steps: Optional[int] = None):
        """The estimator's :class:`~snn_explorer.estimator.PlanEstimate` of ``plan`` (cached per plan and time steps)."""
        if self.example_input is None:
            raise ValueError("estimates need an example input: Explorer(model, example_input=[T, N, ...] tensor)")
        key = self._estimate_key(plan, time_steps)
        if key in self._estimates:
            return self._estimates[key]
        with self.waiting("estimating") as wait, _collected_after_copies():
            if self._profile is None:  # looked up once: the cache key reads every parameter's shape
                wait.say("profiling the model (forward and backward at four batch sizes)")
                self._profile = model_profile(self.model, self.example_input, self.labels,
                                              layout=self.analysis.data_layout, on_progress=wait.hear)
            wait.say(f"estimating {plan_label(plan)}" + (CALIBRATION_NOTE if self.will_calibrate else ""))
            self._estimates[key] = estimate_plan(self.model, plan, example_input=self.example_input,
                                                 labels=self.labels, time_steps=key[1], optimizer=self.optimizer,
                                                 profile=self._profile, hardware=self.hardware,
                                                 layout=self.analysis.data_layout, on_progress=wait.hear)
        return self._estimates[key]

    def fit(self, memory_budget: int, world_size: int, *, batch_size: Optional[int] = None,
            features: FeaturesLike = None):
        """:func:`~snn_explorer.estimator.fit_budget` for this model on :attr:`hardware`: the fastest plan for
        ``world_size`` ranks whose estimated peak fits ``memory_budget`` bytes per rank, the candidates
        and why each lost (a :class:`~snn_explorer.estimator.FitResult`, cached per choice). ``features``:
        the gates, so the levers searched (None: the fit's own, checkpointing and spike compression)."""
        if self.example_input is None:
            raise ValueError("fitting a budget estimates plans, which needs an example input: "
                             "Explorer(model, example_input=[T, N, ...] tensor)")
        batch = batch_size if batch_size is not None else self.batch_size
        gates = None if features is None else as_features(features)
        key = (int(memory_budget), int(world_size), batch, gates, hardware_key(self.hardware))
        fits = self._fits
        if key not in fits:
            with self.waiting(f"fitting {memory_budget / 2 ** 20:.4g} MiB per rank on {world_size} ranks") as wait, \
                    _collected_after_copies():
                hardware = self.hardware
                if self.will_calibrate:
                    wait.say("fitting a budget" + CALIBRATION_NOTE)
                    hardware = default_hardware(on_progress=wait.hear)
                if self._profile is None:
                    wait.say("profiling the model (forward and backward at four batch sizes)")
                    self._profile = model_profile(self.model, self.example_input, self.labels,
                                                  layout=self.analysis.data_layout, on_progress=wait.hear)
                wait.say(f"fitting {memory_budget / 2 ** 20:.4g} MiB per rank on {world_size} ranks: "
                         "estimating modes, meshes and levers")
                fits[key] = fit_budget(self.model, self.example_input, memory_budget, world_size, labels=self.labels,
                                       hardware=hardware, batch_size=batch, features=gates, optimizer=self.optimizer)
        return fits[key]

    @property
    def will_calibrate(self) -> bool:
        """Whether the next estimate calibrates this machine first (``hardware`` None and no calibration
        cached in the process or on disk, nor a profile named by ``SNN_EXPLORER_HARDWARE``)."""
        return self.hardware is None and cached_hardware() is None

    @contextmanager
    def waiting(self, text: str, total: Optional[int] = None) -> Iterator[Progress]:
        """A :class:`~snn_explorer.explorer.progress.Progress` of a wait (shown in :attr:`progress_box`
        when set, the UI's); a wait inside another updates the outer one's line instead."""
        if self._wait is not None:
            yield self._wait
            return
        with Progress(text, total, box=self.progress_box) as self._wait:
            try:
                yield self._wait
            finally:
                self._wait = None

    def is_estimated(self, plan: SNNDistributedPlan, time_steps: Optional[int] = None) -> bool:
        """Whether :meth:`estimate` of ``plan`` is cached (returns without running the model)."""
        return self._estimate_key(plan, time_steps) in self._estimates

    def _estimate_key(self, plan: SNNDistributedPlan, time_steps: Optional[int]) -> tuple:
        """What an estimate is cached under: the plan, the time steps, the hardware."""
        return plan, int(time_steps if time_steps is not None else self.time_steps), hardware_key(self.hardware)

    def prepare(self, world_size: int, *, batch_size: Optional[int] = None, time_steps: Optional[int] = None) -> int:
        """Measure up front what the estimates of every plan for ``world_size`` ranks need: the
        profile, and one model run per per-rank batch and TP layout (experimental layouts included).
        Afterwards changing dp x tp, mode, objective, gates or budget re-estimates without running
        the model; a new batch size, time steps or world size needs ``prepare`` again. Returns how
        many plans it estimated. Without an example input there is nothing to prepare (0)."""
        if self.example_input is None:
            return 0
        batch = batch_size if batch_size is not None else self.batch_size
        plans = {}
        for conv in (False, True):
            for heads in (False, True):
                features = as_features({"allow_experimental_conv_tp": conv, "allow_experimental_spikformer_tp": heads})
                for objective in ("speed", "memory"):
                    for p in enumerate_plans(self.analysis, world_size=world_size, batch_size=batch,
                                             neuron_backend=self.neuron_backend, features=features,
                                             objective=objective):
                        p = self._balanced(p)
                        plans.setdefault((p.tp_size, p.per_rank_batch, tuple(sorted(p.tensor_parallel_plan.items()))), p)
        with self.waiting(f"measuring the plans of {world_size} ranks", len(plans)) as wait:
            for p in wait.each(plans.values()):
                self.estimate(p, time_steps)
        return len(plans)

    def estimates(self, plans: Optional[Sequence[SNNDistributedPlan]] = None,
                  time_steps: Optional[int] = None) -> list:
        plans = list(self._plans if plans is None else plans)
        with self.waiting(f"estimating {len(plans)} plans", len(plans)) as wait:
            return [self.estimate(p, time_steps) for p in wait.each(plans)]

    def compare(self, plans: Optional[Sequence[SNNDistributedPlan]] = None, *, time_steps: Optional[int] = None,
                memory_budget: Optional[int] = None, labels: Optional[Sequence[str]] = None,
                styled: bool = False, rows: Optional[Sequence[str]] = None):
        """Side by side, one column per plan (default: :attr:`plans`); ``rows`` picks and orders
        rows; ``styled=True`` gives the Styler (fixed uuid, bytes in B / KiB / MiB) with each row's
        best value highlighted."""
        ests = self.estimates(plans, time_steps)
        table = compare_table(ests, labels, memory_budget)
        if rows is not None:
            unknown = [r for r in rows if r not in table.index]
            if unknown:
                raise ValueError(f"rows {unknown} are not rows of the comparison; rows: {list(table.index)}")
            table = table.loc[list(rows)]
        return style_compare(table) if styled else table

    def compare_text(self, plans: Optional[Sequence[SNNDistributedPlan]] = None, *, max_text: int = 40,
                     **kwargs) -> str:
        """The comparison as a terminal table (bytes in KiB / MiB, text cut to ``max_text`` characters)."""
        return readable(self.compare(plans, **kwargs), max_text).to_string()

    # ---- running
    def apply(self, plan: SNNDistributedPlan, *, device_type: Optional[str] = None, device_mesh=None):
        """:func:`snn_explorer.apply` on this rank (inside an initialised process group); returns the runtime.
        ``device_type`` defaults as there (the process group's, else CUDA when available)."""
        return apply(model=self.model, plan=plan, device_type=device_type, device_mesh=device_mesh)

    def launch(self, plan: SNNDistributedPlan, train_fn: Optional[Callable] = None, **kwargs):
        """:func:`snn_explorer.launcher.launch_plan`: ``plan.world_size`` ranks, each applying ``plan``
        and calling ``train_fn`` (see its docs for the signature and keyword arguments). Without
        ``train_fn``, each step trains on this rank's share of the example input and labels
        (cross-entropy, :func:`~snn_explorer.explorer.steps.example_step`). ``kwargs``: launch_plan's,
        the fields of :class:`~snn_explorer.LaunchOptions` among them gathered into its ``options``."""
        train_fn = self._step(train_fn, kwargs)
        return launch_plan(self.model, plan, train_fn, **split_keywords(LaunchOptions, {"pool": self.pool, **kwargs}))

    def measure(self, plan: SNNDistributedPlan, **kwargs):
        """:func:`snn_explorer.estimator.measure` of ``plan`` on this model, example input, labels and layout
        (on :attr:`pool` when set): the measured counterpart of :meth:`estimate`."""
        kwargs = {"labels": self.labels, "layout": self.analysis.data_layout, "pool": self.pool, **kwargs}
        return measure(self.model, plan, example_input=self.example_input, **kwargs)

    def export(self, plan: SNNDistributedPlan, train_script_or_fn, path, **kwargs):
        """:func:`snn_explorer.launcher.export_job` for this model: a torchrun / Slurm job directory
        (``train_script_or_fn=None``: the example step of :meth:`launch`)."""
        kwargs.setdefault("model", self.model)
        train_script_or_fn = self._step(train_script_or_fn, kwargs)
        return export_job(plan, train_script_or_fn, path, **split_keywords(ExportOptions, kwargs))

    def _step(self, train_fn, kwargs: dict):
        """``train_fn``, or the example step when it is None (its ``train_kwargs`` then set in ``kwargs``)."""
        if train_fn is not None:
            return train_fn
        kwargs.setdefault("train_kwargs", example_batch(self.example_input, self.labels))
        return example_step()

    # ---- display
    @property
    def ui(self):
        """The ipywidgets UI (built on first use)."""
        if self._ui is None:
            self._ui = ExplorerUI(self)
        return self._ui

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = self.ui.widget._repr_mimebundle_(include=include, exclude=exclude) or {}
        bundle["text/plain"] = repr(self)
        return bundle

    def __repr__(self) -> str:
        a = self.analysis
        count = sum(1 for n, _ in self.model.named_modules() if n)
        other = len(a.memory_module_names) - len(a.neuron_names)  # dropout masks: stateful, but no neurons
        kinds = f" ({len(a.neuron_names)} neurons, {other} other)" if other else ""
        if a.explicit_state_names:  # "0 stateful" alone reads as "no neurons found"
            kinds += (f" + {len(a.explicit_state_names)} snntorch neurons whose membrane forward passes "
                      "(init_hidden=False: no state in the module)")
        return (f"Explorer({type(self.model).__name__}: {count} modules, {len(a.memory_module_names)} stateful{kinds}, "
                f"{len(a.tensor_parallel_candidate_names)} TP candidates, family={a.model_family}, "
                f"{len(self._plans)} plans)")
