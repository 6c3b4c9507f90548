"""Training precision of a plan: one object that every layer asks (apply, runtime, estimate, UI).

- ``fp32``: the model's own dtype, no autocast (the default, and the seed's behaviour);
- ``bf16``: the forward under ``torch.autocast(dtype=bfloat16)``; master weights, gradients and
  optimizer state stay fp32; gradients are reduced in bf16 (its exponent range is fp32's, so a sum
  of gradients cannot overflow); FSDP2 gathers bf16 parameters (``MixedPrecisionPolicy``);
- ``fp16``: the forward under ``torch.autocast(dtype=float16)`` and a dynamic loss scaler
  (fp16's smallest normal number is 6.1e-5, so small gradients vanish unscaled); gradients are
  reduced in fp32 (fp16 overflows at 65504, and scaled gradients summed over ranks can reach it).

``keep_neuron_state_fp32`` (default True) runs the stateful neurons in fp32 while the layers
compute in half precision: a membrane that adds small inputs over T time steps in bf16 (8
significant bits) loses them once it is large, so spikes that fire in fp32 stop firing.
``reduce_in_fp32`` reduces bf16 gradients in fp32 (twice the bytes, fp32's rounding).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple, Union

import torch

from .serialize import check_keys, check_kind, dataclass_dict

#: name -> (autocast dtype or None, loss scaler needed, default reduce dtype)
_TABLE = {
    "fp32": (None, False, torch.float32),
    "bf16": (torch.bfloat16, False, torch.bfloat16),
    "fp16": (torch.float16, True, torch.float32),
}
PRECISIONS: Tuple[str, ...] = tuple(_TABLE)
#: Names people use for these dtypes, mapped to the vocabulary's.
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
#: Requests this package does not train in, and why.
_REFUSED = {"fp8": "fp8 training needs scaled matmuls (torchao / Transformer Engine) that torch.autocast "
                   "does not provide",
            "float8": "fp8 training needs scaled matmuls (torchao / Transformer Engine) that torch.autocast "
                      "does not provide",
            "fp64": "float64 is the model's own dtype: keep precision='fp32' (no autocast) and call model.double()"}


@dataclass(frozen=True)
class Precision:
    """A training precision (see the module doc); build it with :func:`precision_of`."""

    name: str = "fp32"
    keep_neuron_state_fp32: bool = True
    reduce_in_fp32: bool = False

    def __post_init__(self):
        if self.name not in _TABLE:
            raise ValueError(_unknown(self.name))
        for flag in ("keep_neuron_state_fp32", "reduce_in_fp32"):
            if type(getattr(self, flag)) is not bool:
                raise TypeError(f"Precision.{flag} must be a bool, got {getattr(self, flag)!r}")

    # ---- what it means -----------------------------------------------------------------------
    @property
    def mixed(self) -> bool:
        """Whether layers compute in half precision (bf16 / fp16) under autocast."""
        return self.compute_dtype is not None

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """The autocast dtype of the forward's matmuls and convolutions (None: the model's own)."""
        return _TABLE[self.name][0]

    @property
    def needs_loss_scaler(self) -> bool:
        return _TABLE[self.name][1]

    @property
    def master_dtype(self) -> torch.dtype:
        """Parameters, gradients and optimizer state: always fp32 (mixed precision keeps fp32 masters)."""
        return torch.float32

    @property
    def param_dtype(self) -> Optional[torch.dtype]:
        """FSDP2's ``MixedPrecisionPolicy.param_dtype``: the dtype it all-gathers and computes in."""
        return self.compute_dtype

    @property
    def reduce_dtype(self) -> Optional[torch.dtype]:
        """The dtype gradients are reduced in over dp (None: the gradients' own, fp32 plans)."""
        if not self.mixed:
            return None
        return torch.float32 if self.reduce_in_fp32 else _TABLE[self.name][2]

    def neuron_state_dtype(self, model_dtype: torch.dtype = torch.float32) -> torch.dtype:
        """The dtype stateful neurons compute and keep their state in."""
        if not self.mixed or self.keep_neuron_state_fp32:
            return model_dtype if not self.mixed else torch.float32
        return self.compute_dtype

    def itemsize(self, what: str, model_dtype: torch.dtype = torch.float32) -> int:
        """Bytes per element of ``what``: 'compute', 'param' (FSDP2's gathered ones), 'reduce', 'state'."""
        dtypes = {"compute": self.compute_dtype, "param": self.param_dtype, "reduce": self.reduce_dtype,
                  "state": self.neuron_state_dtype(model_dtype)}
        if what not in dtypes:
            raise ValueError(f"itemsize({what!r}); expected one of {tuple(dtypes)}")
        return torch.empty((), dtype=dtypes[what] or model_dtype).element_size()

    def autocast(self, device_type: str):
        """The context the forward runs in: ``torch.autocast`` for half precision, else nothing."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.compute_dtype)

    def check_device(self, device_type: str) -> None:
        """Refuse a precision ``device_type`` cannot run, naming why."""
        if not self.mixed:
            return
        if not torch.amp.is_autocast_available(device_type):
            raise ValueError(f"precision={self.name!r} needs torch.autocast on {device_type!r}, which this torch "
                             f"({torch.__version__}) does not offer; use precision='fp32'")
        if device_type == "cuda" and self.name == "bf16" and not torch.cuda.is_bf16_supported():
            raise ValueError("precision='bf16' needs a GPU with bfloat16 support (Ampere or newer); this one has "
                             "none: use precision='fp16' (with its loss scaler) or 'fp32'")

    @property
    def label(self) -> str:
        """Short label for tables: ``bf16``, ``bf16/state-bf16``, ``bf16/reduce-fp32``."""
        parts = [self.name]
        if self.mixed and not self.keep_neuron_state_fp32:
            parts.append(f"state-{self.name}")
        if self.mixed and self.reduce_in_fp32:
            parts.append("reduce-fp32")
        return "/".join(parts)

    def describe(self) -> str:
        """One sentence for plan notes: what trains in which dtype."""
        if not self.mixed:
            return "precision fp32: parameters, activations, neuron state and gradients in the model's dtype."
        state = "fp32" if self.keep_neuron_state_fp32 else self.name
        reduce = "fp32" if self.reduce_dtype == torch.float32 else self.name
        scaler = ", with a dynamic loss scaler (fp16's range is narrow)" if self.needs_loss_scaler else ""
        return (f"precision {self.name}: layers compute in {self.name} under autocast{scaler}; fp32 master "
                f"weights and optimizer state; neuron state in {state}; gradients reduced in {reduce}.")

    # ---- plain data ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclass_dict(self, "precision")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Precision":
        data = check_kind(data, "precision")
        check_keys(data, "precision", ("name",), ("name", "keep_neuron_state_fp32", "reduce_in_fp32"))
        return cls(**data)


FP32 = Precision("fp32")


def _unknown(name: Any) -> str:
    key = name.lower() if isinstance(name, str) else name
    if key in _REFUSED:
        return f"precision={name!r} is not supported: {_REFUSED[key]}; accepted: {PRECISIONS}"
    return f"precision={name!r}; expected one of {PRECISIONS} (or a Precision)"


def precision_of(value: Union[str, Precision, None], keep_neuron_state_fp32: Optional[bool] = None,
                 reduce_in_fp32: Optional[bool] = None) -> Precision:
    """``value`` (a name of :data:`PRECISIONS`, an alias such as ``"bfloat16"``, a :class:`Precision`,
    or None for fp32) as a :class:`Precision`; the flags override the object's when given."""
    if isinstance(value, Precision):
        found = value
    elif value is None:
        found = FP32
    elif isinstance(value, str):
        name = _ALIASES.get(value.lower(), value.lower())
        if name not in _TABLE:
            raise ValueError(_unknown(value))
        found = Precision(name)
    else:
        raise ValueError(_unknown(value))
    changes = {k: v for k, v in (("keep_neuron_state_fp32", keep_neuron_state_fp32),
                                 ("reduce_in_fp32", reduce_in_fp32)) if v is not None}
    return dataclasses.replace(found, **changes) if changes else found


