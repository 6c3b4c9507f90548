"""One training step of the model one rank runs, traced as a GPU runs it, on the meta device.

Nothing is computed: a meta-device copy of the model (the unsharded model, or its TP replica)
runs one forward and backward at the rank's batch and time steps, its fused-kernel neurons
replaced by :class:`~.fused_neurons.FusedNeuron` (what the GPU's kernel allocates and saves), under
:class:`DeviceMeter`, a dispatch mode that

- counts live bytes as the CUDA caching allocator reports them (``torch.cuda.max_memory_allocated``):
  each storage once, rounded up to a multiple of 512 bytes (``kMinBlockSize`` in torch's
  ``c10/cuda/CUDACachingAllocator.cpp``: "all sizes are rounded to at least 512 bytes");
- records one :class:`Kernel` per operator that launches one: its phase, its kind (``conv``: cuDNN
  convolutions, ``matmul``: other operators with FLOPs, ``memory``: the rest, ``neuron``: a fused
  neuron launch), FLOPs by torch's ``FlopCounterMode`` formulas, bytes read and written, launches.
  Views and allocations launch nothing; a convolution's backward launches one kernel per gradient
  it computes; a ``_foreach_`` operator one per 36 tensors (``depth_to_max_tensors[3]`` of torch's
  ``ATen/native/cuda/MultiTensorApply.cuh``, Adam's four lists). A training batch norm runs two
  passes over its input, as torch's CUDA kernels do (``ATen/native/cuda/Normalization.cuh``:
  ``batch_norm_collect_statistics_kernel`` then ``batch_norm_transform_input_kernel``; backward
  ``batch_norm_backward_reduce_kernel`` then ``batch_norm_backward_elemt_kernel``): the statistics
  must be complete before any element is normalised, so it reads its input (and, backward, the
  output's gradient) twice, in two launches. Bytes moved are the operator's tensor arguments
  (read; not the target of a fill or copy) and outputs (written). A convolution with a bias runs as
  torch runs it through cuDNN (``aten/src/ATen/native/Convolution.cpp``: ``_convolution``'s
  ``ConvBackend::Cudnn`` case calls ``cudnn_convolution`` without the bias, then
  ``output.add_(reshape_bias(...))``; ``convolution_backward`` computes the bias gradient "outside of the
  backend" as ``grad_output.sum(...)``): the bias is one more elementwise kernel over the output after the
  convolution, and its gradient one reduction kernel over the output's gradient (a depthwise convolution,
  whose own CUDA kernel takes the bias, excepted).

A pipeline stage is traced the same way, one micro-batch as mode ``pp`` runs it
(:func:`gpu_stage_kernels` for its time, :func:`gpu_stage_memory` for its bytes through the schedule).
An elementwise chain a ``torch.jit.script`` function runs is one kernel, as TorchScript's fuser runs it
on CUDA (:mod:`.script_fusion`). Meta operator outputs are remembered by their call's metadata (:mod:`.meta_memo`).

A fused neuron op that autotunes its kernels at their first call (:mod:`.fused_neurons`, the triton op) holds a
transient meanwhile: the meter keeps the most bytes live at such a moment (``tune_peak``), once per kernel key, for
the first step's peak (:attr:`GpuStep.tuned`).

FSDP2's points are logged as :func:`~..instruments.fsdp_events.record` logs them on the CPU profile
run, so :func:`~.fsdp_timeline.replay_fsdp` replays its buffers on this run the same way.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch.utils.flop_counter import FlopCounterMode

from ...compat import tree_leaves
from ...core.model import detached_copy
from ...core.parallelize import PipelineStageModule, StageConfig, build_stage
from ..instruments.fsdp_events import record
from ..instruments.meter import StorageMeter
from ..instruments.op_counter import tensor_bytes
from ..instruments.storage import LiveSaved, model_state_tensors
from ..profile.profiling import MAX_SHAPE_ONLY_OPS, ModelProfile, fitted_ops
from ..profile.step import OPTIMIZERS, forward_loss, loss_of
from .fsdp_timeline import FsdpTimeline, replay_fsdp
from .fused_neurons import FusedNeuron, swap_fused
from .meta_autocast import MetaAutocast
from .meta_memo import META_OUTPUTS
from .script_fusion import fused_script_calls
from .stage_memory import Counting, StageMemory, _measure

#: The CUDA caching allocator's block granularity (bytes; source in the module doc).
ALLOCATOR_BLOCK = 512
#: Tensors one multi-tensor-apply launch takes for four lists (source in the module doc).
FOREACH_TENSORS_PER_LAUNCH = 36
_FLOPS = FlopCounterMode(display=False).flop_registry
_ATEN = torch.ops.aten
_CONV = {_ATEN.convolution, _ATEN.convolution_backward, _ATEN._convolution, _ATEN.cudnn_convolution}
#: Operators run as two passes (module doc): the argument positions their second pass reads again.
_TWO_PASS = {_ATEN.native_batch_norm: (0,), _ATEN._native_batch_norm_legit: (0,), _ATEN._batch_norm_with_update: (0,),
             _ATEN.native_batch_norm_backward: (0, 1), _ATEN.batch_norm_backward: (0, 1)}
#: Operators that write their first argument's shape without reading it (fills, copies into it).
_FIRST_NOT_READ = {_ATEN.copy_, _ATEN.fill_, _ATEN.zero_, _ATEN.zeros_like, _ATEN.ones_like, _ATEN.full_like,
                   _ATEN.new_zeros, _ATEN.new_ones, _ATEN.new_full}
#: Operators that launch no kernel: allocations, and aliases whose schema is not a view's (``_unsafe_view`` returns
#: its input's storage reshaped, as ``torch.matmul`` folds batch dimensions: torch's ``TensorShape.cpp``).
_NO_KERNEL = {_ATEN.empty, _ATEN.empty_like, _ATEN.empty_strided, _ATEN.new_empty, _ATEN.new_empty_strided,
              _ATEN.detach, _ATEN.lift_fresh, _ATEN.alias, _ATEN._local_scalar_dense, _ATEN._unsafe_view}


@dataclass(frozen=True)
class Kernel:
    """One GPU launch group: phase, kind (module doc), FLOPs, bytes moved, float size, launches."""

    phase: str
    kind: str
    flops: float
    bytes: int
    itemsize: int
    launches: int
    #: The GEMMs a ``conv`` / ``matmul`` kernel runs, ``(batch, M, N, K)`` each (a convolution as cuDNN's
    #: implicit GEMM: :func:`gemm_shapes`); empty where not known (the kernel is then timed without quantisation)
    gemms: Tuple[Tuple[int, int, int, int], ...] = ()


def allocated(nbytes: int) -> int:
    """Bytes the caching allocator counts for a storage of ``nbytes`` (rounded up to its block)."""
    return -(-nbytes // ALLOCATOR_BLOCK) * ALLOCATOR_BLOCK if nbytes else 0


def _launches(func, args) -> int:
    if func.overloadpacket is _ATEN.convolution_backward:
        return max(1, sum(bool(m) for m in args[-1]))  # output_mask: grad input, weight, bias
    if func.overloadpacket.__name__.startswith("_foreach_"):
        tensors = args[0] if args and isinstance(args[0], (list, tuple)) else ()
        return max(1, math.ceil(len(tensors) / FOREACH_TENSORS_PER_LAUNCH))
    return 1


def _prod(xs) -> int:
    return math.prod(int(x) for x in xs)


def gemm_shapes(func, args, out) -> Tuple[Tuple[int, int, int, int], ...]:
    """``(batch, M, N, K)`` of each GEMM ``func`` runs: ``mm`` / ``addmm`` / ``bmm`` as written; a convolution
    as the implicit GEMM cuDNN runs per group (forward ``M = N * P * Q`` output pixels, ``N`` = output
    channels, ``K = C * R * S``; the data gradient ``M = N * H * W``, ``N = C``, ``K`` = output channels
    ``* R * S``; the weight gradient ``M`` = output channels, ``N = C * R * S``, ``K = N * P * Q``)."""
    packet = func.overloadpacket
    shape = lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else None  # noqa: E731
    if packet in (_ATEN.mm, _ATEN.addmm):
        a, b = (args[0], args[1]) if packet is _ATEN.mm else (args[1], args[2])
        return ((1, a.shape[0], b.shape[1], a.shape[1]),)
    if packet in (_ATEN.bmm, _ATEN.baddbmm):
        a, b = (args[0], args[1]) if packet is _ATEN.bmm else (args[1], args[2])
        return ((a.shape[0], a.shape[1], b.shape[2], a.shape[2]),)
    if packet in (_ATEN.convolution, _ATEN._convolution):
        x, w, groups = shape(args[0]), shape(args[1]), int(args[8])
        y = shape(out)
        return ((groups, x[0] * _prod(y[2:]), w[0] // groups, w[1] * _prod(w[2:])),)
    if packet is _ATEN.convolution_backward:
        gy, x, w, groups, mask = shape(args[0]), shape(args[1]), shape(args[2]), int(args[9]), args[10]
        rs, k_out = _prod(w[2:]), w[0] // groups
        gemms = []
        if mask[0]:
            gemms.append((groups, x[0] * _prod(x[2:]), w[1], k_out * rs))
        if mask[1]:
            gemms.append((groups, k_out, w[1] * rs, gy[0] * _prod(gy[2:])))
        return tuple(gemms)
    return ()


def _bias_kernel_bytes(func, args, out) -> Optional[Tuple[int, int, int]]:
    """For a convolution whose bias cuDNN does not take (module doc): ``(bytes of the bias the convolution's own
    record counts, launches it counts for it, bytes the bias kernel moves)``; None for other operators."""
    packet = func.overloadpacket
    if packet in (_ATEN.convolution, _ATEN._convolution):
        x, bias, groups = args[0], args[2], int(args[8])
        if bias is None or (groups > 1 and groups == x.shape[1]):  # no bias, or a depthwise kernel that adds it
            return None
        return tensor_bytes(bias), 0, 2 * tensor_bytes(out) + tensor_bytes(bias)  # out read and written, bias read
    if packet is _ATEN.convolution_backward and args[10][2]:
        x, groups, grad_bias = args[1], int(args[9]), out[2]
        if groups > 1 and groups == x.shape[1]:
            return None
        return tensor_bytes(grad_bias), 1, tensor_bytes(args[0]) + tensor_bytes(grad_bias)  # grad_output.sum
    return None


def _itemsize(args) -> int:
    for a in tree_leaves(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.element_size()
    return 4


class DeviceMeter(StorageMeter):
    """A :class:`StorageMeter` that also counts meta storages (allocator-rounded) and records the
    kernels of every operator (module doc); ``phase`` names the phase being traced."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.kernels: List[Kernel] = []
        self.tuned: set = set()  # the autotune keys seen (a kernel is tuned at its key's first call only)
        self.tune_peak = 0  # the most bytes live while a kernel autotuned (its transient included)

    def _see(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key, nbytes = id(st), allocated(st.nbytes())
        old = self._bytes.get(key)
        if old is None:
            self._refs[key] = weakref.ref(st, lambda _, k=key: self._free(k))
        self._bytes[key] = nbytes
        self.current += nbytes - (old or 0)

    def fused(self, name: str, read: int, written: int, tune=None) -> None:
        """A fused neuron launch (:mod:`.fused_neurons`) moving ``read + written`` bytes; ``tune``: ``(key, bytes)``
        where the op autotunes at its key's first call, holding ``bytes`` more meanwhile (module doc)."""
        self.kernels.append(Kernel(self.phase, "neuron", 0.0, read + written, 4, 1))
        if tune is not None and tune[0] not in self.tuned:
            self.tuned.add(tune[0])
            self.tune_peak = max(self.tune_peak, self.current + tune[1])

    def restart(self) -> None:
        """Forget the kernels and autotune keys recorded so far (a warm-up run's, outside the traced step)."""
        self.kernels, self.tuned, self.tune_peak = [], set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = META_OUTPUTS.run(func, args, kwargs)
        if not (func.is_view or func.overloadpacket in _NO_KERNEL):
            formula = _FLOPS.get(func.overloadpacket)
            flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0.0
            kind = "conv" if func.overloadpacket in _CONV else ("matmul" if formula is not None else "memory")
            read = args[1:] if func.overloadpacket in _FIRST_NOT_READ else args
            moved = tensor_bytes(read) + tensor_bytes(kwargs) + tensor_bytes(out)
            again = _TWO_PASS.get(func.overloadpacket, ())
            moved += sum(tensor_bytes(args[i]) for i in again)
            launches = _launches(func, args) + (1 if again else 0)
            gemms = gemm_shapes(func, args, out) if flops else ()
            bias = _bias_kernel_bytes(func, args, out)  # cuDNN's convolution leaves the bias to its own kernel
            moved, launches = (moved - bias[0], launches - bias[1]) if bias else (moved, launches)
            self.kernels.append(Kernel(self.phase, kind, float(flops), moved, _itemsize(args), launches, gemms))
            if bias:
                self.kernels.append(Kernel(self.phase, "memory", 0.0, bias[2], _itemsize(args), 1))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t)
        self.peak = max(self.peak, self.current)
        return out


