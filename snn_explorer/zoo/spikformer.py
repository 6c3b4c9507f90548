"""A Spikformer-style spiking vision transformer (family ``spikformer``), tensors ``[T, N, tokens, dim]``."""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from ._neurons import MultiStep, conv_bn_lif, lif, scale_linear_init


class SpikingSelfAttention(nn.Module):
    """Spiking self-attention: separate ``q``/``k``/``v`` Linears each followed by a Leaky, then
    ``(q @ k^T * scale) @ v`` per head with no softmax, ``attn_lif``, and ``proj`` + ``proj_lif``.

    Head ``h`` owns features ``h*head_dim:(h+1)*head_dim`` of q/k/v (reshaped as
    ``[..., tokens, heads, head_dim]``); the number of heads is inferred from the width of ``q``'s
    output, so splitting q/k/v column-wise and ``proj`` row-wise along whole heads stays exact.
    """

    def __init__(self, dim: int, num_heads: int, *, scale: float = 0.125, beta: float = 0.9):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
        self.num_heads, self.head_dim, self.scale = num_heads, dim // num_heads, scale
        self.q, self.q_lif = nn.Linear(dim, dim), MultiStep(lif(beta))
        self.k, self.k_lif = nn.Linear(dim, dim), MultiStep(lif(beta))
        self.v, self.v_lif = nn.Linear(dim, dim), MultiStep(lif(beta))
        self.attn_lif = MultiStep(lif(beta))
        self.proj, self.proj_lif = nn.Linear(dim, dim), MultiStep(lif(beta))

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, N, L, H*Dh]`` -> ``[T, N, H, L, Dh]``."""
        return x.unflatten(-1, (-1, self.head_dim)).transpose(-3, -2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self._split_heads(self.q_lif(self.q(x)))
        k = self._split_heads(self.k_lif(self.k(x)))
        v = self._split_heads(self.v_lif(self.v(x)))
        out = (q @ k.transpose(-2, -1) * self.scale) @ v          # [T, N, H, L, Dh]
        out = self.attn_lif(out.transpose(-3, -2).flatten(-2))     # [T, N, L, H*Dh]
        return self.proj_lif(self.proj(out))


class SpikformerBlock(nn.Module):
    """``x + attn(x)`` then ``x + mlp(x)``; ``mlp`` = Sequential(fc1, lif1, fc2, lif2)."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, *, scale: float = 0.125,
                 beta: float = 0.9):
        super().__init__()
        self.attn = SpikingSelfAttention(dim, num_heads, scale=scale, beta=beta)
        self.mlp = nn.Sequential(OrderedDict(
            fc1=nn.Linear(dim, mlp_hidden), lif1=MultiStep(lif(beta)),
            fc2=nn.Linear(mlp_hidden, dim), lif2=MultiStep(lif(beta)),
        ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Spikformer(nn.Module):
    """Images ``[T, N, in_channels, H, W]`` -> ``[T, N, num_classes]``.

    ``stem``: two 3x3 ``conv_bn_lif`` blocks (``dim/4``, ``dim/2`` channels) and ``patch_embed``, a
    ``patch_size`` x ``patch_size`` strided ``conv_bn_lif`` to ``dim`` channels, giving
    ``(image_size/patch_size)**2`` spiking tokens. ``blocks``: ``depth`` :class:`SpikformerBlock`s.
    ``head``: ``Linear(dim, num_classes)`` on the token mean, the output current per step.
    """

    def __init__(self, image_size: int = 32, patch_size: int = 4, in_channels: int = 3, dim: int = 384,
                 depth: int = 4, num_heads: int = 8, mlp_ratio: int = 4, num_classes: int = 10, *,
                 beta: float = 0.9, attn_scale: float = 0.125, init_gain: float = 1.0):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size={image_size} is not divisible by patch_size={patch_size}")
        self.stem = nn.Sequential(OrderedDict(
            conv1=conv_bn_lif(in_channels, dim // 4, beta),
            conv2=conv_bn_lif(dim // 4, dim // 2, beta),
            patch_embed=conv_bn_lif(dim // 2, dim, beta, kernel=patch_size, stride=patch_size, padding=0),
        ))
        self.blocks = nn.ModuleList(
            SpikformerBlock(dim, num_heads, dim * mlp_ratio, scale=attn_scale, beta=beta) for _ in range(depth))
        self.head = nn.Linear(dim, num_classes)
        scale_linear_init(self, init_gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(3).transpose(-1, -2)   # [T, N, tokens, dim]
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(2))