def fsdp_norm_problem(precision: Precision, fsdp: bool, batchnorm_names) -> Optional[str]:
    """Why FSDP2 cannot train ``precision`` on a model with these BatchNorm layers (None when it can).

    FSDP2 gathers every unit's parameters in the compute dtype, which a BatchNorm cannot compute with
    beside its fp32 running statistics; ``apply`` makes each norm layer a unit of its own gathered in
    fp32 (``core.parallelize.fsdp``). The root unit cannot be that: a model that is itself a BatchNorm."""
    if not (precision.mixed and fsdp) or "" not in tuple(batchnorm_names):
        return None
    return (f"precision={precision.name!r} with FSDP2 gathers the root module's parameters in {precision.name}, and "
            "this model is itself a BatchNorm layer, whose fp32 running statistics torch's batch_norm refuses beside "
            "half-precision weights; wrap it in a module of its own, use mode 'dp', or precision='fp32'")


def fsdp_norm_note(precision: Precision, fsdp: bool, batchnorm_names) -> str:
    """What a half-precision FSDP2 plan does with the model's BatchNorm layers ('' when nothing)."""
    if not (precision.mixed and fsdp and tuple(batchnorm_names)):
        return ""
    return ("Under FSDP2 each BatchNorm with parameters (and any norm layer with running statistics) is an FSDP2 "
            f"unit of its own that gathers its weights in fp32, beside its fp32 running statistics, and computes "
            f"on the {precision.name} input as autocast does; each adds one all-gather and one reduce-scatter per "
            "step.")


def choose_precision(requested: Union[str, Precision, None], objective: str, features: Any,
                     fsdp: bool = False, batchnorm_names=()) -> Tuple[Precision, str]:
    """The plan's precision and a note that explains it. ``requested=None`` lets the objective choose:
    with ``features.allow_mixed_precision`` every objective takes bf16 (activations and neuron
    inputs, the terms that grow with T, halve; GPUs run it on tensor cores; its fp32 exponent range
    needs no loss scaler) with neuron state kept in fp32, unless FSDP2 cannot run it on the model
    (:func:`fsdp_norm_problem`); with the gate closed, fp32."""
    gate = bool(getattr(features, "allow_mixed_precision", False))
    if requested is not None:
        chosen = precision_of(requested)
        if chosen.mixed and not gate:
            raise ValueError(f"precision={chosen.name!r} needs DistributedFeatureSet(allow_mixed_precision=True); "
                             "without it plans train in 'fp32'")
        problem = fsdp_norm_problem(chosen, fsdp, batchnorm_names)
        if problem:
            raise ValueError(problem)
        return chosen, _joined(f"{chosen.describe()} (chosen explicitly)", fsdp_norm_note(chosen, fsdp, batchnorm_names))
    if not gate:
        return FP32, ""
    problem = fsdp_norm_problem(Precision("bf16"), fsdp, batchnorm_names)
    if problem:
        return FP32, f"precision fp32: {problem}."
    chosen = Precision("bf16")
    return chosen, _joined(f"{chosen.describe()} Chosen for objective {objective!r}: bf16 halves activation and "
                           "all-gather bytes and runs on tensor cores, without fp16's loss scaler; precision='fp32' "
                           "or 'fp16' to override.", fsdp_norm_note(chosen, fsdp, batchnorm_names))


def _joined(*sentences: str) -> str:
    return " ".join(s for s in sentences if s)