@dataclass(frozen=True)
class GpuStep:
    """One traced forward and backward: its kernels, what it holds, its peaks (as ``dynamic_peak``)."""

    kernels: Tuple[Kernel, ...]
    saved: int  # bytes the forward leaves held above its start (what autograd keeps for backward)
    state: int  # neuron state after the forward
    entry: int  # bytes live when the forward starts (parameters, buffers, input, last state)
    grads: int  # bytes of the gradients after the backward
    tuned: int  # the most bytes held above ``entry`` while a kernel autotuned (its first call; 0 where none did)
    log: object  # the FSDP2 event log (:class:`~..instruments.fsdp_events.EventLog`)
    fused: Tuple[str, ...]  # the neurons that ran as fused kernels


def _state_tensors(model: torch.nn.Module) -> list:
    fused = [m.v for m in model.modules() if isinstance(m, FusedNeuron) and m.v is not None]
    return model_state_tensors(model) + fused


def _meta_inputs(profile: ModelProfile, n: int, t: int):
    """A meta batch of ``n`` samples and ``t`` steps as the model takes it, and meta labels."""
    example = profile.example_input
    dtype = profile.dtype if example.is_floating_point() else example.dtype  # token ids stay integers
    x = torch.empty((t, n) + tuple(example.shape[2:]), dtype=dtype, device="meta")
    layout = getattr(profile, "layout", None)  # the input layout, where the profile records one
    if layout is not None:
        x = layout.from_time_major(x)
    y = profile.labels
    if y is not None:
        y = torch.empty((n,) + tuple(y.shape[1:]), dtype=y.dtype, device="meta")
    return x, y


