"""SNNDistributedRuntime: what a training loop needs from an applied plan."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

from ..compat import uncompiled
from .checkpoints.checkpoint import load_checkpoint, save_checkpoint
from .common.validate import positive_int
from .model import neurons
from .model.analysis import SNNDistributedAnalysis
from .model.layouts import SPIKES, TIME_MAJOR, DataLayout, check_samples
from .parallelize.mixed_precision import LossScaler, loss_scaler_for
from .planning.plan_types import SNNDistributedPlan
from .tp.channel_styles import full_tensor

#: What ``forward_loss`` does with the time dim of ``[T, N, C]`` (or ``[N, T, C]``) outputs before the criterion.
REDUCE_TIME = ("mean", None)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss_dtype(outputs: torch.Tensor) -> torch.Tensor:
    """Half-precision outputs in fp32 for the criterion (a bf16 log-softmax keeps 8 bits); others as they are."""
    return outputs.float() if outputs.dtype in (torch.bfloat16, torch.float16) else outputs


def _check_batch(inputs, labels) -> None:
    """Both tensors, before the forward runs (labels are matched to the outputs after it)."""
    for name, value in (("inputs", inputs), ("labels", labels)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def time_major_collate(samples):
    """torch's default collation, the inputs (a batch's first tensor, ``[N, T, ...]``) made ``[T, N, ...]``."""
    batch = default_collate(samples)
    if isinstance(batch, torch.Tensor):
        return batch.transpose(0, 1).contiguous() if batch.dim() >= 2 else batch
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor) and batch[0].dim() >= 2:
        return type(batch)([batch[0].transpose(0, 1).contiguous(), *batch[1:]])
    return batch


@dataclass
class SNNDistributedRuntime:
    """The distributed model, its mesh, and helpers that respect the plan's dp/tp layout."""
    model: nn.Module
    mesh: Any
    analysis: SNNDistributedAnalysis
    plan: SNNDistributedPlan
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _loaders: List[DataLoader] = field(default_factory=list, repr=False)
    #: fp16 plans: the dynamic loss scaler :meth:`backward` and :meth:`step` use (None otherwise)
    scaler: Optional[LossScaler] = None

    def __post_init__(self):
        if self.scaler is None:
            self.scaler = loss_scaler_for(self.plan.precision)

    # ---- layout -------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The user's model inside any DDP / compile wrapper."""
        m = uncompiled(self.model)
        return m.module if isinstance(m, nn.parallel.DistributedDataParallel) else m

    @property
    def dp_size(self) -> int:
        return self.plan.dp_size

    @property
    def dp_rank(self) -> int:
        """This rank's coordinate on the dp dim (0 when the plan has no data parallelism)."""
        if self.mesh is None or self.plan.dp_size == 1:
            return 0
        return self.mesh.get_local_rank("dp")

    @property
    def tp_rank(self) -> int:
        if self.mesh is None or self.plan.tp_size == 1:
            return 0
        return self.mesh.get_local_rank("tp")

    # ---- training helpers -----------------------------------------------------------------
    def build_optimizer(self, cls: Callable = torch.optim.Adam, lr: float = 1e-3, weight_decay: float = 0.0, **kw):
        """An optimizer over the model's parameters; ZeroRedundancyOptimizer for dp + 'zero'."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.plan.uses_zero:
            return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=self.mesh.get_group("dp"),
                                           lr=lr, weight_decay=weight_decay, **kw)
        if any(isinstance(p, DTensor) for p in params) and not all(isinstance(p, DTensor) for p in params):
            kw.setdefault("foreach", False)  # foreach kernels cannot mix DTensor and plain tensors
        return cls(params, lr=lr, weight_decay=weight_decay, **kw)

    def reset_state(self) -> int:
        """Reset every stateful neuron; returns how many modules were reset."""
        return neurons.reset_all(self.module)

    def prepare_dataloader(self, dataset: Dataset, batch_size: Optional[int] = None, shuffle: bool = True,
                           num_workers: int = 0, drop_last: bool = True, pin_memory: bool = False,
                           seed: int = 0) -> DataLoader:
        """A loader of this rank's share: ``batch_size`` (global, default the plan's) / dp samples.

        The sampler splits over the dp coordinate, so tensor-parallel peers get the same samples.
        Call :meth:`set_epoch` each epoch to reshuffle. A dataset's samples ``[T, ...]`` stack to
        ``[N, T, ...]``; a plan whose ``data_layout`` states time-major (or per-step) inputs gets them
        as ``[T, N, ...]`` (:func:`time_major_collate`); an unstated layout leaves them as stacked.
        """
        batch_size = self.plan.batch_size if batch_size is None else batch_size
        batch_size = positive_int("batch_size", batch_size, what="the loader's global batch")
        if batch_size % self.dp_size:
            raise ValueError(f"batch_size={batch_size} (the loader's global batch) is not divisible by "
                             f"dp={self.dp_size}")
        sampler = None
        if self.dp_size > 1:
            sampler = DistributedSampler(dataset, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=shuffle,
                                         drop_last=drop_last, seed=seed)
        stated = self.plan.data_layout
        collate = time_major_collate if stated is not None and stated.input != "batch_major" else None
        loader = DataLoader(dataset, batch_size=batch_size // self.dp_size, sampler=sampler,
                            shuffle=shuffle if sampler is None else False, num_workers=num_workers,
                            drop_last=drop_last, pin_memory=pin_memory, collate_fn=collate)
        self._loaders.append(loader)
        return loader

    def set_epoch(self, epoch: int) -> None:
        """Reseed the DistributedSamplers of the loaders this runtime prepared."""
        for loader in self._loaders:
            if isinstance(loader.sampler, DistributedSampler):
                loader.sampler.set_epoch(epoch)

    @staticmethod
    def prepare_classification_output(outputs: torch.Tensor, labels: torch.Tensor,
                                      reduce_time: Optional[str] = "mean",
                                      layout: DataLayout = TIME_MAJOR) -> Tuple[torch.Tensor, torch.Tensor]:
        """Outputs and labels as a classification criterion takes them.

        Outputs with a time dim (``[T, N, C]``, or ``[N, T, C]`` where ``layout.output`` says so)
        become their mean over time ``[N, C]`` (``reduce_time="mean"``) or ``[T, N, C]``
        (``reduce_time=None``, for a criterion written for per-step outputs); one-hot ``[N, C]`` /
        ``[N, 1]`` labels become ``[N]``. ValueError when the outputs do not hold the labels' N where
        ``layout`` puts it.
        """
        if reduce_time not in REDUCE_TIME:
            raise ValueError(f"reduce_time={reduce_time!r}; expected one of {REDUCE_TIME}")
        if not isinstance(outputs, torch.Tensor):
            raise TypeError(f"the model returned a {type(outputs).__name__}, not a tensor; classification needs "
                            "outputs [T, N, C], [N, T, C] or [N, C]")
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"labels must be a torch.Tensor ([N], [N, 1] or one-hot [N, C]), got "
                            f"{type(labels).__name__}")
        outputs = _full(outputs)
        labels = _full(labels)
        if outputs.dim() not in (2, 3):
            raise ValueError(f"classification outputs must be [T, N, C], [N, T, C] or [N, C], got shape "
                             f"{tuple(outputs.shape)}")
        if labels.dim() == 2 and labels.shape[1] == 1:
            labels = labels[:, 0]
        elif labels.dim() == 2 and labels.shape[1] == outputs.shape[-1]:
            labels = labels.argmax(-1)
        try:
            if labels.dim() != 1:
                raise ValueError("expected [N], [N, 1] or one-hot [N, C]")
            outputs = layout.outputs_by_sample(outputs, labels.shape[0], reduce_time=reduce_time)
        except ValueError as exc:
            raise ValueError(f"labels of shape {tuple(labels.shape)} do not match outputs {tuple(outputs.shape)}: "
                             f"{exc}") from None
        return outputs, labels.long()

    @property
    def layout(self) -> DataLayout:
        """Where N and T sit in the model's input and output (the plan's; time-major when unstated)."""
        return self.plan.layout

    def rank_share(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None):
        """This dp rank's share of a global batch ``(inputs, labels)``: its contiguous block of
        ``plan.per_rank_batch`` samples, cut on the batch dim of the plan's layout (TP and PP peers of
        one dp coordinate get the same block). ValueError when the batch does not hold ``batch_size``
        samples there, or the labels another N."""
        _check_batch(inputs, inputs if labels is None else labels)
        n = check_samples(self.layout, inputs, labels)
        if n != self.plan.batch_size:
            raise ValueError(f"inputs {tuple(inputs.shape)} hold N={n} samples on dim {self.layout.batch_dim} "
                             f"(data layout {self.layout}); the plan's global batch is {self.plan.batch_size}")
        start, length = self.dp_rank * self.plan.per_rank_batch, self.plan.per_rank_batch
        share = self.layout.share(inputs, start, length).contiguous()
        return share, None if labels is None else labels[start:start + length].contiguous()

    def forward_loss(self, criterion: Callable, inputs: torch.Tensor, labels: torch.Tensor,
                     reset: bool = True, reduce_time: Optional[str] = "mean",
                     output: int = SPIKES) -> Tuple[torch.Tensor, torch.Tensor]:
        """Reset neuron state (unless ``reset=False``), run the model, return ``(loss, outputs)``.

        The model runs as the plan's data layout says (once on the batch, or once per time step for
        ``per_step``, outputs stacked ``[T, N, ...]``). The criterion sees the outputs averaged over
        time by default: ``[T, N, C]`` (or ``[N, T, C]``) becomes ``[N, C]`` before
        ``criterion(outputs, labels)``. Pass ``reduce_time=None`` to give the criterion the
        ``[T, N, C]`` outputs themselves. ``outputs`` returned are the model's own, unreduced; of a model
        that returns a tuple (an snntorch tutorial's ``(spikes, membranes)``), element ``output`` (default
        0, the spikes; :func:`~.layouts.model_output`).
        """
        _check_batch(inputs, labels)
        if self.plan.uses_pp:
            raise RuntimeError("forward_loss runs the whole model, which a pipeline (mode 'pp') splits over ranks; "
                               "use runtime.train_step(criterion, inputs, labels), which runs the schedule over "
                               "the micro-batches and returns the loss on every rank")
        if reset:
            self.reset_state()
        outputs = self.layout.run(self.model, inputs.to(self.device), output)
        prepared, labels = self.prepare_classification_output(outputs, labels.to(self.device), reduce_time,
                                                              self.layout)
        return criterion(_loss_dtype(prepared), labels), outputs

    def train_step(self, criterion: Callable, inputs: torch.Tensor, labels: torch.Tensor,
                   reduce_time: Optional[str] = "mean") -> torch.Tensor:
        """One training step's forward and backward on this rank's batch: reset neuron state, run
        the model, compute the loss, backpropagate. Returns the loss (detached), on every rank.

        The optimizer step (and ``zero_grad``) stays the caller's, as in any torch loop. Under mode
        ``pp`` the step is the pipeline schedule's over the micro-batches (each stage resets its
        neurons before every micro-batch); the loss is their mean, sent from the last stage.
        """
        if self.plan.uses_pp:
            _check_batch(inputs, labels)
            scale = self.scaler.scale if self.scaler is not None else 1.0  # each micro-batch's backward is scaled

            def micro_loss(out, y):
                prepared, y = self.prepare_classification_output(out, y, reduce_time, self.layout)
                return criterion(_loss_dtype(prepared), y) * scale
            return self.model.train_step(micro_loss, inputs, labels) / scale
        loss, _ = self.forward_loss(criterion, inputs, labels, reduce_time=reduce_time)
        self.backward(loss)
        return loss.detach()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss first multiplied by the fp16 loss scale (plans with a scaler)."""
        (self.scaler.scale_loss(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer) -> bool:
        """``optimizer.step()``; under fp16 the gradients are unscaled first and a step whose gradients
        overflowed on any rank is skipped everywhere (the scale halves). A collective under fp16: call on
        every rank. Returns whether the step was taken."""
        if self.scaler is None:
            optimizer.step()
            return True
        return self.scaler.step(optimizer, [p for p in self.model.parameters() if p.requires_grad])

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, path, optimizer=None, step: int = 0, extra: Any = None, overwrite: bool = False,
                        allow_mid_sequence: bool = False, allow_non_finite: bool = False):
        """Write the model (and ``optimizer``'s state, ``step``, RNG states, JSON ``extra``) to the
        directory ``path``, sharded as this plan shards it; atomic, a collective (call on every rank).

        Neuron state is not saved (it is reset every batch): a neuron still holding state is refused
        unless ``allow_mid_sequence=True``. An existing checkpoint is replaced only with
        ``overwrite=True``. Non-finite weights or optimizer state are refused (naming the tensors and
        rank) unless ``allow_non_finite=True``. See :mod:`snn_explorer.core.checkpoints.checkpoint`.
        """
        return save_checkpoint(self, path, optimizer=optimizer, step=step, extra=extra, overwrite=overwrite,
                               allow_mid_sequence=allow_mid_sequence, allow_non_finite=allow_non_finite)

    def load_checkpoint(self, path, optimizer=None):
        """Load a checkpoint saved under any plan of this model, resharded to this one (a collective);
        returns a :class:`~snn_explorer.core.checkpoints.checkpoint.LoadedCheckpoint` (step, extra, saved plan)."""
        return load_checkpoint(self, path, optimizer=optimizer)

    # ---- inspection ---------------------------------------------------------------------------
    def _full_tensors(self, pick: Callable) -> Dict[str, Optional[torch.Tensor]]:
        if self.plan.uses_pp:  # gathered over the pipeline stages (and tp)
            return self.model.full_tensors(pick, lambda owner, name, t: full_tensor(owner, name,
                                                                                    _full(t.detach()).contiguous()))
        out = {}
        for owner_name, owner in self.module.named_modules():
            for name, param in owner.named_parameters(recurse=False):
                tensor = pick(param)
                if tensor is not None:  # DTensors (TP, FSDP2) gathered, then channel / head shards
                    tensor = full_tensor(owner, name, _full(tensor.detach()).contiguous()).clone()
                out[f"{owner_name}.{name}" if owner_name else name] = tensor
        return out

    def full_parameters(self) -> Dict[str, torch.Tensor]:
        """Every parameter as a full (unsharded) tensor, by its path in the user's model.

        A collective under TP / FSDP2 / PP: call on every rank. ZeRO does not shard parameters.
        """
        return self._full_tensors(lambda p: p)

    def full_gradients(self) -> Dict[str, Optional[torch.Tensor]]:
        """Every parameter's gradient, unsharded (None where there is none); a collective."""
        return self._full_tensors(lambda p: p.grad)
