"""calibrate(): measure this machine's compute and collectives into a :class:`HardwareProfile`.

For each group size ``p``, ``p`` real ranks (``snn_explorer.ranks``; gloo on CPUs, NCCL with one
GPU per rank) are started (in ``worlds`` fresh worlds one after another, every figure then their
median: :func:`median_profile`): a world of exactly the ranks a plan of that size runs, since
ranks that only wait still take a share of the cores. In the first world rank 0 times alone a
square matmul (FLOP/s), a large elementwise add (bytes/s) and a one-element add (the fixed cost of
one operator), and the same matmul and add on bf16 and fp16 tensors where the device's autocast
runs them (``measured_half``: the rates a bf16 or fp16 plan computes at here, see
:meth:`HardwareProfile.in_precision`);
then all ``p`` ranks run a small SNN training step together (:func:`_probe_step`), every
collective kind at a few buffer sizes (each issued between a little compute, as in a step:
:func:`_time_collective`), a burst of broadcasts as ZeroRedundancyOptimizer issues them
(:func:`_broadcast_burst`), the wrappers' cost: TP, FSDP2, DDP and ZeRO around a small spiking
MLP (:func:`_wrapped_step_times`), beyond the plain step and its collectives, and each pipeline
schedule's own cost per action and per transfer on a pipeline of small spiking blocks
(:func:`_pipeline_step_times`, :func:`_pipeline_costs`). ``compute_sharing[p]`` is how much
slower that step runs on each of ``p`` ranks than in the calling process on one thread (on GPUs:
than on rank 0 alone), the factor by which a rank's step is slower than the one the estimator
times in the calling process. Each (kind, p) gets
``alpha + beta * bytes`` fitted by least squares (:func:`fit_alpha_beta`) to the median of the
slowest rank's times (how long it takes: benchmarks/results/calibration.md). On CPU ranks the
checkpointing machinery's own cost per checkpointed call, and per operator of a call's region, is timed in the
calling process (:mod:`.checkpoint_call`; ``checkpoint_overhead``, ``checkpoint_overhead_per_op``).

:func:`default_hardware` is what ``estimate`` uses without ``hardware=``: the profile named by the
``SNN_EXPLORER_HARDWARE`` environment variable (a built-in name or a JSON file), else this
machine's calibration, made on first use and cached in the process and on disk
(``$XDG_CACHE_HOME/snn_explorer`` or ``~/.cache/snn_explorer``).
"""
from __future__ import annotations

import os
import socket
import statistics
from dataclasses import replace
from typing import Dict, Optional, Sequence

import torch

from ... import ranks
from ...core.common import Collective, positive_int
from ..instruments.isolation import one_thread
from ..instruments.progress_hook import ProgressHook, check_hook, tell
from ..timing.hardware import KINDS, HardwareProfile, hardware_profile
from .checkpoint_call import CheckpointCost, this_host_checkpoint_overhead
from .fit import median_profile, profile_from
from .gpu import calibrate_gpu
from .probes import busy_time, probe_step
from .step_probes import RANK_PHASES, calibrate_on_rank

#: Bumped when what calibrate() measures changes, so that older cached calibrations are not reused.
CALIBRATION_VERSION = 15


def calibrate(group_sizes: Sequence[int] = (2, 4), *, backend: str = "auto", name: Optional[str] = None,
              timeout: float = 120.0, worlds: int = 1, on_progress: Optional[ProgressHook] = None,
              device: str = "cpu", model=None, example_input=None, output=None) -> HardwareProfile:
    """Measure this machine into a :class:`HardwareProfile` (see the module doc; its duration on a
    2-core CPU machine: benchmarks/results/calibration.md). ``group_sizes`` (each >= 2): the collective group sizes to time, each in
    a world of its own size (ranks that only waited would still take the cores' time);
    ``backend``: ``"auto"`` (NCCL when there is a GPU per rank, else gloo), ``"gloo"`` or ``"nccl"``;
    ``worlds``: fresh worlds per size, the profile their median (:func:`median_profile`): on shared
    CPU cores a collective's latency can differ several times between two worlds. ``on_progress(done,
    total, label)`` (``instruments.progress_hook``) hears each piece rank 0 of a world finishes.

    ``device="cuda"``: this machine's GPU instead, at ``model``'s own shapes (one forward on
    ``example_input``), its NCCL collectives on every visible GPU (:mod:`.gpu`; ``group_sizes``,
    ``backend`` and ``worlds`` do not apply); CudaRequiredError where torch sees no CUDA device.
    ``output``: a path the profile is saved to as JSON (``estimate(hardware=<path>)`` loads it)."""
    if device == "cuda":
        return calibrate_gpu(model, example_input, output=output, name=name, timeout=timeout)
    if device != "cpu" or model is not None or example_input is not None:
        raise ValueError(f"calibrate(device={device!r}, model=...): expected device 'cpu' (this machine's cores, no "
                         "model) or 'cuda' (this machine's GPU, at a model's shapes)")
    profile = _calibrate_cpu(group_sizes, backend, name, timeout, worlds, on_progress)
    if output is not None:
        profile.save(output)
    return profile