def _live_bytes(tensors) -> int:
    """Allocator bytes of the distinct storages of ``tensors`` (None skipped)."""
    storages = (t.untyped_storage() for t in tensors if t is not None)
    return sum(allocated(st.nbytes()) for st in {id(s): s for s in storages}.values())


class MetaSaved(LiveSaved):
    """:class:`LiveSaved` for meta storages (all at address 0: told apart by object, as the meter does),
    each counted as the caching allocator counts it."""

    def __init__(self, skip_tensors):
        super().__init__({id(t.untyped_storage()) for t in skip_tensors if t is not None})

    def storage_of(self, t):
        st = t.untyped_storage()
        return st, id(st)

    def bytes_of(self, st) -> int:
        return allocated(st.nbytes())


#: The stages as the GPU runs them (the meta trace's meter and the allocator's bytes).
ON_GPU = Counting(DeviceMeter, MetaSaved, _live_bytes, autocast=False)


def trace_step(model: torch.nn.Module, x: torch.Tensor, labels, units=(), neuron_backend: str = "torch",
               copy: bool = True) -> GpuStep:
    """Trace one forward and backward of a meta copy of ``model`` on meta ``x`` (module doc),
    FSDP2's points logged for ``units``; the step starts, as a rank's does, with the last step's
    neuron state of this size and no gradients. ``copy=False``: ``model`` is a meta copy already,
    which the trace may change (:meth:`~..profile.profiling.ModelProfile.meta_model`)."""
    meter = DeviceMeter()
    model = detached_copy(model).to("meta") if copy else model
    fused = swap_fused(model, neuron_backend, meter.fused)
    with torch.no_grad():
        forward_loss(model, x, labels)
    meter.restart()  # the warm-up forward's fused launches are not the step's (and run the ops' inference kernels)
    model.zero_grad(set_to_none=True)
    state_ids = {id(s) for s in _state_tensors(model)}
    static = [p for p in model.parameters()] + [b for b in model.buffers() if id(b) not in state_ids] + [x]
    meter.track(static + _state_tensors(model))
    with meter, record(model, units, meter) as log, fused_script_calls(model, meter):
        entry = meter.current
        with MetaAutocast():  # a mixed-precision profile's autocast hooks, as CUDA applies them
            loss = forward_loss(model, x, labels)
        log.mark(meter, "forward_end")
        saved = meter.current - entry
        state = _live_bytes(_state_tensors(model))
        meter.phase = "backward"
        loss.backward()
        del loss
        log.mark(meter, "end")
    grads = _live_bytes([p.grad for p in model.parameters() if p.grad is not None])
    tuned = max(0, meter.tune_peak - entry) if meter.tune_peak else 0
    return GpuStep(tuple(meter.kernels), saved, state, entry, grads, tuned, log, fused)


