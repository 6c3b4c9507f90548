"""Every private torch / cloudpickle name snn_explorer relies on, in one place.

Each name is looked up once, at import, and checked for the shape the code expects (present,
callable, taking the arguments we pass). A torch release that moved or changed one raises
:class:`TorchCompatError` naming the name, the installed torch and the tested range, instead of
failing deep inside a step. Its siblings hold the rest: :mod:`.compat_dcp` (checkpoint files),
:mod:`.compat_pipelining`, :mod:`.compat_elastic` (the rank runner) and :mod:`.compat_fake` (fake
tensors and process groups). Everything else in the package uses public torch API only.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from typing import Any, Iterable, Optional

import torch
from torch.utils.flop_counter import shape_wrapper

#: The torch releases CI runs the suite (or the tests of every name below) on; pyproject.toml says the same.
TESTED_TORCH = ">=2.13,<2.15"


class TorchCompatError(ImportError):
    """A private name snn_explorer needs is missing or changed in the installed torch."""


def _require(module: str, attr: str, *, params: Iterable[str] = (), callable_: bool = True) -> Any:
    """``module.attr``, checked: present, callable when ``callable_``, accepting ``params`` by name."""
    where = f"{module}.{attr}"
    try:
        owner: Any = importlib.import_module(module)
    except ImportError as exc:
        raise _error(where, f"module {module} does not import ({exc})") from exc
    value = owner
    for part in attr.split("."):
        if not hasattr(value, part):
            raise _error(where, "it is missing")
        value = getattr(value, part)
    if callable_ and not callable(value):
        raise _error(where, f"it is a {type(value).__name__}, not callable")
    missing = _missing_params(value, params)
    if missing:
        raise _error(where, f"it no longer takes {missing}")
    return value


def _missing_params(fn: Any, params: Iterable[str]) -> Optional[list]:
    params = list(params)
    if not params:
        return None
    try:
        names = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None  # a builtin without a signature: presence is all we can check
    return [p for p in params if p not in names] or None


def _error(where: str, why: str) -> TorchCompatError:
    return TorchCompatError(f"snn_explorer needs the private torch name {where}, but in torch {torch.__version__} "
                            f"{why}; snn_explorer is tested with torch {TESTED_TORCH}")


# --- core and estimator ---------------------------------------------------------------------

def _check(where: str, ok: bool, why: str) -> None:
    """Raise :class:`TorchCompatError` for ``where`` unless ``ok`` (a shape check beyond presence)."""
    if not ok:
        raise _error(where, why)


def _arg_names(op: Any) -> list:
    schema = getattr(getattr(op, "default", None), "_schema", None)
    return [a.name for a in schema.arguments] if schema is not None else []


# pytree: torch.utils.pytree is the public module where a release has it (2.13 and 2.14 do not).
_PYTREE = "torch.utils.pytree" if importlib.util.find_spec("torch.utils.pytree") else "torch.utils._pytree"
tree_leaves = _require(_PYTREE, "tree_leaves")
tree_map = _require(_PYTREE, "tree_map")
_check(f"{_PYTREE}.tree_leaves", tree_leaves(([1], {"a": (2, 3)})) == [1, 2, 3],
       "it no longer flattens lists, dicts and tuples")
_check(f"{_PYTREE}.tree_map", tree_map(lambda v: v + 1, ([1], {"a": 2})) == ([2], {"a": 3}),
       "it no longer maps over lists and dicts keeping their structure")

# Dispatch modes (the estimator's StorageMeter and CollectiveRecorder): documented, but in a private module.
TorchDispatchMode = _require("torch.utils._python_dispatch", "TorchDispatchMode")
is_traceable_wrapper_subclass_type = _require("torch.utils._python_dispatch", "is_traceable_wrapper_subclass_type")
_check("torch.utils._python_dispatch.TorchDispatchMode",
       isinstance(TorchDispatchMode, type) and hasattr(TorchDispatchMode, "__enter__"),
       "it is no longer a context-manager class")
_check("torch.utils._python_dispatch.is_traceable_wrapper_subclass_type",
       is_traceable_wrapper_subclass_type(torch.Tensor) is False, "it no longer answers False for torch.Tensor")


class DispatchMode(TorchDispatchMode):
    """A TorchDispatchMode whose ``__torch_dispatch__`` torch leaves unwrapped. By default torch wraps
    it in ``torch._dynamo.disable``: the first operator then imports dynamo (its import time: benchmarks/results/explorer_latency.md) and every
    operator pays one more call. Nothing is compiled under the estimator's modes, so the wrapper
    guards nothing there (``_should_skip_dynamo`` is the switch torch's own docstring shows)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

#: ``queue_callback(fn)``: run ``fn`` when the running backward ends (as FSDP2's root does).
queue_callback = _require("torch.autograd", "Variable._execution_engine.queue_callback")


def _callback_runs_at_end_of_backward() -> bool:
    order = []
    try:
        with torch.enable_grad():  # also when snn_explorer is imported under no_grad
            leaf = torch.zeros(1, requires_grad=True)
            mid = leaf * 2
            mid.register_hook(lambda g: queue_callback(lambda: order.append("end")))
            leaf.register_hook(lambda g: order.append("leaf"))
            mid.sum().backward()
    except (RuntimeError, TypeError):
        return False
    return order == ["leaf", "end"]


_check("torch.autograd.Variable._execution_engine.queue_callback", _callback_runs_at_end_of_backward(),
       "a callback queued during backward no longer runs once, after the backward")


def non_persistent_buffer_names(module: torch.nn.Module) -> set:
    """Names of ``module``'s own buffers registered with ``persistent=False`` (neuron state)."""
    return module._non_persistent_buffers_set


def spikingjelly_memories(module: torch.nn.Module) -> Optional[dict]:
    """spikingjelly's per-module state dict (``MemoryModule._memories``: name -> tensor or initial value), or None."""
    memories = plain_attribute(module, "_memories")
    return memories if isinstance(memories, dict) else None


def plain_attribute(module: torch.nn.Module, name: str) -> Any:
    """``getattr(module, name, None)`` for an attribute that is no parameter, buffer or sub-module: read from
    the instance or its class, so that a miss costs no ``nn.Module.__getattr__`` (which raises and catches
    an AttributeError; walks over every module of a 10 000-module model ask this of each)."""
    if name in module.__dict__:
        return module.__dict__[name]
    return getattr(module, name, None) if hasattr(type(module), name) else None


def own_tensors(module: torch.nn.Module) -> list:
    """``(name, tensor)`` of ``module``'s own parameters, then its own buffers (``named_parameters`` /
    ``named_buffers`` with ``recurse=False``, without their generic member walk)."""
    return ([(n, t) for n, t in module._parameters.items() if t is not None]
            + [(n, t) for n, t in module._buffers.items() if t is not None])


def forward_hook_ids(module: torch.nn.Module) -> tuple:
    """The handle ids of ``module``'s own forward pre-hooks and forward hooks (``Module._forward_pre_hooks`` /
    ``_forward_hooks``): a hook added or removed changes them."""
    return tuple(module._forward_pre_hooks), tuple(module._forward_hooks)


def spikingjelly_reset_values(module: torch.nn.Module) -> dict:
    """The values spikingjelly's ``reset()`` puts back in each memory (``MemoryModule._memories_rv``)."""
    return getattr(module, "_memories_rv", {})


def state_slot_table(module: torch.nn.Module, where: str) -> dict:
    """The dict a neuron keeps one kind of state in: ``"buffers"`` (``Module._buffers``, snntorch's
    non-persistent membranes), ``"memories"`` (spikingjelly) or ``"attributes"`` (the instance dict)."""
    if where == "buffers":
        return module._buffers
    if where == "memories":
        return spikingjelly_memories(module)
    if where == "attributes":
        return vars(module)
    raise ValueError(f"state slot {where!r}; expected 'buffers', 'memories' or 'attributes'")


def _non_persistent_names_work() -> bool:
    try:
        probe = torch.nn.Module()
        probe.register_buffer("state", torch.zeros(1), persistent=False)
        probe.register_buffer("kept", torch.zeros(1))
        return non_persistent_buffer_names(probe) == {"state"}
    except (AttributeError, TypeError):
        return False


_check("torch.nn.Module._non_persistent_buffers_set", _non_persistent_names_work(),
       "it is not the set of buffer names registered with persistent=False")

# DDP's bucketing (the estimator predicts DDP's buckets without running DDP).
_bucket_assignment = _require("torch.distributed", "_compute_bucket_assignment_by_size")
DDP_FIRST_BUCKET_BYTES = _require("torch.distributed", "_DEFAULT_FIRST_BUCKET_BYTES", callable_=False)
_check("torch.distributed._DEFAULT_FIRST_BUCKET_BYTES", isinstance(DDP_FIRST_BUCKET_BYTES, int),
       f"it is a {type(DDP_FIRST_BUCKET_BYTES).__name__}, not an int")


def ddp_bucket_assignment(tensors: list, limits: list) -> list:
    """DDP's assignment of ``tensors`` (in ready order) to buckets under ``limits`` bytes: index lists."""
    buckets, _ = _bucket_assignment(tensors, limits, [False] * len(tensors), list(range(len(tensors))))
    return [list(b) for b in buckets]


_meta = [torch.empty(4, device="meta"), torch.empty(4, device="meta")]
try:
    _probe_buckets = ddp_bucket_assignment(_meta, [1 << 20])
except (TypeError, RuntimeError, ValueError) as _exc:
    raise _error("torch.distributed._compute_bucket_assignment_by_size",
                 f"it no longer takes (tensors, limits, expect_sparse, indices) ({_exc})") from _exc
_check("torch.distributed._compute_bucket_assignment_by_size", _probe_buckets == [[0, 1]],
       f"it put two 16-byte tensors under a 1 MiB limit into {_probe_buckets}, not one bucket [[0, 1]]")
del _meta, _probe_buckets

_ddp_logging_data = _require("torch.nn.parallel", "DistributedDataParallel._get_ddp_logging_data")


def ddp_rebuilt_bucket_sizes(ddp: torch.nn.Module) -> list:
    """Bytes of each bucket a DistributedDataParallel module rebuilt after its first iteration."""
    sizes = str(_ddp_logging_data(ddp).get("rebuilt_bucket_sizes", ""))
    return [int(s) for s in sizes.replace(",", " ").split()]


# The c10d ops behind all_gather_into_tensor / reduce_scatter_tensor, as the recorder sees them.
ALLGATHER_BASE = _require("torch", "ops.c10d._allgather_base_")
REDUCE_SCATTER_BASE = _require("torch", "ops.c10d._reduce_scatter_base_")
for _where, _op in (("torch.ops.c10d._allgather_base_", ALLGATHER_BASE),
                    ("torch.ops.c10d._reduce_scatter_base_", REDUCE_SCATTER_BASE)):
    _check(_where, _arg_names(_op)[:3] == ["output_tensor", "input_tensor", "process_group"],
           f"its arguments are {_arg_names(_op)}, not (output_tensor, input_tensor, process_group, ...)")

#: ``resolve_process_group(name)``: the ProcessGroup of a functional collective's ``group_name``. The
#: recorder names groups by the mesh's own ``get_group(dim).group_name`` first; this is for a group
#: DTensor reuses from an earlier, equal mesh (measure() applies several plans in one process).
resolve_process_group = _require("torch.distributed.distributed_c10d", "_resolve_process_group")

#: The op namespace of the functional collectives DTensor issues (all_reduce, all_gather_into_tensor, ...).
FUNCTIONAL_COLLECTIVES = _require("torch", "ops._c10d_functional", callable_=False)
for _name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
    _where = f"torch.ops._c10d_functional.{_name}"
    _check(_where, hasattr(FUNCTIONAL_COLLECTIVES, _name), "it is missing")
    _check(_where, _arg_names(getattr(FUNCTIONAL_COLLECTIVES, _name))[-1:] == ["group_name"],
           f"its arguments are {_arg_names(getattr(FUNCTIONAL_COLLECTIVES, _name))}, not (..., group_name)")


@functools.lru_cache(maxsize=None)
def mem_tracker_class() -> type:
    """torch's ``MemTracker``, checked on first use: importing torch.distributed._tools takes a second
    (it loads the runtime estimator), too much for every ``import snn_explorer``."""
    cls = _require("torch.distributed._tools.mem_tracker", "MemTracker")
    tracker = cls()
    for name in ("_peak_mem", "_peak_mem_snap"):
        _check(f"torch.distributed._tools.mem_tracker.MemTracker.{name}",
               isinstance(getattr(tracker, name, None), dict), "it is not a dict per device")
    for name in ("track_external", "get_tracker_snapshot", "reset_mod_stats"):
        _check(f"torch.distributed._tools.mem_tracker.MemTracker.{name}", callable(getattr(tracker, name, None)),
               "it is missing")
    return cls


@functools.lru_cache(maxsize=None)
def fsdp_mem_tracker_class() -> type:
    """torch's ``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``, a private module), checked on
    first use: it categorises FSDP2's sharded / unsharded parameters and gradients as it tracks memory."""
    cls = _require("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker", params=("mod", "optm"))
    for name in ("track_inputs", "get_tracker_snapshot", "reset_mod_stats"):
        _check(f"torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker.{name}", callable(getattr(cls, name, None)),
               "it is missing")
    return cls


def restart_mem_tracker_peak(tracker: Any, device: torch.device) -> None:
    """Restart a MemTracker's peak from the current memory (it has no public reset)."""
    snapshot = tracker.get_tracker_snapshot()[device]
    tracker._peak_mem[device] = snapshot["Total"]
    tracker._peak_mem_snap[device] = snapshot


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``torch.compile`` wrapper (its private ``_orig_mod``), else ``module``."""
    if type(module).__name__ != "OptimizedModule":
        return module
    inner = getattr(module, "_orig_mod", None)
    _check("torch._dynamo.eval_frame.OptimizedModule._orig_mod", isinstance(inner, torch.nn.Module),
           "a compiled module no longer keeps the original in _orig_mod")
    return inner


class _NoHook:
    """Stands for a grad-hook handle MemTracker would remove on exit."""

    def remove(self) -> None:
        pass


def mem_tracker_skip_grad_hooks(tracker: Any, params: Iterable[Any]) -> None:
    """Tell ``MemTracker`` (its private ``_param_to_grad_hook_handles``) that ``params`` already have
    grad hooks: it registers one on every parameter of a module it enters, which fails for a frozen
    parameter (measure() on ranks; checked here, when first used, as mem_tracker imports slowly)."""
    handles = getattr(tracker, "_param_to_grad_hook_handles", None)
    if not (hasattr(handles, "get") and hasattr(handles, "__setitem__")):
        raise _error("torch.distributed._tools.mem_tracker.MemTracker._param_to_grad_hook_handles",
                     "it is missing or no longer a mapping")
    for p in params:
        handles[p] = (_NoHook(), _NoHook())


#: torch's base of every normalisation layer with running statistics (BatchNorm*d, SyncBatchNorm, LazyBatchNorm,
#: InstanceNorm*d, and spikingjelly's BatchNorm variants that subclass the private ``_BatchNorm``).
NORM_BASE = _require("torch.nn.modules.batchnorm", "_NormBase")
_check("torch.nn.modules.batchnorm._NormBase",
       isinstance(NORM_BASE, type) and issubclass(torch.nn.BatchNorm2d, NORM_BASE)
       and issubclass(torch.nn.InstanceNorm2d, NORM_BASE), "it is no longer the base of BatchNorm2d and InstanceNorm2d")


_IS_VIEW = _require("torch", "Tensor._is_view")


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` shares another tensor's storage as a view (``Tensor._is_view``)."""
    return bool(_IS_VIEW(tensor))


def returns_fresh_tensors(op: Any) -> bool:
    """Whether operator overload ``op`` mutates none of its arguments and returns no alias of one (its
    ``_schema``: not mutable, no alias annotation on a return): its outputs are new storages."""
    schema = op._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


def comm_debug_mode():
    """A new ``torch.distributed.tensor.debug.CommDebugMode``, its module imported on first use (it
    loads torch's compiler, which sets TORCHINDUCTOR_CACHE_DIR and makes a folder under TMPDIR)."""
    return importlib.import_module("torch.distributed.tensor.debug").CommDebugMode()



# DTensor's caches keyed on DeviceMesh / DTensorSpec (each holds its mesh, whose registry holds its
# process groups): torch keeps them for the process's life, so without clearing them a destroyed
# group's gloo / store threads live until interpreter teardown (ranks/teardown.py).
_MESH_TOPO_CACHE = _require("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh")
_TRANSFORM_INFOS_CACHE = _require("torch.distributed.tensor._redistribute", "_gen_transform_infos")
_CLEAR_PLANNER_CACHE = _require("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache")
_DTENSOR_CLASS = _require("torch.distributed.tensor", "DTensor", callable_=False)


def clear_dtensor_mesh_caches() -> None:
    """Empty torch's DTensor caches that hold meshes: mesh topology, redistribute plans and
    transforms, and the sharding propagator's cache."""
    _MESH_TOPO_CACHE.cache_clear()
    _TRANSFORM_INFOS_CACHE.cache_clear()
    _CLEAR_PLANNER_CACHE()
    _DTENSOR_CLASS._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


# --- op-level selective activation checkpointing (core/parallelize/saved_ops.py) ------------------
# The operators torchtitan's "selective op" policy keeps (torchtitan parallelize_llama.py ``_save_list``,
# December 2024: ``aten.mm``, the efficient and flash SDPA kernels, ``_c10d_functional.reduce_scatter_tensor``),
# plus the CPU flash kernel ``scaled_dot_product_attention`` dispatches to on CPU tensors (the same op on
# another device: on CPU ranks and in CPU / FakeTensor profiles it stands where the CUDA kernel runs on a GPU).
_ATEN = torch.ops.aten
SAC_MM = _ATEN.mm.default
SAC_SAVED_OPS = (SAC_MM, _ATEN._scaled_dot_product_efficient_attention.default,
                 _ATEN._scaled_dot_product_flash_attention.default,
                 _ATEN._scaled_dot_product_flash_attention_for_cpu.default,
                 torch.ops._c10d_functional.reduce_scatter_tensor.default)


# --- the reference project's LLM planner (benchmarks/published_llm.py, side by side) ---------------
#: Modules torch imports at its first use of a training step rather than at ``import torch``: the first
#: optimizer (``torch._compile``'s dynamo-disable wrapper, around ``Optimizer.__init__`` and ``zero_grad``)
#: imports ``torch._dynamo`` and about 200 modules with it, 0.9 s of CPU (torch 2.13, this 2-core VM). A
#: warm pool imports them once, before its ranks fork, so no run's ranks pay it again.
TRAINING_LAZY_IMPORTS = ("torch._dynamo",)

_SJ_LLM_PLANNING = "spikingjelly.activation_based.distributed.llm.planning"


def spikingjelly_llm_planner_bytes(config: Any, tp: int, pp: int, cp: int, dp_shard: int,
                                   selective_recompute: bool) -> tuple:
    """``(parameter and optimizer bytes, activation bytes)`` per GPU by spikingjelly's LLM planner: the static
    formulas its ``plan_training`` holds against the memory budget (``planning._parameter_memory_bytes`` and
    ``_activation_memory_bytes``, spikingjelly 2.0.0). ``config`` carries the fields they read of a
    ``TrainingConfig`` (whose transformer part is a Megatron Core ``TransformerConfig``). Imported on first use."""
    analyze = _require(_SJ_LLM_PLANNING, "_analyze_model")
    params = _require(_SJ_LLM_PLANNING, "_parameter_memory_bytes")
    activations = _require(_SJ_LLM_PLANNING, "_activation_memory_bytes")
    return (float(params(config, analyze(config), tp, pp, dp_shard)),
            float(activations(config, tp, pp, cp, selective_recompute)))

#: The code object of the wrapper torch's ``register_flop_formula`` puts around every formula not registered
#: with ``get_raw=True``: it hands the formula the shapes of the tensors, never the tensors.
_SHAPE_WRAPPED = shape_wrapper(lambda *a, **k: 0).__code__


def flop_formula_reads_shapes_only(formula) -> bool:
    """Whether a ``FlopCounterMode`` formula sees only its arguments' shapes and non-tensor values (wrapped by
    ``torch.utils.flop_counter.shape_wrapper``), so that its result is a function of those."""
    return getattr(formula, "__code__", None) is _SHAPE_WRAPPED


#: Tracer.trace's last setup step before the forward runs, where RootOnlyFxTracer shows the root's children.
_require("torch.fx", "Tracer.create_args_for_root", params=("root_fn", "is_module", "concrete_args"))


class RootOnlyFxTracer(torch.fx.Tracer):
    """A torch.fx tracer of the root's forward alone (every sub-module call one node) that skips
    ``Tracer.trace``'s setup walk of every module's attributes for tensor constants: the root's
    ``_modules`` are hidden while ``trace`` sets up, and shown again, with the full module-path table
    ``paths`` ({module: path}, what ``trace`` builds from ``named_modules``), in
    ``create_args_for_root``, its last step before the forward runs. The graph is the full trace's
    except that a tensor constant held below the root gets a ``_tensor_constantN`` get_attr name
    instead of its path."""

    def __init__(self, paths: dict):
        super().__init__()
        self._paths = paths
        self._hidden: Optional[tuple] = None

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return True

    def trace(self, root: torch.nn.Module, concrete_args: Optional[dict] = None) -> torch.fx.Graph:
        self._hidden = (root, root.__dict__["_modules"])
        root.__dict__["_modules"] = {}
        try:
            return super().trace(root, concrete_args)
        finally:
            self._show()

    def _show(self) -> None:
        if self._hidden is not None:
            root, children = self._hidden
            root.__dict__["_modules"] = children
            self._hidden = None

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        self._show()
        self.submodule_paths = dict(self._paths)
        return super().create_args_for_root(root_fn, is_module, concrete_args)
