"""Named choices as ``str`` enums: each vocabulary one object that every layer asks (its members are
their names wherever a plan, a table, a JSON file or an error message holds them)."""
from __future__ import annotations

from enum import Enum
from typing import Tuple


class Vocabulary(str, Enum):
    """A ``str`` enum whose members print, format and repr as their names."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    __format__ = str.__format__

    @classmethod
    def names(cls) -> Tuple[str, ...]:
        return tuple(member.value for member in cls)

    @classmethod
    def check(cls, value, what: str, meaning: str = "") -> "Vocabulary":
        """``value`` (a member or its name, any case) as a member; ValueError naming ``what`` (which is
        ``meaning``) and the choices."""
        if isinstance(value, str) and value.lower() in cls.names():
            return cls(value.lower())
        meaning = f" ({meaning})" if meaning else ""
        raise ValueError(f"unsupported {what}={value!r}{meaning}; expected one of {cls.names()}")


class NeuronBackend(Vocabulary):
    """The neuron compute backend: spikingjelly's kernels, or torch.compile (not the communication backend)."""

    TORCH = "torch"
    CUPY = "cupy"
    TRITON = "triton"
    INDUCTOR = "inductor"

    @property
    def fused(self) -> bool:
        """A fused multi-step kernel: one launch per layer over all time steps (spikingjelly's cupy / triton)."""
        return self in (NeuronBackend.CUPY, NeuronBackend.TRITON)

    @property
    def compiled(self) -> bool:
        """The neurons run under torch.compile."""
        return self is NeuronBackend.INDUCTOR


class Checkpointing(Vocabulary):
    """Activation checkpointing granularity (see :mod:`.memory_levers`)."""

    NONE = "none"
    BLOCKS = "blocks"
    TIME_CHUNKS = "time_chunks"
    OPS = "ops"

    @property
    def recomputes(self) -> bool:
        return self is not Checkpointing.NONE