def gpu_step(profile: ModelProfile, n: int, t: int, tp_plan=None, tp: int = 1, neuron_backend: str = "torch",
             units=()) -> GpuStep:
    """:func:`trace_step` of the model one rank runs (``profile.rank_model``) at ``n`` samples and
    ``t`` steps, FSDP2's points logged for the profile's units and ``units``; cached on the profile."""
    cache = profile.__dict__.setdefault("_gpu_steps", {})
    key = (n, t, neuron_backend) + profile.rank_model(tp_plan, tp)[0]
    if key not in cache or not set(units) <= set(cache[key].log.units):
        logged = set(cache[key].log.units) if key in cache else set(profile.fsdp_units)
        x, y = _meta_inputs(profile, n, t)
        model = profile.meta_model(tp_plan, tp)
        cache[key] = trace_step(model, x, y, sorted(logged | set(units)), neuron_backend, copy=False)
    return cache[key]


def check_trace_size(profile: ModelProfile, n: int, t: int, neuron_backend: str = "torch") -> None:
    """ValueError, before the trace runs, where tracing ``t`` steps would launch more than
    :data:`MAX_SHAPE_ONLY_OPS` kernels. A fused neuron's kernels do not grow with the steps, an eager
    neuron's loop does: the kernels of one and two steps, extrapolated linearly (traced only where the
    operators as run here, an upper bound, exceed the limit)."""
    if t <= 2 or fitted_ops(profile, n, t) <= MAX_SHAPE_ONLY_OPS:
        return
    one, two = (len(gpu_step(profile, n, steps, neuron_backend=neuron_backend).kernels) for steps in (1, 2))
    kernels = one + (two - one) * (t - 1)
    if kernels > MAX_SHAPE_ONLY_OPS:
        raise ValueError(f"time_steps={t} with {n} samples per rank: tracing the step as the GPU runs it would "
                         f"take about {kernels:.3g} kernels (more than {MAX_SHAPE_ONLY_OPS}; its neurons loop over "
                         "the time steps); use fewer time_steps")


