"""Data layouts: where the batch (N) and the time steps (T) sit in a model's input and output.

One object every layer asks (:class:`DataLayout`): how to count a batch's samples and steps, cut a
share of samples or steps, run the model on it (whole sequences, or one step at a time for a model
that takes ``[N, ...]`` per call) and average its outputs over time. Analyses and plans carry it
(``data_layout``), JSON as its ``to_dict``.

- ``time_major``: input ``[T, N, ...]`` (spikingjelly multi-step models, most of this package's zoo);
- ``batch_major``: input ``[N, T, ...]`` (as a DataLoader stacks samples ``[T, ...]``; e.g.
  spikingjelly 2.0.0's ``CIFAR10DVSVGG``, which transposes to ``[T, N, ...]`` itself);
- ``per_step``: data ``[T, N, ...]``, the model called once per step on ``[N, ...]`` (a single-step
  model: spikingjelly ``step_mode='s'``, snntorch tutorials' ``net(x[step])``), its ``T`` outputs
  stacked ``[T, N, ...]``; neuron state carries from one call to the next.

The output's time dim is its own fact: ``CIFAR10DVSVGG`` takes ``[N, T, ...]`` and returns
``[T, N, C]``. A layout's ``output`` is ``time_major`` or ``batch_major`` (where T sits in a 3-D
output); :meth:`DataLayout.outputs_by_sample` checks each output against the batch's N and T, so a
wrong layout fails with a message instead of averaging over the samples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

from ..common.serialize import check_keys, check_kind
from .model_memo import remembered_for
from .neurons import detached_copy, state_tensors, stateful_modules

INPUTS = ("time_major", "batch_major", "per_step")
OUTPUTS = ("time_major", "batch_major")
_TEXT = {"time_major": "[T, N, ...]", "batch_major": "[N, T, ...]", "per_step": "[T, N, ...], [N, ...] per call"}


#: The element of a tuple output the tools take by default: snntorch's tutorials return ``(spikes, membranes)``.
SPIKES = 0


@dataclass(frozen=True)
class DataLayout:
    """Where N and T sit: ``input`` one of :data:`INPUTS`, ``output`` one of :data:`OUTPUTS`."""

    input: str = "time_major"
    output: str = "time_major"

    def __post_init__(self):
        if self.input not in INPUTS:
            raise ValueError(f"data layout input={self.input!r}; expected one of {INPUTS}")
        if self.output not in OUTPUTS or (self.input == "per_step" and self.output != "time_major"):
            raise ValueError(f"data layout output={self.output!r}; expected one of {OUTPUTS} ('time_major' for "
                             "per_step: its per-step outputs are stacked [T, N, ...])")

    @property
    def name(self) -> str:
        """``input`` alone when the output puts T where the data does, else ``input/output``."""
        same = self.output == ("batch_major" if self.input == "batch_major" else "time_major")
        return self.input if same else f"{self.input}/{self.output}"

    def __str__(self) -> str:
        output = "[T, N, C]" if self.output == "time_major" else "[N, T, C]"
        return f"{self.name} (input {_TEXT[self.input]}, output {output})"

    # ---- dims of the data
    @property
    def batch_dim(self) -> int:
        return 0 if self.input == "batch_major" else 1

    @property
    def time_dim(self) -> int:
        return 1 if self.input == "batch_major" else 0

    @property
    def per_step(self) -> bool:
        return self.input == "per_step"

    def samples(self, x: torch.Tensor) -> int:
        """N of batch ``x``."""
        self._check_rank(x)
        return x.shape[self.batch_dim]

    def steps(self, x: torch.Tensor) -> int:
        """T of batch ``x``."""
        self._check_rank(x)
        return x.shape[self.time_dim]

    def _check_rank(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"a batch in layout {self.name!r} {_TEXT[self.input]} has at least 2 dims, got shape "
                             f"{tuple(x.shape)}")

    def select(self, x: torch.Tensor, steps: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
        """``x`` at time indices ``steps`` and sample indices ``samples``, a fresh contiguous tensor."""
        return x.index_select(self.time_dim, steps).index_select(self.batch_dim, samples).contiguous()

    def share(self, x: torch.Tensor, start: int, length: int) -> torch.Tensor:
        """Samples ``start .. start + length`` of ``x`` (a data-parallel rank's or micro-batch's share)."""
        n = self.samples(x)
        if start < 0 or length < 1 or start + length > n:
            raise ValueError(f"samples {start}..{start + length} are not in a batch of {n} ({self.name}, shape "
                             f"{tuple(x.shape)})")
        return x.narrow(self.batch_dim, start, length)

    def chunks(self, x: torch.Tensor, count: int) -> Tuple[torch.Tensor, ...]:
        """``x`` split into ``count`` equal shares of samples (pipeline micro-batches)."""
        n = self.samples(x)
        if n % count:
            raise ValueError(f"a batch of {n} samples ({self.name}, shape {tuple(x.shape)}) does not split into "
                             f"{count} equal micro-batches")
        return tuple(x.chunk(count, dim=self.batch_dim))

    def to_time_major(self, x: torch.Tensor) -> torch.Tensor:
        """Batch ``x`` as ``[T, N, ...]``."""
        return x.transpose(0, 1) if self.input == "batch_major" else x

    def from_time_major(self, x: torch.Tensor) -> torch.Tensor:
        """A ``[T, N, ...]`` batch in this layout."""
        return x.transpose(0, 1).contiguous() if self.input == "batch_major" else x

    # ---- running the model
    def run(self, model: nn.Module, x: torch.Tensor, output: int = SPIKES):
        """The model's output on batch ``x``: one call, or (``per_step``) one call of a :class:`StepLoop`
        calling it once per step, stacked; of a tuple output, element ``output`` (:func:`model_output`)."""
        return StepLoop(model, output)(x) if self.per_step else model_output(model(x), output)

    def outputs_by_sample(self, outputs: torch.Tensor, n: int, t: Optional[int] = None,
                          reduce_time: Optional[str] = "mean") -> torch.Tensor:
        """Outputs as ``[N, C]`` (T averaged away, ``reduce_time="mean"``) or ``[T, N, C]``
        (``reduce_time=None``); ``[N, C]`` outputs pass. ValueError when the output's dims do not
        hold ``n`` samples (and ``t`` steps) where this layout says they are."""
        if outputs.dim() == 2:
            if outputs.shape[0] != n:
                raise ValueError(f"outputs {tuple(outputs.shape)} hold {outputs.shape[0]} samples where the batch has "
                                 f"{n} (data layout {self})")
            return outputs
        if outputs.dim() != 3:
            raise ValueError(f"classification outputs must be [T, N, C], [N, T, C] or [N, C], got shape "
                             f"{tuple(outputs.shape)}")
        time_dim = 0 if self.output == "time_major" else 1
        got_n, got_t = outputs.shape[1 - time_dim], outputs.shape[time_dim]
        if got_n != n or (t is not None and got_t != t):
            raise ValueError(f"outputs {tuple(outputs.shape)} do not hold N={n} samples"
                             + (f" and T={t} steps" if t is not None else "")
                             + f" where data layout {self} puts them; {_hint(outputs.shape, n, t)}")
        if time_dim == 1:
            outputs = outputs.transpose(0, 1)
        return outputs.mean(0) if reduce_time == "mean" else outputs

    def to_dict(self) -> dict:
        return {"kind": "data_layout", "input": self.input, "output": self.output}

    @classmethod
    def from_dict(cls, data) -> "DataLayout":
        data = check_kind(data, "data_layout")
        check_keys(data, "data_layout", ("input", "output"), ("input", "output"))
        return cls(**data)


def model_output(outputs, output: int = SPIKES, where: str = "") -> torch.Tensor:
    """The tensor a model's forward returns, or element ``output`` of a tuple or list of tensors (an snntorch
    tutorial's ``return torch.stack(spk_rec), torch.stack(mem_rec)``: the spikes by default; ``output=1``
    its membranes). TypeError for anything else, naming what came back and what is accepted."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    at = f" {where}" if where else ""
    if isinstance(outputs, (tuple, list)) and outputs and all(isinstance(o, torch.Tensor) for o in outputs):
        if isinstance(output, bool) or not isinstance(output, int) or not -len(outputs) <= output < len(outputs):
            raise ValueError(f"output={output!r} picks no element of the model's {len(outputs)} outputs{at}; "
                             f"expected an index in 0..{len(outputs) - 1} (0, the default: the spikes of a "
                             "(spikes, membranes) tuple)")
        return outputs[output]
    kinds = (f"a {type(outputs).__name__} of {', '.join(sorted({type(o).__name__ for o in outputs}))}"
             if isinstance(outputs, (tuple, list)) and outputs else f"a {type(outputs).__name__}")
    raise TypeError(f"the model returned {kinds}{at}; expected a tensor, or a tuple of tensors such as "
                    "(spikes, membranes), whose element `output` (default 0, the spikes) is used")


