"""The fused multi-step neuron kernel a GPU run uses, as a shape model for tracing that run.

On CUDA, spikingjelly 2.0.0's multi-step ``LIFNode`` runs one custom op over the whole sequence
(``sj_lif.forward``; its wheel has no native build, so the Triton provider), whatever the plan's
``neuron_backend`` says; older releases did so only with ``backend='cupy'`` / ``'triton'``. Read
from the package's ``_ops/lif/autograd.py`` (facts: ``shared/reference/reference-package-facts.md``):

- forward, one launch: reads ``x_seq`` ``[T, ...]`` and ``v_init`` ``[...]`` (fp32), writes the
  spikes (``x_seq``'s dtype), the pre-spike potential ``h`` ``[T, ...]`` (always fp32) and the last
  potential ``v`` ``[...]`` (fp32, kept as the neuron's state);
- saved for backward: ``h``, ``x_seq`` (by reference: only double backward reads it, but it keeps
  the input alive) and ``v_init``;
- backward, one launch: reads the spikes' gradient and ``h`` (the unused last potential's gradient
  is a zero ``[...]`` fp32 tensor), writes ``grad_x`` (input dtype) and ``grad_v_init`` (fp32).

:class:`FusedNeuron` stands in for such a neuron in a meta-device copy of the model: it allocates
and saves exactly those tensors, and tells the trace (:mod:`.gpu_trace`) the bytes each launch
moves. The CPU profile runs the pure-torch path instead, which saves ``h - threshold`` and
``1 - spike`` per step (``detach_reset=True``) and launches several operators per step.
snntorch neurons, single-step spikingjelly neurons and others run eagerly on a GPU too: they are
traced as they are.

The releases whose ``LIFNode`` takes a ``backend`` argument run, with ``backend='triton'``, a different
fused op: ``triton_kernel.multistep_lif`` (upstream ``spikingjelly/activation_based/triton_kernel/
neuron_kernel/lif.py``, ``multistep_lif_forward`` and its ``_setup_context``). Its forward allocates the
spikes, the last potential and ``h_seq`` (``torch.empty_like(x_seq)``: the input's dtype) and saves **only
h_seq**: neither the input nor ``v_init`` (which the neuron replaces by the op's last potential, so it is
freed); its backward writes ``grad_x`` (``empty_like`` of the spikes' gradient) and ``grad_v_init``
(``empty_like(h_seq[0])``). That release's memopt examples build their neurons with ``backend='triton'``
(upstream ``examples/memopt/models.py``). :data:`SAVES_INPUT` tells the two ops apart.

Two more things that op does on CUDA, in every upstream version of that file (git history, 2025-09 to 2026-08):

- it returns a ``[T, ...]`` output the neuron does not use (``h_seq`` since the op became a ``torch.library``
  custom op, 2026-04; ``v_seq``, then ``[T, ...]``, in the ``autograd.Function`` before) and never calls
  ``ctx.set_materialize_grads(False)`` (2.0.0's ``sj_lif`` calls it and marks h non-differentiable), so
  autograd hands its backward a zero-filled gradient for that output (torch's ``FunctionCtx.set_materialize_grads``:
  by default undefined output gradients are expanded to tensors of zeros before ``backward`` runs): a
  ``[T, ...]`` fill kernel and tensor in each neuron's backward;
- its kernels are ``@triton.autotune`` decorated (four configs, keyed on ``T`` and ``NCL`` among others) with
  ``restore_value`` (forward: ``s_seq``, ``h_seq``, ``v_seq``; backward: ``grad_x_seq``, and ``grad_v_init`` since
  2025-12).
  The first call of each key benchmarks every config with ``triton.testing.do_bench``, which allocates
  Triton's 256 MiB L2-flush buffer (``get_empty_cache_for_benchmark``: ``torch.empty(256 * 1024 * 1024 //
  4, dtype=torch.int)``), and the autotuner clones the ``restore_value`` tensors before each trial: a
  transient the caching allocator counts (``max_memory_allocated``) once per key, in the first step.
  :class:`FusedNeuron` reports it to the sink (``tune``) for the trace's first-step peak.
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch
from torch import nn

#: The neuron classes (spikingjelly's names) whose multi-step CUDA path is the fused LIF op.
FUSED_CLASSES = ("LIFNode",)
#: The neuron backends that select a fused kernel in spikingjelly releases that take one.
FUSED_BACKENDS = ("cupy", "triton")
#: Per fused op, whether it saves its input and ``v_init`` beside ``h`` (module doc): 2.0.0's ``sj_lif`` does
#: (h always fp32), the ``backend='triton'`` op of the releases with a ``backend`` argument does not (h in the
#: input's dtype). The cupy op of those releases is modelled as ``sj_lif`` (not checked against its source).
SAVES_INPUT = {"sj_lif": True, "triton": False, "cupy": True}
#: Bytes of Triton's L2-flush buffer that ``do_bench`` allocates while it autotunes a kernel (module doc).
TRITON_BENCH_CACHE_BYTES = 256 * 1024 * 1024

#: (kernel name, bytes read, bytes written, tune) -> None; the trace's record of one fused launch. ``tune``: None, or
#: ``(key, bytes)`` where the op autotunes its kernel at the first call of ``key``, holding ``bytes`` more meanwhile.
KernelSink = Callable[..., None]


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _blocks(*tensors: torch.Tensor) -> int:
    """Bytes the caching allocator counts for fresh copies of ``tensors``: 512-byte blocks (its ``kMinBlockSize``, as
    :data:`.gpu_trace.ALLOCATOR_BLOCK`, which imports this module)."""
    return sum(-(-_nbytes(t) // 512) * 512 for t in tensors)


def _tune(direction: str, seq: torch.Tensor, restored) -> tuple:
    """The autotune report of the triton op's ``direction`` kernel on ``seq`` ``[T, ...]`` (module doc): its key and
    the bytes held while it tunes (Triton's flush buffer and one clone of each ``restore_value`` tensor)."""
    key = (direction, seq.shape[0], seq[0].numel(), seq.dtype)
    return key, TRITON_BENCH_CACHE_BYTES + _blocks(*restored)


def runs_fused(module: nn.Module, neuron_backend: str) -> bool:
    """Whether ``module`` runs the fused multi-step kernel on CUDA: a spikingjelly multi-step LIF
    neuron of 2.0.0 (no ``backend`` attribute: the package picks the fused op itself), or of an
    older release whose ``backend`` (or the plan's ``neuron_backend``) is cupy / triton."""
    cls = type(module)
    if cls.__name__ not in FUSED_CLASSES or not cls.__module__.startswith("spikingjelly"):
        return False
    if getattr(module, "step_mode", "s") != "m":
        return False
    backend = getattr(module, "backend", None)
    return backend is None or backend in FUSED_BACKENDS or neuron_backend in FUSED_BACKENDS


def fused_op(module: nn.Module, neuron_backend: str) -> str:
    """The fused op a :func:`runs_fused` neuron runs on CUDA (a key of :data:`SAVES_INPUT`): ``sj_lif`` for
    2.0.0 (no ``backend`` attribute: the plan's ``neuron_backend`` does not change its op), else the module's
    fused ``backend``, else the plan's."""
    backend = getattr(module, "backend", None)
    if backend is None:
        return "sj_lif"
    return backend if backend in FUSED_BACKENDS else neuron_backend


class FusedLIFKernel(torch.autograd.Function):
    """The fused op's allocations and saved tensors (module doc), on any device (meta here)."""

    @staticmethod
    def forward(ctx, x_seq: torch.Tensor, v_init: torch.Tensor, sink: KernelSink, saves_input: bool = True):
        spikes = torch.empty_like(x_seq)
        h_dtype = torch.float32 if saves_input else x_seq.dtype  # sj_lif: fp32; triton op: empty_like(x_seq)
        h = torch.empty(x_seq.shape, dtype=h_dtype, device=x_seq.device)
        v_last = torch.empty(x_seq.shape[1:], dtype=torch.float32, device=x_seq.device)
        ctx.sink, ctx.x_dtype, ctx.saves_input = sink, x_seq.dtype, saves_input
        ctx.mark_non_differentiable(v_last)
        if saves_input:  # sj_lif: h is not an output that takes a gradient
            ctx.save_for_backward(h, x_seq, v_init)
            ctx.mark_non_differentiable(h)
            ctx.set_materialize_grads(False)
            tune = None
        else:  # triton op: h is an output whose unused gradient autograd fills with zeros (module doc)
            ctx.save_for_backward(h)
            tune = _tune("forward", x_seq, (spikes, h, v_last))
        sink("neuron_forward", _nbytes(x_seq, v_init), _nbytes(spikes, h, v_last), tune)
        return spikes, v_last, h

    @staticmethod
    def backward(ctx, grad_spikes: torch.Tensor, grad_v: torch.Tensor, grad_h: torch.Tensor):
        h = ctx.saved_tensors[0]
        if grad_spikes is None:  # sj_lif fills the missing gradients itself
            grad_spikes = torch.zeros(h.shape, dtype=ctx.x_dtype, device=h.device)
        if grad_v is None:
            grad_v = torch.zeros(h.shape[1:], dtype=torch.float32, device=h.device)
        grad_x = torch.empty(h.shape, dtype=ctx.x_dtype, device=h.device)
        grad_v_init = torch.empty(h.shape[1:], dtype=torch.float32, device=h.device)
        tune = None if ctx.saves_input else _tune("backward", h, (grad_x, grad_v_init))
        ctx.sink("neuron_backward", _nbytes(grad_spikes, grad_v, h), _nbytes(grad_x, grad_v_init), tune)
        return grad_x, grad_v_init, None, None


class FusedNeuron(nn.Module):
    """A fused multi-step LIF neuron: ``[T, ...]`` in, spikes out; its last potential is its state."""

    def __init__(self, sink: KernelSink, op: str = "sj_lif"):
        super().__init__()
        if op not in SAVES_INPUT:
            raise ValueError(f"op={op!r}: the fused neuron ops modelled are {sorted(SAVES_INPUT)}")
        self.sink, self.op = sink, op
        self.v = None  # the last potential, kept between calls as the package keeps it

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        # the state a reset leaves is a float; the op's first call materialises it as a zero tensor
        v_init = torch.zeros(x_seq.shape[1:], dtype=torch.float32, device=x_seq.device)
        spikes, self.v, _ = FusedLIFKernel.apply(x_seq, v_init, self.sink, SAVES_INPUT[self.op])
        return spikes


def swap_fused(model: nn.Module, neuron_backend: str, sink: KernelSink) -> Tuple[str, ...]:
    """Replace, in place, every neuron of ``model`` that :func:`runs_fused` by a :class:`FusedNeuron`
    reporting to ``sink`` and saving what its :func:`fused_op` saves; returns their paths. Use on a private
    copy of the model."""
    paths = tuple(n for n, m in model.named_modules() if n and runs_fused(m, neuron_backend))
    for path in paths:
        parent, _, name = path.rpartition(".")
        op = fused_op(model.get_submodule(path), neuron_backend)
        setattr(model.get_submodule(parent) if parent else model, name, FusedNeuron(sink, op))
    return paths

