"""A decoder-only (spiking) language model built from a config, sizes from a test-sized one to 7 B.

Token ids arrive time-major ``[T, N, S]`` (the same tokens at every step: direct encoding; a
non-spiking config takes ``T = 1``) and the output is the next-token scores ``[T, N, S, vocab]``.
Each block is pre-norm (RMSNorm): ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

- Spiking attention (:class:`SpikingCausalAttention`): separate ``q``/``k``/``v`` Linears, rotary
  positions on q and k, a multi-step LIF neuron after each, ``(q @ k^T * scale)`` causally masked,
  ``@ v`` with no softmax (spike-driven), an ``attn_lif`` and the ``o`` projection. Heads are read
  from ``q``'s output width, so column-sharding q/k/v and row-sharding ``o`` along whole heads
  keeps every head on one rank and each neuron's state local to it.
- Spiking MLP: ``fc1`` -> LIF -> ``fc2`` (a neuron in place of the gated activation).
- ``spiking=False`` gives a Llama-style transformer (no neurons, no state): softmax attention by
  ``scaled_dot_product_attention`` with grouped k/v heads, SwiGLU MLP. :data:`LLM_CONFIGS` has
  Llama 3.1 8B's published shape for the estimator's check against published runs.

Neurons are :class:`MultiStepLIF` (a leaky integrate-and-fire layer stepping over T itself, arctan
surrogate gradient, state registered with :func:`~snn_explorer.core.model.neurons.register_stateful`):
about 7 operators per step where a per-step snntorch ``Leaky`` runs over 20, which is what a
shape-only profile of a 7 B model spends its time on. Build large configs on the meta device
(:func:`build_llm`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import nn

from ..core.common import positive_int
from ..core.model import register_stateful


@dataclass(frozen=True)
class LLMConfig:
    """The shape of a decoder-only language model (names as in Llama's ``params.json``)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    n_kv_heads: Optional[int] = None  # None: n_heads (grouped k/v heads only where not spiking)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied_embeddings: bool = False
    spiking: bool = True
    beta: float = 0.9  # the LIF neurons' membrane decay

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim"):
            positive_int(name, getattr(self, name))
        kv = self.kv_heads
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim={self.dim} must split into n_heads={self.n_heads} heads of an even width")
        if self.n_heads % kv or (self.spiking and kv != self.n_heads):
            raise ValueError(f"n_kv_heads={kv} must divide n_heads={self.n_heads} (and equal it when spiking)")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def param_count(self) -> int:
        """Parameters of the model this config builds (embeddings counted once when tied)."""
        kv = self.kv_heads * self.head_dim
        attn = 2 * self.dim * self.dim + 2 * self.dim * kv
        mlp = (2 if self.spiking else 3) * self.dim * self.ffn_dim
        embed = self.vocab_size * self.dim * (1 if self.tied_embeddings else 2)
        return self.n_layers * (attn + mlp + 2 * self.dim) + self.dim + embed


#: Named configs. The spiking ones follow the widths of common decoder-only models of their size
#: (768 x 12 GPT-2-small, 2048 x 16 with a 5632 MLP as TinyLlama, 4096 x 32 with 11008 as Llama 2 7B);
#: ``llama3.1-8b`` is Meta's published Llama 3.1 8B (``params.json``: dim 4096, 32 layers, 32 heads,
#: 8 k/v heads, ffn_dim_multiplier 1.3 and multiple_of 1024 giving 14336, vocab 128256, rope_theta 500000).
LLM_CONFIGS: Dict[str, LLMConfig] = {
    "spiking-llm-tiny": LLMConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64, tied_embeddings=True),
    "spiking-llm-100m": LLMConfig(vocab_size=32000, dim=768, n_layers=12, n_heads=12, ffn_dim=3072,
                                  tied_embeddings=True),
    "spiking-llm-1b": LLMConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, ffn_dim=8192),
    "spiking-llm-7b": LLMConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=16384),
    "llama3.1-8b": LLMConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                             rope_theta=500000.0, spiking=False),
}


class ATanSpike(torch.autograd.Function):
    """Heaviside spike of ``v - threshold`` forward; arctan surrogate ``alpha / 2 / (1 + (pi/2 alpha x)^2)``
    backward (as snntorch's and spikingjelly's ``ATan``)."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.save_for_backward(x)
        ctx.alpha = alpha
        return (x > 0).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (ctx.alpha / 2) / (1 + (math.pi / 2 * ctx.alpha * x).square()), None


class MultiStepLIF(nn.Module):
    """LIF over dim 0 of ``[T, ...]``: ``v = beta v + x_t``, spike where ``v`` crosses ``threshold``,
    ``v -= spike * threshold`` (reset by subtraction). The membrane ``v`` (a non-persistent buffer) is
    kept between calls until :meth:`reset`, as a stateful neuron's."""

    def __init__(self, beta: float = 0.9, threshold: float = 1.0, alpha: float = 2.0):
        super().__init__()
        self.beta, self.threshold, self.alpha = beta, threshold, alpha
        self.register_buffer("v", None, persistent=False)

    def reset(self) -> None:
        self.v = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.v if self.v is not None and self.v.shape == x.shape[1:] else torch.zeros_like(x[0])
        spikes = []
        for x_t in x.unbind(0):
            v = v * self.beta + x_t
            spike = ATanSpike.apply(v - self.threshold, self.alpha)
            v = v - spike * self.threshold
            spikes.append(spike)
        self.v = v
        return torch.stack(spikes)


