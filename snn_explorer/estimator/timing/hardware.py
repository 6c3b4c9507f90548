"""HardwareProfile: what one rank's device computes and how fast its collectives run.

Every time estimate asks one profile: the achievable FLOP/s and memory bandwidth of a rank's
device (a roofline), the fixed cost of one operator (dispatch / kernel launch), and per
collective kind an alpha-beta model ``time = alpha + beta * bytes`` per group size, where
``bytes`` is the full buffer the collective works on (all-reduce / broadcast: the tensor,
all-gather: the output, reduce-scatter: the input; :mod:`.comms` counts them so).

A group size the profile does not list is scaled from the nearest listed one by the ring
formulas NCCL documents (``nccl-tests`` "performance"): an all-reduce moves
``2 (p - 1) / p`` of its buffer over each link in ``2 (p - 1)`` steps, an all-gather or
reduce-scatter ``(p - 1) / p`` in ``p - 1`` steps, a broadcast (pipelined ring) and a
send/recv the whole buffer (an all-reduce's latency is the tree's when that is shorter). A group that spans nodes (more ranks than ``ranks_per_node``)
uses the ``inter_node`` table.

A GPU profile (``device="cuda"``) is datasheet peaks, the fractions of them that documented
measurements reach (:attr:`HardwareProfile.achieved`), and the topology (GPUs per node, peer-to-peer,
NVLink, NICs); it predicts with the traced GPU kernel model (:mod:`..memory.gpu_trace`,
:mod:`.gpu_kernels`). The built-in ones (:mod:`.gpu_specs`) give every figure's source.
``efficiency`` (1 on every built-in) is a user's own scale on every rate of a profile file.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, Mapping, Optional, Tuple

from ...core.common import PRECISIONS, TIMED, Checkpointing, Collective, Precision, positive_int, positive_number
from .gpu_specs import (
    DEFAULT_EFFICIENCY,
    DEVICES,
    GPU_OP_OVERHEAD_S,
    HOST_ADAM_PARAMS_PER_S,
    IB,
    INTER_LATENCY_S,
    INTRA_LATENCY_S,
    NODES,
    RTX4090_NO_P2P_LINK_BPS,
    RTX4090_NO_P2P_LINK_S,
    RTX4090_OP_S,
)

#: The collective kinds a profile times.
KINDS = TIMED
#: The fractions a profile's ``achieved`` may state (see the field).
ACHIEVED_KEYS = ("bandwidth", "matmul")
#: The precisions a calibration can measure half-precision rates of.
HALF_PRECISIONS = tuple(name for name in PRECISIONS if name != "fp32")


def ring_steps(kind: str, p: int) -> int:
    """Latency-bound steps of one collective on ``p`` ranks: the ring's, but for an all-reduce the
    fewer of the ring's ``2 (p - 1)`` and the tree's ``2 ceil(log2 p)`` (NCCL picks the tree at scale)."""
    tree = 2 * math.ceil(math.log2(p)) if p > 1 else 0
    return Collective(kind).ring_steps(p, tree)


def ring_fraction(kind: str, p: int) -> float:
    """Fraction of the buffer each rank sends over its link (NCCL's algorithm-to-bus bandwidth factor; the ring's
    case of :func:`.wire_bytes.wire_factor`)."""
    return Collective(kind).ring_fraction(p)


def _check_table(name: str, table: Mapping) -> Dict[str, Dict[int, Tuple[float, float]]]:
    out = {}
    for kind, sizes in table.items():
        if kind not in KINDS:
            raise ValueError(f"{name}: unknown collective kind {kind!r}; expected one of {KINDS}")
        out[kind] = {}
        for p, ab in sizes.items():
            p = positive_int(f"{name}[{kind!r}] group size", int(p))
            alpha, beta = (float(v) for v in ab)
            if p < 2 or alpha < 0 or beta <= 0:
                raise ValueError(f"{name}[{kind!r}][{p}] = ({alpha}, {beta}); expected a group size >= 2, "
                                 "alpha >= 0 s and beta > 0 s/byte")
            out[kind][p] = (alpha, beta)
    return out


@dataclass(frozen=True)
class HardwareProfile:
    """One rank's device and its collectives (see the module doc). Save with :meth:`save`, load
    with :meth:`load`; :func:`hardware_profile` gives a built-in one by name."""

    name: str
    device: str
    flops_per_s: float  # achievable dense FLOP/s at 4-byte floats
    bytes_per_s: float  # achievable memory bandwidth
    op_overhead_s: float  # fixed cost of one operator (dispatch, kernel launch)
    collectives: Mapping[str, Mapping[int, Tuple[float, float]]]  # kind -> group size -> (alpha s, beta s/byte)
    inter_node: Mapping[str, Mapping[int, Tuple[float, float]]] = field(default_factory=dict)
    ranks_per_node: Optional[int] = None  # None: every rank on one node
    half_flops_per_s: Optional[float] = None  # FLOP/s at 2-byte floats (None: flops_per_s)
    compute_sharing: Mapping[int, float] = field(default_factory=dict)  # ranks on a host -> compute slow-down
    # group size -> {"tp_module": s per call of a TP-sharded module, "fsdp_collective": s per FSDP2 collective}
    framework_overhead: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    efficiency: float = 1.0
    source: str = "datasheet"
    host: Optional[str] = None  # the host a calibration ran on
    #: TF32 tensor-core FLOP/s, the rate of cuDNN convolutions (torch's default
    #: ``torch.backends.cudnn.allow_tf32 = True``); None: ``flops_per_s``
    tensor_flops_per_s: Optional[float] = None
    #: True: memory and time come from the GPU execution model (:mod:`..memory.gpu_trace`,
    #: :mod:`.gpu_kernels`): the step traced as the GPU runs it, fused neuron kernels included.
    #: Every profile of a ``cuda`` device has it (set in ``__post_init__``); CPU profiles (this machine) do not
    kernel_model: bool = False
    #: Fractions of the datasheet peaks that documented measurements reach: ``"bandwidth"`` (a STREAM-like
    #: copy kernel over ``bytes_per_s``), ``"matmul"`` (cuBLAS's best large GEMM over the tensor-core peak,
    #: applied to every FLOP rate of the profile). Missing keys: 1 (the figure is an achieved rate already)
    achieved: Mapping[str, float] = field(default_factory=dict)
    #: Streaming multiprocessors: GEMMs and convolutions are timed with the tile and wave quantisation of
    #: their output over them (:mod:`.gpu_kernels`); None: not quantised
    sm_count: Optional[int] = None
    # The interconnect as configured (what the collective tables above were derived from): GPUs
    # peer-to-peer or through host memory, NVLink or PCIe, NICs per node (None: not stated), in words too
    peer_to_peer: Optional[bool] = None
    nvlink: Optional[bool] = None
    nics_per_node: Optional[int] = None
    topology: str = ""
    #: A calibration's own half-precision rates, per precision name (``"bf16"``, ``"fp16"``):
    #: ``{"flops_per_s": matmul FLOP/s, "bytes_per_s": elementwise bytes/s}`` measured on tensors of
    #: that dtype (:func:`~..calibration.probes.half_probes`); :meth:`in_precision` uses them
    measured_half: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    #: Bytes/s one way between the device and host memory (PCIe), for copies to and from the host
    #: (activation offload); None: not stated (a CPU device has no host link: its memory is the host's)
    host_link_bytes_per_s: Optional[float] = None
    #: Adam parameter updates per second the host CPU makes for one rank (the optimizer step of FSDP2's CPU
    #: offload runs there, one core per rank); None: not stated (a CPU offload estimate then refuses)
    host_adam_params_per_s: Optional[float] = None
    #: Seconds one checkpointed call adds beyond the operators the estimate counts for it, per granularity
    #: (``"blocks"``: per call of a checkpointed block; ``"time_chunks"``: per checkpointed time step): torch's
    #: checkpoint frame, the neuron-state copies and RNG state around it, Python work on the host CPU. Measured by a
    #: CPU calibration (:mod:`..calibration.checkpoint_call`); empty: not measured (0, the datasheet GPU profiles)
    checkpoint_overhead: Mapping[str, float] = field(default_factory=dict)
    #: Seconds one checkpointed call adds per operator its region runs in a forward, beyond
    #: ``checkpoint_overhead``, per granularity (``"time_chunks"``: per operator of the time-step module's call):
    #: torch's saved-tensor hooks (a pack per saved tensor in the forward, an unpack and a recompute pack in the
    #: backward), work that grows with what the region holds. Measured by a CPU calibration
    #: (:mod:`..calibration.checkpoint_call`); empty: not measured (0, the datasheet GPU profiles)
    checkpoint_overhead_per_op: Mapping[str, float] = field(default_factory=dict)
    #: Seconds of the reference probe step (:func:`~.checkpoint_probe.reference_step_s`) in the run that measured the
    #: two figures above: on the calibrated host the estimate scales them by that step timed when it estimates
    #: (the host's speed of the moment); None: not measured (no scaling)
    checkpoint_reference_s: Optional[float] = None

    def _check_checkpoint_overhead(self) -> None:
        """``checkpoint_overhead`` (per call) and ``checkpoint_overhead_per_op`` (per operator of a call): seconds
        >= 0 for the granularities that recompute, by their names."""
        per_call = {Checkpointing.BLOCKS.value, Checkpointing.TIME_CHUNKS.value}
        per_op = {Checkpointing.TIME_CHUNKS.value}  # the estimate counts a region's operators for time chunks only
        for attr, unit, keys in (("checkpoint_overhead", "call", per_call),
                                 ("checkpoint_overhead_per_op", "operator of a call", per_op)):
            for key, value in getattr(self, attr).items():
                if key not in keys or isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                    raise ValueError(f"{attr}[{key!r}] = {value!r}; expected seconds >= 0 per {unit} for a "
                                     f"granularity of {sorted(keys)}")
            object.__setattr__(self, attr, {k: float(v) for k, v in getattr(self, attr).items()})

    def __post_init__(self):
        for attr in ("flops_per_s", "bytes_per_s"):
            positive_number(attr, getattr(self, attr), what="per second")
        positive_number("host_link_bytes_per_s", self.host_link_bytes_per_s, allow_none=True, what="bytes per second")
        positive_number("host_adam_params_per_s", self.host_adam_params_per_s, allow_none=True,
                        what="parameters per second")
        self._check_checkpoint_overhead()
        positive_number("checkpoint_reference_s", self.checkpoint_reference_s, allow_none=True, what="seconds")
        if self.op_overhead_s < 0:
            raise ValueError(f"op_overhead_s={self.op_overhead_s}; expected seconds >= 0")
        if self.device == "cuda" and not self.kernel_model:  # one model for every GPU
            object.__setattr__(self, "kernel_model", True)
        for key, value in self.achieved.items():
            if key not in ACHIEVED_KEYS or isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value <= 1.2:
                raise ValueError(f"achieved[{key!r}] = {value!r}; expected a fraction in (0, 1.2] of the datasheet "
                                 f"peak for a key of {ACHIEVED_KEYS}")
        object.__setattr__(self, "achieved", {str(k): float(v) for k, v in self.achieved.items()})
        if self.sm_count is not None:
            positive_int("sm_count", self.sm_count, what="streaming multiprocessors")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency={self.efficiency}; expected a fraction in (0, 1]")
        object.__setattr__(self, "collectives", _check_table("collectives", self.collectives))
        object.__setattr__(self, "inter_node", _check_table("inter_node", self.inter_node))
        missing = [k for k in KINDS if k not in self.collectives]
        if missing:
            raise ValueError(f"hardware profile {self.name!r} has no timings for {missing}; give every kind of {KINDS}")
        if self.ranks_per_node is not None:
            positive_int("ranks_per_node", self.ranks_per_node)
            if not self.inter_node:
                raise ValueError("ranks_per_node is set but inter_node is empty; give the timings between nodes")
        for name, rates in self.measured_half.items():
            if name not in HALF_PRECISIONS or set(rates) != {"flops_per_s", "bytes_per_s"}:
                raise ValueError(f"measured_half[{name!r}] = {rates!r}; expected a precision of {HALF_PRECISIONS} "
                                 "mapped to its flops_per_s and bytes_per_s")
            for key, value in rates.items():
                positive_number(f"measured_half[{name!r}][{key!r}]", value, what="per second")
        object.__setattr__(self, "measured_half", {str(n): {str(k): float(v) for k, v in r.items()}
                                                   for n, r in self.measured_half.items()})
        object.__setattr__(self, "compute_sharing", {int(k): float(v) for k, v in self.compute_sharing.items()})
        object.__setattr__(self, "framework_overhead", {int(p): {str(k): float(v) for k, v in o.items()}
                                                        for p, o in self.framework_overhead.items()})

    def flops(self, itemsize: int = 4) -> float:
        """Achievable FLOP/s for floats of ``itemsize`` bytes, after ``efficiency``."""
        peak = self.half_flops_per_s if itemsize <= 2 and self.half_flops_per_s else self.flops_per_s
        return peak * self.efficiency * self.achieved.get("matmul", 1.0)

    def in_precision(self, precision: Precision) -> "HardwareProfile":
        """This profile as a plan of ``precision`` sees it: where the calibration measured that
        precision (:attr:`measured_half`), its matmul rate is the 2-byte rate; and where the neurons
        also compute in it (``keep_neuron_state_fp32=False``: the elementwise bulk of an SNN's step
        then runs on 2-byte tensors), its elementwise rate is the bandwidth. Otherwise unchanged
        (fp32 plans; datasheet profiles, whose ``half_flops_per_s`` already holds the half rate)."""
        rates = self.measured_half.get(precision.name) if precision.mixed else None
        if not rates:
            return self
        half_state = precision.neuron_state_dtype() == precision.compute_dtype
        return replace(self, half_flops_per_s=rates["flops_per_s"],
                       bytes_per_s=rates["bytes_per_s"] if half_state else self.bytes_per_s)

    def bandwidth(self) -> float:
        """Achievable memory bandwidth: the datasheet's times its measured fraction, after ``efficiency``."""
        return self.bytes_per_s * self.efficiency * self.achieved.get("bandwidth", 1.0)

    def conv_flops(self, itemsize: int = 4) -> float:
        """Achievable FLOP/s of a cuDNN convolution: TF32 tensor cores for 4-byte floats where the
        profile gives them (torch's default), the half rate for 2-byte floats, after ``efficiency``."""
        if itemsize > 2 and self.tensor_flops_per_s:
            return self.tensor_flops_per_s * self.efficiency * self.achieved.get("matmul", 1.0)
        return self.flops(itemsize)

    def sharing(self, ranks_on_host: float) -> float:
        """Compute slow-down when ``ranks_on_host`` ranks (an average: need not be whole) share one
        host's cores (1 when unmeasured)."""
        known = sorted(self.compute_sharing)
        if not known or ranks_on_host <= 1:
            return 1.0
        below = [k for k in known if k <= ranks_on_host]
        base = below[-1] if below else known[0]
        return max(1.0, self.compute_sharing[base] * ranks_on_host / base)

    @property
    def overlaps_comm(self) -> bool:
        """Whether collectives can run beside compute: on GPUs (their own streams), not on CPU ranks,
        whose collectives need the cores the compute runs on (gloo's threads, woken by the rank)."""
        return self.device != "cpu"

    def seen_by(self, ranks_on_host: int) -> "HardwareProfile":
        """This profile as ``ranks_on_host`` ranks sharing one host's CPU cores see it: where it was
        calibrated in a world of that many ranks, every collective (scaled to smaller groups by the
        ring formulas) and every wrapper cost is that world's, since on shared cores most of what a
        collective costs is waking the ranks that wait their turn. Unchanged on GPU profiles and
        where that world was not calibrated."""
        if self.device != "cpu" or any(ranks_on_host not in sizes for sizes in self.collectives.values()):
            return self
        overheads = self.framework_overhead
        if ranks_on_host in overheads:
            overheads = {ranks_on_host: overheads[ranks_on_host]}
        return replace(self, collectives={k: {ranks_on_host: v[ranks_on_host]} for k, v in self.collectives.items()},
                       framework_overhead=overheads)

    def require_host_link(self, lever: str, copies: str) -> None:
        """Refuse estimating host-memory lever ``lever`` (which ``copies`` over the host link) on this profile:
        none stated (a CPU device's memory is the host's already)."""
        if self.host_link_bytes_per_s is None:
            raise ValueError(f"{lever} {copies} over the host link, and hardware {self.name!r} (device "
                             f"{self.device!r}) states none (host_link_bytes_per_s=None; a CPU rank's memory is the "
                             "host's, so there is nothing to offload): estimate it on a GPU profile such as 'H100-SXM'")

    def overhead(self, what: str, group_size: int) -> float:
        """Calibrated framework seconds (``tp_module`` per call, ``fsdp_collective`` per collective) at
        the nearest calibrated group size; 0 where none was measured (datasheet profiles)."""
        if not self.framework_overhead or group_size <= 1:
            return 0.0
        near = min(self.framework_overhead, key=lambda q: (abs(q - group_size), -q))
        return self.framework_overhead[near].get(what, 0.0)

    def collective_time(self, kind: str, group_size: int, nbytes: float, calls: int = 1,
                        spans_nodes: bool = False, burst: bool = False, concurrent: int = 1) -> float:
        """Seconds for ``calls`` collectives of ``kind`` on ``group_size`` ranks moving ``nbytes`` in all;
        with ``burst``, issued back to back and then waited for (ZeroRedundancyOptimizer's broadcasts):
        each call's fixed cost is then the calibrated ``<kind>_in_burst`` where there is one. ``concurrent``:
        groups of this mesh dim on one node that communicate at the same time; without peer-to-peer their
        transfers all go through the host's memory, one shared path, so each gets its share of it."""
        if kind not in KINDS:
            raise ValueError(f"collective kind {kind!r}; expected one of {KINDS}")
        if group_size <= 1 or calls == 0:
            return 0.0
        table = self.inter_node if spans_nodes and self.inter_node else self.collectives
        alpha, beta = _scaled(table[kind], kind, group_size)
        if self.peer_to_peer is False and not spans_nodes:
            beta *= max(1, int(concurrent))
        if burst and not spans_nodes:
            alpha = self.overhead(f"{kind}_in_burst", group_size) or alpha
        return calls * alpha + nbytes * beta / self.efficiency

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("collectives", "inter_node"):
            d[key] = {k: {str(p): list(ab) for p, ab in v.items()} for k, v in d[key].items()}
        d["compute_sharing"] = {str(k): v for k, v in self.compute_sharing.items()}
        d["framework_overhead"] = {str(k): dict(v) for k, v in self.framework_overhead.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "HardwareProfile":
        d = dict(d)
        for key in ("collectives", "inter_node"):
            d[key] = {k: {int(p): tuple(ab) for p, ab in v.items()} for k, v in d.get(key, {}).items()}
        return cls(**d)

    def save(self, path) -> None:
        """Write the profile as JSON to ``path``."""
        with open(os.fspath(path), "w") as fh:
            json.dump(self.to_dict(), fh, indent=1)

    @classmethod
    def load(cls, path) -> "HardwareProfile":
        """A profile written by :meth:`save` (or by hand in the same JSON form)."""
        with open(os.fspath(path)) as fh:
            return cls.from_dict(json.load(fh))

    def with_efficiency(self, efficiency: float) -> "HardwareProfile":
        return replace(self, efficiency=efficiency)


def _scaled(sizes: Mapping[int, Tuple[float, float]], kind: str, p: int) -> Tuple[float, float]:
    """(alpha, beta) at group size ``p``: the listed one, else the nearest listed size scaled by the ring formulas."""
    if p in sizes:
        return sizes[p]
    ref = min(sizes, key=lambda q: (abs(q - p), -q))
    alpha, beta = sizes[ref]
    return (alpha * ring_steps(kind, p) / ring_steps(kind, ref),
            beta * ring_fraction(kind, p) / ring_fraction(kind, ref))


def link_table(latency_s: float, bytes_per_s: float, group_size: int = 2) -> Dict[str, Dict[int, Tuple[float, float]]]:
    """Alpha-beta per kind at ``group_size`` for ring collectives over links of ``bytes_per_s`` each way."""
    return {k: {group_size: (latency_s * ring_steps(k, group_size), ring_fraction(k, group_size) / bytes_per_s)}
            for k in KINDS}


_GB = 1e9


def _builtin(device: str, nodes: int) -> HardwareProfile:
    d = DEVICES[device]
    common = dict(device="cuda", flops_per_s=d["flops_per_s"], half_flops_per_s=d["half_flops_per_s"],
                  bytes_per_s=d["bytes_per_s"], op_overhead_s=GPU_OP_OVERHEAD_S, sm_count=d["sm_count"],
                  tensor_flops_per_s=d["tensor_flops_per_s"], host_link_bytes_per_s=d["host"],
                  achieved=d["achieved"], host_adam_params_per_s=HOST_ADAM_PARAMS_PER_S,
                  collectives=link_table(INTRA_LATENCY_S, d["link"]), efficiency=DEFAULT_EFFICIENCY,
                  source="datasheet and documented measurements", kernel_model=True)
    nvlink = d["link_name"].startswith("NVLink")
    common.update(peer_to_peer=True, nvlink=nvlink)
    if nodes == 1:
        return HardwareProfile(name=f"{device} + {d['link_name']}", topology=f"one node, {d['link_name']} between "
                               "GPUs, peer-to-peer", **common)
    ib, ib_bw = IB[device]
    return HardwareProfile(name=f"{nodes}x8 {device} + {d['link_name']}, {ib} between nodes", ranks_per_node=8,
                           inter_node=link_table(INTER_LATENCY_S, ib_bw), nics_per_node=8,
                           topology=f"{nodes} nodes of 8 GPUs, {d['link_name']} peer-to-peer in a node, one {ib} "
                           "NIC per GPU between nodes", **common)


RTX4090_NO_P2P = HardwareProfile(
    name="RTX-4090-PCIe-noP2P", device="cuda", flops_per_s=82.6e12, half_flops_per_s=165.2e12,
    tensor_flops_per_s=82.6e12, bytes_per_s=1008 * _GB, op_overhead_s=RTX4090_OP_S, sm_count=128,
    achieved=DEVICES["RTX-4090"]["achieved"], host_link_bytes_per_s=31.5 * _GB,
    host_adam_params_per_s=HOST_ADAM_PARAMS_PER_S,
    collectives=link_table(RTX4090_NO_P2P_LINK_S, RTX4090_NO_P2P_LINK_BPS), efficiency=1.0,
    source="datasheet and documented measurements", kernel_model=True, peer_to_peer=False, nvlink=False,
    ranks_per_node=None, topology="up to 8 RTX 4090 per node on PCIe 4.0 x16, no peer-to-peer (NCCL_P2P_DISABLE=1: "
    "NCCL's SHM transport through host memory, which groups running at once share), no NVLink, no NIC between "
    "nodes (one node)")


def _builtins() -> Dict[str, HardwareProfile]:
    out = {}
    for device in DEVICES:
        out[device] = _builtin(device, 1)
        if device in IB:
            for nodes in NODES.get(device, (2, 8)):
                out[f"{nodes}x8-{device}"] = _builtin(device, nodes)
    out[RTX4090_NO_P2P.name] = RTX4090_NO_P2P
    return out


BUILTIN_PROFILES = _builtins()


def hardware_profiles() -> Dict[str, HardwareProfile]:
    """The built-in profiles by name (module doc: every figure's source)."""
    return dict(BUILTIN_PROFILES)


def hardware_profile(name: str) -> HardwareProfile:
    """A built-in profile by name (:func:`hardware_profiles` lists them)."""
    if name not in BUILTIN_PROFILES:
        raise ValueError(f"no built-in hardware profile {name!r}; expected one of {sorted(BUILTIN_PROFILES)} "
                         "or a HardwareProfile (calibrate(), HardwareProfile.load)")
    return BUILTIN_PROFILES[name]