class StepLoop(nn.Module):
    """A per-step model run over ``[T, N, ...]`` as one module call: ``model`` called once per step
    ``x[t]`` (its neuron state carrying over), the outputs stacked ``[T, N, ...]``. Tools that watch
    top-level module calls (torch's ``MemTracker``) see one call per batch, the model's inside it."""

    def __init__(self, model: nn.Module, output: int = SPIKES):
        super().__init__()
        self.model, self.output = model, output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([model_output(self.model(step), self.output, "per step") for step in x.unbind(0)])


def _hint(shape, n: int, t: Optional[int]) -> str:
    if t is not None and tuple(shape[:2]) == (n, t):
        return "the output is [N, T, C]: give data_layout with output 'batch_major' (e.g. 'batch_major')"
    if t is not None and tuple(shape[:2]) == (t, n):
        return "the output is [T, N, C]: give data_layout with output 'time_major' (e.g. 'batch_major/time_major')"
    return ("check the data_layout ('time_major' [T, N, ...], 'batch_major' [N, T, ...], 'per_step'; "
            "'input/output' when the output puts T elsewhere)")


TIME_MAJOR = DataLayout("time_major", "time_major")
BATCH_MAJOR = DataLayout("batch_major", "batch_major")
PER_STEP = DataLayout("per_step", "time_major")
#: layouts by name (the names a plan stores)
LAYOUTS = {lay.name: lay for lay in (DataLayout(i, o) for i in INPUTS for o in OUTPUTS
                                     if not (i == "per_step" and o == "batch_major"))}


