"""Building blocks of the neural draft: RMSNorm, rotary, self/cross attention, SwiGLU, a layer, its KV cache.

Written out here (not borrowed from HF) because the draft runs tree attention over its own cache
with explicit positions and masks, and because the supernet's elastic layers slice these weights.
Batch size is 1: activations are (n, H) for n tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decode.runtime.small_rows import linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x (heads, n, d) at integer positions (n,) (half-split convention)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))  # (d/2,)
    ang = positions.to(torch.float32)[:, None] * inv[None, :]  # (n, d/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q (h, n, d), k/v (h, L, d), allowed (n, L) bool -> (n, h*d)."""
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, torch.finfo(q.dtype).min)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias[None, None])[0]  # (h, n, d)
    return out.transpose(0, 1).reshape(q.shape[1], -1)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.q_proj = nn.Linear(hidden, inner, bias=False)
        self.k_proj = nn.Linear(hidden, inner, bias=False)
        self.v_proj = nn.Linear(hidden, inner, bias=False)
        self.o_proj = nn.Linear(inner, hidden, bias=False)

    def w(self, name: str) -> torch.Tensor:
        """The weight a projection uses; elastic subclasses return a leading slice (supernet)."""
        return getattr(self, name).weight

    def proj(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.w(name))

    def split(self, x: torch.Tensor) -> torch.Tensor:  # (n, h*d) -> (h, n, d)
        return x.view(x.shape[0], -1, self.head_dim).transpose(0, 1)

    def forward(self, x, positions, allowed, cache_kv, theta):
        """x (n, H); cache_kv: (k, v) each (h, P, d) or None; allowed (n, P+n). Returns out, (k, v) of x."""
        q = rotate(self.split(self.proj("q_proj", x)), positions, theta)
        k = rotate(self.split(self.proj("k_proj", x)), positions, theta)
        v = self.split(self.proj("v_proj", x))
        keys = k if cache_kv is None else torch.cat([cache_kv[0], k], dim=1)
        vals = v if cache_kv is None else torch.cat([cache_kv[1], v], dim=1)
        return self.proj("o_proj", masked_attention(q, keys, vals, allowed)), (k, v)


class CrossAttention(SelfAttention):
    """DREAM-style: draft tokens attend to target features; the output is scaled by tanh(gate).
    Same projections as self-attention (queries from the draft, keys/values from the memory), no rotary."""

    def __init__(self, hidden: int, heads: int, head_dim: int):
        super().__init__(hidden, heads, head_dim)
        self.gate = nn.Parameter(torch.tensor(0.5))

    def memory_kv(self, mem: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """mem (m, H) projected target features -> keys/values (h, m, d), computed once per entry."""
        return self.split(self.proj("k_proj", mem)), self.split(self.proj("v_proj", mem))

    def forward(self, x, mem_kv, allowed):
        """x (n, H); mem_kv (h, m, d) pair; allowed (n, m) bool. Rows with no visible memory give 0."""
        if mem_kv[0].shape[1] == 0:
            return torch.zeros_like(x)
        q = self.split(self.proj("q_proj", x))
        any_seen = allowed.any(-1, keepdim=True)  # (n, 1)
        out = masked_attention(q, mem_kv[0], mem_kv[1], allowed | ~any_seen)  # avoid all-masked rows (NaN)
        return torch.tanh(self.gate) * self.proj("o_proj", out) * any_seen.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def w(self, name: str) -> torch.Tensor:
        """The weight a projection uses; elastic subclasses return a leading slice (supernet)."""
        return getattr(self, name).weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(linear(x, self.w("gate_proj"))) * linear(x, self.w("up_proj"))
        return linear(h, self.w("down_proj"))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer: self-attention, optional gated cross-attention, SwiGLU FFN.

    The sub-module classes are class attributes so the supernet can swap in elastic ones."""

    attn_cls: type[SelfAttention] = SelfAttention
    cross_cls: type[CrossAttention] = CrossAttention
    mlp_cls: type[SwiGLU] = SwiGLU

    def __init__(self, hidden: int, heads: int, head_dim: int, ffn: int, cross: bool, eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(hidden, eps)
        self.attn = self.attn_cls(hidden, heads, head_dim)
        self.cross_norm = RMSNorm(hidden, eps) if cross else None
        self.cross = self.cross_cls(hidden, heads, head_dim) if cross else None
        self.ffn_norm = RMSNorm(hidden, eps)
        self.mlp = self.mlp_cls(hidden, ffn)

    def forward(self, x, positions, allowed, cache_kv, theta, mem_kv=None, mem_allowed=None):
        """mem_kv None skips cross-attention (a layer built with it may run without it)."""
        a, new_kv = self.attn(self.attn_norm(x), positions, allowed, cache_kv, theta)
        x = x + a
        if self.cross is not None and mem_kv is not None:
            x = x + self.cross(self.cross_norm(x), mem_kv, mem_allowed)
        return x + self.mlp(self.ffn_norm(x)), new_kv


class DraftKV:
    """The draft's own cache: per-layer self-attention K/V (h, L, d) with a committed prefix,
    plus per-layer cross-attention K/V of the target-feature memory and the memory positions."""

    def __init__(self, num_layers: int):
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.committed = 0  # entries [0, committed) are final; the rest are tentative tree nodes
        self.mem_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.mem_pos: torch.Tensor | None = None  # (m,) target positions of memory entries

    @property
    def length(self) -> int:
        return 0 if self.kv[0] is None else self.kv[0][0].shape[1]

    def append(self, layer: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        old = self.kv[layer]
        self.kv[layer] = kv if old is None else (torch.cat([old[0], kv[0]], 1), torch.cat([old[1], kv[1]], 1))

    def commit(self) -> None:
        self.committed = self.length

    def drop_tentative(self) -> None:
        self.kv = [None if kv is None else (kv[0][:, : self.committed], kv[1][:, : self.committed]) for kv in self.kv]

    def append_memory(self, layer: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        old = self.mem_kv[layer]
        self.mem_kv[layer] = kv if old is None else (torch.cat([old[0], kv[0]], 1), torch.cat([old[1], kv[1]], 1))

    def append_positions(self, positions: torch.Tensor) -> None:
        """Target positions (m,) of the memory entries just appended."""
        self.mem_pos = positions if self.mem_pos is None else torch.cat([self.mem_pos, positions])