@dataclass(frozen=True)
class StageKernels:
    """The kernels of one micro-batch's forward (with the loss on the last stage) and backward through
    one pipeline stage, as the GPU runs them."""

    forward: Tuple[Kernel, ...]
    backward: Tuple[Kernel, ...]


def _trace_stage(meter: DeviceMeter, stage: PipelineStageModule, inp: torch.Tensor, labels, layout,
                 last: bool) -> Tuple[StageKernels, torch.Tensor]:
    """The kernels of ``stage`` on ``inp`` (after a forward at this size, as in a step: its neuron
    state exists), and its output; the gradient of a middle stage's output is a buffer given before."""
    with torch.no_grad():  # every stage, the last too: its neurons then hold state of this size
        warm = stage(inp)
    grad_out = None if last else torch.ones_like(warm)
    del warm
    first = len(meter.kernels)
    with meter:
        meter.phase = "forward"
        out = stage(inp)
        loss = loss_of(out, labels, layout) if last else None
        middle = len(meter.kernels)
        meter.phase = "backward"
        if loss is not None:
            loss.backward()
        elif out.requires_grad:  # a first stage with every parameter frozen has no backward
            torch.autograd.backward([out], [grad_out])
    kernels = meter.kernels
    return StageKernels(tuple(kernels[first:middle]), tuple(kernels[middle:])), out.detach()