def layout_of(value) -> DataLayout:
    """The :class:`DataLayout` called ``value`` (a name of :data:`LAYOUTS`, its ``to_dict``, or a layout itself)."""
    if isinstance(value, DataLayout):
        return value
    if isinstance(value, dict):
        return DataLayout.from_dict(value)
    layout = LAYOUTS.get(value) if isinstance(value, str) else None
    if layout is None:
        raise ValueError(f"data_layout={value!r} is not a data layout; expected one of {tuple(LAYOUTS)}")
    return layout


def _known(labels, time_steps) -> Tuple[Optional[int], Optional[int]]:
    n = None
    if isinstance(labels, torch.Tensor) and labels.dim() >= 1:
        n = labels.shape[0]
    return n, time_steps


def input_layout_of(x: torch.Tensor, labels=None, time_steps: Optional[int] = None) -> Tuple[Optional[str], str]:
    """``(input layout, how)`` read from the batch's shape: N is the labels' length, T ``time_steps``;
    (None, why) when they cannot tell dim 0 from dim 1."""
    n, t = _known(labels, time_steps)
    d0, d1 = x.shape[0], x.shape[1]
    if n is not None and d0 != d1 and n in (d0, d1):
        return ("batch_major" if d0 == n else "time_major"), f"the labels' N={n} is dim {0 if d0 == n else 1}"
    if t is not None and d0 != d1 and t in (d0, d1):
        return ("time_major" if d0 == t else "batch_major"), f"time_steps={t} is dim {0 if d0 == t else 1}"
    if d0 == d1:
        return None, f"dims 0 and 1 are both {d0}, so N and T cannot be told apart by size"
    return None, ("neither labels (N) nor time_steps (T) match dim 0 or 1" if n or t else
                  "no labels (N) or time_steps (T) were given to tell N from T")


