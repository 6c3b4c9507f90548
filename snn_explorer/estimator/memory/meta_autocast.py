"""``torch.autocast`` as CUDA runs it, for a step traced on the meta device.

A mixed-precision plan runs its forward under ``torch.autocast`` (:mod:`...core.precision`; the profile's
model enters it around each module call, the neurons leave it). Autocast acts through a dispatch key of the
tensors' device, and meta tensors have none, so on the meta trace the forward would silently stay in fp32.
:class:`MetaAutocast` gives the trace autocast's rules, above autograd as autocast is (so what autograd
saves is what a GPU run saves): while autocast is enabled for the profile's device type, an operator on
autocast's lower-precision list gets its floating inputs cast to the autocast dtype, one on its float32
list gets them cast to fp32 (torch's "Automatic Mixed Precision package" page: "CUDA Ops that can autocast
to float16" / "to float32"), and every other operator runs on the dtypes it is given. A parameter is cast
once per forward, as autocast's cast cache does.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ...compat import tree_map

#: Operators autocast runs in the lower precision (by the name their Python function or method has).
LOWER = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "linear", "bilinear",
    "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "mv", "addmm", "addbmm", "baddbmm", "addmv", "addr",
    "chain_matmul", "multi_dot", "prelu", "scaled_dot_product_attention"})
#: Operators autocast runs in float32.
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "group_norm", "norm", "nuclear_norm",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "softmax", "log_softmax", "softmin", "cross_entropy", "cumprod",
    "cumsum", "prod", "sum", "normalize"})


class MetaAutocast(TorchFunctionMode):
    """Autocast's casts on meta tensors while ``torch.autocast(device_type)`` is enabled (module doc)."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self.cache = {}

    def _cast(self, value, dtype: torch.dtype):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype
                and value.device.type == "meta"):
            return value
        if value.is_leaf and value.requires_grad:  # a parameter: cast once per forward
            key = (id(value), dtype)
            if key not in self.cache:
                self.cache[key] = value.to(dtype)
            return self.cache[key]
        return value.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name in LOWER or name in FP32) and torch.is_autocast_enabled(self.device_type):
            dtype = torch.get_autocast_dtype(self.device_type) if name in LOWER else torch.float32
            args, kwargs = tree_map(lambda a: self._cast(a, dtype), (args, kwargs))
        return func(*args, **kwargs)