register_stateful(MultiStepLIF)


def _neuron(beta: float) -> MultiStepLIF:
    return MultiStepLIF(beta)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary positions on ``[..., S, heads, head_dim]`` (pairs of features rotated by position)."""
    seq, half = x.shape[-3], x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = torch.arange(seq, dtype=torch.float32, device=x.device)[:, None] * freqs  # [S, half]
    cos, sin = angles.cos()[:, None].to(x.dtype), angles.sin()[:, None].to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class SpikingCausalAttention(nn.Module):
    """Spike-driven causal self-attention on ``[T, N, S, dim]`` (module doc)."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.head_dim, self.theta, self.scale = cfg.head_dim, cfg.rope_theta, cfg.head_dim ** -0.5
        self.num_heads = cfg.n_heads
        self.q, self.k, self.v = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(3))
        self.q_lif, self.k_lif, self.v_lif, self.attn_lif = (_neuron(cfg.beta) for _ in range(4))
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (-1, self.head_dim))  # [T, N, S, H, Dh]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_lif(rotate(self._heads(self.q(x)), self.theta).flatten(-2))
        k = self.k_lif(rotate(self._heads(self.k(x)), self.theta).flatten(-2))
        v = self.v_lif(self.v(x))
        q, k, v = (self._heads(y).transpose(-3, -2) for y in (q, k, v))  # [T, N, H, S, Dh]
        seq = x.shape[-2]
        causal = torch.ones(seq, seq, dtype=x.dtype, device=x.device).tril()
        out = ((q @ k.transpose(-2, -1)) * (causal * self.scale)) @ v
        return self.o(self.attn_lif(out.transpose(-3, -2).flatten(-2)))


class CausalAttention(nn.Module):
    """Llama's attention: rotary q/k, grouped k/v heads, softmax by ``scaled_dot_product_attention``."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        self.num_heads, self.kv_heads = cfg.n_heads, cfg.kv_heads
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-2]
        x = x.flatten(0, -3)  # [B, S, dim]
        q = rotate(self.q(x).unflatten(-1, (-1, self.head_dim)), self.theta).transpose(1, 2)
        k = rotate(self.k(x).unflatten(-1, (-1, self.head_dim)), self.theta).transpose(1, 2)
        v = self.v(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).flatten(-2)).unflatten(0, lead)


class SpikingMLP(nn.Module):
    """``fc2(lif(fc1(x)))``."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.fc1, self.lif, self.fc2 = (nn.Linear(cfg.dim, cfg.ffn_dim, bias=False), _neuron(cfg.beta),
                                        nn.Linear(cfg.ffn_dim, cfg.dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.lif(self.fc1(x)))


class SwiGLU(nn.Module):
    """Llama's MLP: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.w1, self.w3 = (nn.Linear(cfg.dim, cfg.ffn_dim, bias=False) for _ in range(2))
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class DecoderBlock(nn.Module):
    """``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps), RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = SpikingCausalAttention(cfg) if cfg.spiking else CausalAttention(cfg)
        self.mlp = SpikingMLP(cfg) if cfg.spiking else SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class SpikingLLM(nn.Module):
    """Token ids ``[T, N, S]`` -> scores ``[T, N, S, vocab]`` (module doc)."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def tensor_parallel_plan(self) -> Dict[str, str]:
        """TP along whole heads and MLP columns: q/k/v (and fc1 / w1, w3) column-wise, o (fc2 / w2) row-wise,
        each neuron local to the features of its rank (:mod:`snn_explorer.core.tp.styles`)."""
        plan = {}
        for i, block in enumerate(self.blocks):
            p = f"blocks.{i}"
            plan.update({f"{p}.attn.{n}": "colwise" for n in ("q", "k", "v")}, **{f"{p}.attn.o": "rowwise"})
            if self.config.spiking:
                plan.update({f"{p}.attn.{n}_lif": "local" for n in ("q", "k", "v", "attn")})
                plan.update({f"{p}.mlp.fc1": "colwise", f"{p}.mlp.lif": "local", f"{p}.mlp.fc2": "rowwise"})
            else:
                plan.update({f"{p}.mlp.w1": "colwise", f"{p}.mlp.w3": "colwise", f"{p}.mlp.w2": "rowwise"})
        return plan


def build_llm(name_or_config, *, device: Optional[str] = None, **overrides) -> SpikingLLM:
    """The model of a named config (:data:`LLM_CONFIGS`) or an :class:`LLMConfig`, with ``overrides``
    of its fields; on ``device`` (``"meta"`` builds any size without memory)."""
    if isinstance(name_or_config, str):
        if name_or_config not in LLM_CONFIGS:
            raise ValueError(f"unknown LLM config {name_or_config!r}; expected one of {tuple(LLM_CONFIGS)} "
                             "or an LLMConfig")
        name_or_config = LLM_CONFIGS[name_or_config]
    if not isinstance(name_or_config, LLMConfig):
        raise TypeError(f"expected a config name or an LLMConfig, got {type(name_or_config).__name__}")
    cfg = dataclasses.replace(name_or_config, **overrides)
    if device is None:
        return SpikingLLM(cfg)
    with torch.device(device):
        return SpikingLLM(cfg)


def token_batch(cfg: LLMConfig, time_steps: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """Random token ids ``[T, N, S]``, the same at every step (direct encoding)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    return tokens.expand(positive_int("time_steps", time_steps), -1, -1).contiguous()