@torch.no_grad()
def _dry_run(model: nn.Module, x: torch.Tensor, part: torch.Tensor, layout: "DataLayout", reset, look):
    """``look(output)`` of one run of ``model`` on ``part`` of batch ``x`` (eval mode, no grad, the
    model's dtype), before its modes and neuron state (``reset``) are restored; ValueError when it
    does not run."""
    first = next((p for p in model.parameters() if p.is_floating_point()), None)
    if first is not None and part.is_floating_point():  # the model's dtype, as the estimator runs it
        part = part.to(first.dtype)
    if first is not None and first.device.type == "meta":  # a model built on meta runs on shapes alone
        part = part.to("meta")
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        reset(model)
        return look(layout.run(model, part))
    except IndexError as exc:  # x[step] past the part's steps: a loop over a fixed num_steps, if x itself runs
        t = 1 if layout.input == "batch_major" else 0
        whole = x.to(part.device, part.dtype) if x.is_floating_point() else x.to(part.device)
        if part.shape[t] == x.shape[t] or not _runs(model, whole, layout, reset):
            raise
        raise fixed_loop_error(x.shape[t], part.shape[t], exc) from exc
    except RuntimeError as exc:
        raise ValueError(f"the model does not run on example_input of shape {tuple(x.shape)} ({x.dtype}; its part "
                         f"{tuple(part.shape)} read as {_TEXT[layout.input]} was tried): {exc}; give a batch the "
                         f"model's forward accepts, in the data layout it takes ({tuple(LAYOUTS)})") from exc
    finally:
        reset(model)
        for m, training in modes.items():
            m.train(training)


def output_layout_of(model: nn.Module, x: torch.Tensor, input_layout: str, reset) -> Tuple[str, str]:
    """``(output layout, how)``: the model run (eval mode, state restored by ``reset``) on one sample
    of ``x`` (two when T is 1), its output's dims matched to that slice's N and T."""
    layout = DataLayout(input_layout, "time_major")
    t = layout.steps(x)
    n = min(layout.samples(x), 1 if t != 1 else 2)
    part = layout.select(x, torch.arange(t), torch.arange(n))
    out = _dry_run(model, x, part, layout, reset, lambda output: output)
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or t == n:
        return "time_major", f"the output {tuple(getattr(out, 'shape', ()))} has no separate time dim to place"
    if tuple(out.shape[:2]) == (t, n):
        return "time_major", f"the output of {n} sample(s) x {t} steps is {tuple(out.shape)}"
    if tuple(out.shape[:2]) == (n, t):
        return "batch_major", f"the output of {n} sample(s) x {t} steps is {tuple(out.shape)}"
    raise ValueError(f"the model's output {tuple(out.shape)} on {n} sample(s) x {t} steps ({layout.name} input "
                     f"{tuple(part.shape)}) holds neither [T, N, C] nor [N, T, C]; check data_layout "
                     f"({tuple(LAYOUTS)})")


def _state_tensors(model: nn.Module) -> list:
    """The neuron state tensors of ``model``: snntorch's non-persistent buffers, spikingjelly's memories."""
    return [t for _, module in stateful_modules(model) for t in state_tensors(module)]


def _input_by_state(model: nn.Module, x: torch.Tensor, reset, why: str) -> Tuple[Optional[str], str]:
    """Where N sits when the shapes cannot tell: the model run on ``x[:2, :1]``, its neurons' state
    has N = 2 leading (dim 0 is N: batch-major) or N = 1 (dim 1: time-major; a state ``[2, 1, ...]``
    is all steps taken as one, also time-major). (None, why) without neuron state to read."""
    if x.shape[0] < 2 or x.shape[1] < 1:
        return None, why
    part = x[:2, :1]

    def lead(_output):
        states = [t for t in _state_tensors(model) if t.dim() >= 2]
        if any(t.shape[0] == 1 or (t.dim() >= 3 and tuple(t.shape[:2]) == (2, 1)) for t in states):
            return "time_major"
        return "batch_major" if states and all(t.shape[0] == 2 for t in states) else None
    found = _dry_run(model, x, part, TIME_MAJOR, reset, lead)
    if found is None:
        return None, why
    return found, (f"{why}; run on x[:2, :1], the neurons' state holds {'2' if found == 'batch_major' else '1'} "
                   f"sample(s) first, so N is dim {0 if found == 'batch_major' else 1}")


def _steps_taken_as_one(model: nn.Module, x: torch.Tensor, reset) -> bool:
    """Whether the model takes a whole time-major batch as one step (a single-step model, called per
    step): run on one sample of ``x`` (T >= 2), a neuron's state holds all ``[T, 1, ...]`` of it (a
    model that loops over T itself, or spikingjelly multi-step neurons, leave ``[1, ...]``)."""
    t = x.shape[0]
    if t < 2 or any(getattr(m, "step_mode", None) == "m" for m in model.modules()):
        return False

    def whole(_output) -> bool:
        return any(s.dim() >= 3 and tuple(s.shape[:2]) == (t, 1) for s in _state_tensors(model))
    return _dry_run(model, x, x[:, :1], TIME_MAJOR, reset, whole)