def _calibrate_cpu(group_sizes, backend, name, timeout, worlds, on_progress) -> HardwareProfile:
    """:func:`calibrate` of this machine's ranks (CPU cores, or a GPU per rank by ``backend``)."""
    sizes = sorted({positive_int("group size", p) for p in group_sizes})
    worlds = positive_int("worlds", worlds, what="fresh worlds per group size")
    if not sizes or sizes[0] < 2:
        raise ValueError(f"group_sizes={list(group_sizes)}; expected sizes >= 2 (the ranks a collective spans)")
    if Collective.SEND in KINDS and sizes[0] % 2:
        raise ValueError(f"group_sizes={list(group_sizes)}: send/recv is timed between rank pairs; use even sizes")
    on_progress = check_hook(on_progress)
    all_runs, used, total = [], backend, worlds * len(sizes) * RANK_PHASES + 1
    for world in range(worlds):
        runs = {}
        for index, p in enumerate(sizes):
            heard = _rank_zero_pieces(on_progress, (world * len(sizes) + index) * RANK_PHASES, total)
            result = ranks.run(calibrate_on_rank, (p == sizes[0],), nprocs=p, backend=backend, timeout=timeout,
                               progress=heard)
            runs[p], used = result.values, result.backend
        all_runs.append(runs)
    reference, overhead = None, CheckpointCost({}, {}, None)
    if used == "gloo":  # CPU ranks: against the step in this process, on one thread (see local_correction)
        with one_thread():
            probe = probe_step(torch.device("cpu"))
            reference = statistics.median(busy_time(probe, lambda: None) for _ in range(3))
        overhead = this_host_checkpoint_overhead()  # the checkpointing machinery's own CPU work per call and op
    tell(on_progress, total, total, "calibrating this machine: done")
    profile = median_profile([profile_from(runs, used, name, reference) for runs in all_runs])
    return replace(profile, checkpoint_overhead=overhead.per_call, checkpoint_overhead_per_op=overhead.per_op,
                   checkpoint_reference_s=overhead.reference_s)


def _rank_zero_pieces(on_progress: Optional[ProgressHook], before: int, total: int):
    """A ``ranks.run`` progress callback passing rank 0's reported pieces on as ``before + step`` of
    ``total`` (False: no callback when there is no hook)."""
    if on_progress is None:
        return False

    last = [0]

    def heard(snapshot) -> None:  # called after every poll that brought any rank's events
        step = snapshot[0].get("step") or 0
        if step > last[0]:
            last[0] = step
            tell(on_progress, before + step, total, f"calibrating this machine: {snapshot[0]['message']}")
    return heard


_DEFAULT: Dict[str, HardwareProfile] = {}
ENV_VAR = "SNN_EXPLORER_HARDWARE"


def cache_path() -> str:
    """Where this machine's calibration is kept between sessions."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = f"hardware-v{CALIBRATION_VERSION}-{socket.gethostname()}-torch{torch.__version__}.json"
    return os.path.join(root, "snn_explorer", name)


def cached_hardware() -> Optional[HardwareProfile]:
    """The profile :func:`default_hardware` would return without measuring anything: the one named by
    ``SNN_EXPLORER_HARDWARE``, else this machine's calibration kept in the process or on disk; None
    when getting it would calibrate."""
    chosen = os.environ.get(ENV_VAR)
    if chosen:
        return HardwareProfile.load(chosen) if os.path.exists(chosen) else hardware_profile(chosen)
    if "local" not in _DEFAULT and os.path.exists(cache_path()):
        _DEFAULT["local"] = HardwareProfile.load(cache_path())
    return _DEFAULT.get("local")


def default_hardware(on_progress: Optional[ProgressHook] = None) -> HardwareProfile:
    """The profile ``estimate`` uses without ``hardware=`` (see the module doc); ``on_progress`` hears
    the calibration when it has to be made."""
    cached = cached_hardware()
    if cached is not None:
        return cached
    profile = calibrate(on_progress=on_progress)
    path = cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    profile.save(path)
    _DEFAULT["local"] = profile
    return profile


def resolve_hardware(hardware, on_progress: Optional[ProgressHook] = None) -> HardwareProfile:
    """``hardware`` as a profile: None is :func:`default_hardware` (``on_progress`` hears its calibration),
    a path (a string ending ``.json``) a profile file (:meth:`HardwareProfile.save`, ``calibrate(output=...)``),
    any other string a built-in profile's name."""
    if hardware is None:
        return default_hardware(on_progress)
    if isinstance(hardware, os.PathLike) or (isinstance(hardware, str) and hardware.endswith(".json")):
        if not os.path.isfile(hardware):
            raise ValueError(f"hardware={os.fspath(hardware)!r}: no such profile file (calibrate(output=...) writes one)")
        return HardwareProfile.load(hardware)
    if isinstance(hardware, str):
        return hardware_profile(hardware)
    if not isinstance(hardware, HardwareProfile):
        raise TypeError(f"hardware must be a HardwareProfile (calibrate(), hardware_profile(name)), a built-in "
                        f"profile's name or None, got {type(hardware).__name__}")
    return hardware