def gpu_stage_kernels(profile: ModelProfile, stages, n: int, t: int, tp_plan=None, tp: int = 1,
                      neuron_backend: str = "torch") -> Tuple[StageKernels, ...]:
    """:class:`StageKernels` of every pipeline stage (``stages``: unit paths) for a micro-batch of ``n``
    samples and ``t`` steps, traced on a meta copy of the model one rank runs (its fused-kernel neurons
    swapped in) as mode ``pp`` runs each stage (:class:`~...core.parallelize.pipeline.PipelineStageModule`:
    reset, contiguous input, its units, its output in the compute dtype; a received input that requires
    grad); cached on the profile."""
    cache = profile.__dict__.setdefault("_gpu_stages", {})
    key = (tuple(map(tuple, stages)), n, t, neuron_backend) + profile.rank_model(tp_plan, tp)[0]
    if key not in cache:
        meter = DeviceMeter()
        model = profile.meta_model(tp_plan, tp)
        swap_fused(model, neuron_backend, meter.fused)
        x, y = _meta_inputs(profile, n, t)
        out = []
        config = StageConfig(per_step=profile.layout.per_step, precision=profile.precision)  # no autocast on meta
        for i, paths in enumerate(stages):
            stage = build_stage(i, paths, model, config)
            inp = x if i == 0 else x.requires_grad_()
            with fused_script_calls(model, meter):
                kernels, x = _trace_stage(meter, stage, inp, y, profile.layout, i == len(stages) - 1)
            out.append(kernels)
        cache[key] = tuple(out)
    return cache[key]


def gpu_stage_memory(profile: ModelProfile, stages, n: int, t: int, micro: int, tp_plan=None, tp: int = 1,
                     neuron_backend: str = "torch") -> List[StageMemory]:
    """:func:`~.stage_memory.measure_stages` as the GPU runs the stages: on a meta copy of the model one
    rank runs, its fused-kernel neurons swapped in, bytes as the caching allocator counts them; cached."""
    cache = profile.__dict__.setdefault("_gpu_stage_memory", {})
    key = (tuple(map(tuple, stages)), n, t, micro, neuron_backend) + profile.rank_model(tp_plan, tp)[0]
    if key not in cache:
        model = profile.meta_model(tp_plan, tp)
        swap_fused(model, neuron_backend, lambda *launch: None)  # the launches are timed by gpu_stage_kernels
        to_meta = lambda v: None if v is None else v.to("meta")
        cache[key] = _measure(profile, model, to_meta, stages, n, t, micro, ON_GPU)
    return cache[key]


def gpu_peaks(step: GpuStep, fsdp: Optional[FsdpTimeline] = None) -> Tuple[int, int, int, int]:
    """The traced step's (forward peak, backward peak, left after it, FSDP2's most held) above its
    start, the last two beside the gradients, as :func:`~.step_peak.dynamic_peak` gives them."""
    fwd, bwd, after, held = replay_fsdp(step.log, step.entry, fsdp)
    grads = 0 if fsdp else step.grads
    return fwd, bwd - grads, after - grads, held


def optimizer_kernels(profile: ModelProfile, tp_plan, tp: int, optimizer: str) -> Tuple[Kernel, ...]:
    """The kernels of one ``optimizer`` step (its state already created) over the parameters of the
    model one rank runs, as torch runs it on CUDA (``foreach``, the default there); cached."""
    cache = profile.__dict__.setdefault("_gpu_optimizer", {})
    layout, model = profile.rank_model(tp_plan, tp)
    key = (layout, optimizer)
    if key not in cache:
        model = detached_copy(model).to("meta")
        params = [p for name, p in model.named_parameters() if name in set(profile.grad_params) or tp > 1]
        params = [p for p in params if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        kind = OPTIMIZERS[optimizer]  # (class, kwargs), or an OptimizerKind where the vocabulary has one
        cls, kw = (kind.cls, dict(kind.kwargs)) if hasattr(kind, "cls") else kind
        opt = cls(params, lr=1e-3, foreach=True, **kw)
        opt.step()
        meter = DeviceMeter()
        meter.phase = "optimizer"
        with meter:
            opt.step()
        cache[key] = tuple(meter.kernels)
    return cache[key]