def check_samples(layout: DataLayout, x: torch.Tensor, labels=None, what: str = "inputs") -> int:
    """N of batch ``x`` in ``layout``; ValueError when labels ``[N, ...]`` hold another N (naming the
    layout the batch looks like when its other leading dim holds the labels' N)."""
    n = layout.samples(x)
    if not isinstance(labels, torch.Tensor) or labels.dim() == 0 or labels.shape[0] == n:
        return n
    other = x.shape[layout.time_dim]
    hint = ""
    if other == labels.shape[0]:
        looks = "batch_major [N, T, ...]" if layout.time_dim == 0 else "time_major [T, N, ...]"
        hint = f"; dim {layout.time_dim} holds {other} samples, so the batch looks {looks}: state data_layout"
    raise ValueError(f"{what} {tuple(x.shape)} in data layout {layout} hold N={n} samples (dim "
                     f"{layout.batch_dim}), but the labels {tuple(labels.shape)} hold {labels.shape[0]}{hint} "
                     f"(one of {tuple(LAYOUTS)})")


def detect_layout(model: nn.Module, x: torch.Tensor, reset, labels=None, time_steps: Optional[int] = None,
                  data_layout=None, assume: Optional[str] = None) -> Tuple[DataLayout, str]:
    """``(layout, how it was found)`` for batch ``x``: a given ``data_layout`` checked against the
    labels; else the input's dims told apart by the labels' N or ``time_steps`` (else the neurons'
    state), the output's by one run of a copy of the model. When the input's cannot be told:
    ``assume`` (an input layout, said so in ``how``), or ValueError (name a data_layout). The detection is kept
    per model object while its structure stays the same (:func:`~.model_memo.remembered_for`)."""
    if data_layout is not None:
        layout = layout_of(data_layout)
        check_samples(layout, x, labels, "example_input")
        return layout, f"{layout.name}: given"
    question = ("layout", tuple(x.shape), x.dtype, x.device.type, _known(labels, time_steps), assume, reset)
    return remembered_for(model, question, lambda: _detected(model, x, reset, labels, time_steps, assume))


def _detected(model: nn.Module, x: torch.Tensor, reset, labels, time_steps, assume) -> Tuple[DataLayout, str]:
    """:func:`detect_layout` without a given ``data_layout``: the runs (on a copy) that find it."""
    found, how = input_layout_of(x, labels, time_steps)
    model = detached_copy(model)  # the dry runs below leave the user's model, its neuron state included, untouched
    if found is None:
        found, how = _input_by_state(model, x, reset, how)
    if found is None and assume is None:
        raise ValueError(f"cannot tell the data layout of example_input {tuple(x.shape)}: {how}; pass "
                         f"data_layout= one of {tuple(LAYOUTS)}, labels, or time_steps")
    verb = "detected" if found is not None else "assumed"
    if found is None:
        found, how = assume, f"{how}; state data_layout to be sure"
    if found == "time_major" and _steps_taken_as_one(model, x, reset):
        found, how = "per_step", how + ("; its neurons' state held all T steps of one sample after one call, so "
                                        "it is a single-step model, called per step")
    output, out_how = output_layout_of(model, x, found, reset)
    layout = DataLayout(found, output)
    return layout, f"{layout.name}: {verb} ({how}; {out_how})"


def _runs(model: nn.Module, x: torch.Tensor, layout: "DataLayout", reset) -> bool:
    """Whether ``model`` runs on the whole batch ``x`` (its neuron state reset before and after)."""
    try:
        reset(model)
        layout.run(model, x)
        return True
    except Exception:  # noqa: BLE001 - any failure means the model's own error, not a fixed loop
        return False
    finally:
        reset(model)


def fixed_loop_error(example_steps: int, t: int, exc: BaseException) -> ValueError:
    """The one-line refusal of a model whose forward loops a fixed number of time steps (an snntorch
    tutorial's ``for step in range(num_steps)``): it runs at the ``example_steps`` it was written for, but
    indexes past a batch of ``t`` steps, and the estimator fits memory and time from runs at a few ``T``."""
    return ValueError(
        f"the model fails on {t} time steps ({type(exc).__name__}: {exc}) though it runs on the example's "
        f"{example_steps}: its forward loops a fixed number of steps (for step in range(num_steps)); loop over "
        "the input's steps instead: for step in range(x.shape[0])")
