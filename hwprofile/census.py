"""Op census: FLOPs, memory traffic and kernel count of one run of real decode code.

The roofline model (hwprofile.roofline) needs, for every table entry, what the measured call does:
it is counted here by running the call once under a TorchDispatchMode that sees every aten op the
real code issues (HF modules, draft blocks, tree bookkeeping alike), so nothing is modelled by
hand. Per op (views and metadata ops are free and skipped):

    kernels   +1 (one launch / eager dispatch)
    flops     2*M*N*K for matmuls (mm, addmm, bmm, baddbmm), 4*n*L*d*heads for attention kernels
    traffic   bytes of the op's distinct input tensors + its outputs; floating tensors are counted
              in elements (`float_elems`) so the traffic can be re-priced for another dtype, the rest
              (indices, masks) in `other_bytes`.

It is an upper-ish bound on traffic (no cache reuse between ops) and exact on FLOPs and kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
_FREE = {_aten.detach.default, _aten.lift_fresh.default, _aten._local_scalar_dense.default}  # no kernel of note


@dataclass(frozen=True)
class Census:
    flops: float = 0.0
    float_elems: float = 0.0  # floating-point elements read + written
    other_bytes: float = 0.0  # bytes of integer / bool tensors read + written
    kernels: int = 0

    def bytes_at(self, itemsize: int) -> float:
        """Memory traffic in bytes if the floating tensors had `itemsize` bytes per element."""
        return self.float_elems * itemsize + self.other_bytes

    def __add__(self, other: "Census") -> "Census":
        return Census(self.flops + other.flops, self.float_elems + other.float_elems,
                      self.other_bytes + other.other_bytes, self.kernels + other.kernels)

    def to_list(self) -> list:
        """Compact JSON form [flops, float_elems, other_bytes, kernels]."""
        return [float(f"{self.flops:.6g}"), float(f"{self.float_elems:.6g}"), float(f"{self.other_bytes:.6g}"),
                self.kernels]

    @classmethod
    def from_list(cls, v: list) -> "Census":
        return cls(float(v[0]), float(v[1]), float(v[2]), int(v[3]))

    def to_dict(self) -> dict:
        return asdict(self)


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _matmul_flops(func, args, out: torch.Tensor) -> float:
    """2*M*N*K: the contracted size is the last dim of the first matrix operand."""
    a = args[1] if func in (_aten.addmm.default, _aten.baddbmm.default) else args[0]
    return 2.0 * out.numel() * a.shape[-1]


def _attention_flops(args) -> float:
    """q (B, h, n, d), k (B, h, L, d): QK^T and PV, 2 FLOPs per multiply-add each."""
    q, k = args[0], args[1]
    b, h, n, d = q.shape
    return 4.0 * b * h * n * k.shape[-2] * d


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.flops = self.float_elems = self.other_bytes = 0.0
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func in _FREE:
            return out
        self.kernels += 1
        if func in _MATMULS:
            self.flops += _matmul_flops(func, args, out)
        elif "scaled_dot_product" in func.__name__:
            self.flops += _attention_flops(args)
        seen: set[int] = set()
        for t in _tensors(args) + _tensors(kwargs or {}) + _tensors(out):
            ident = id(t)
            if ident in seen:
                continue
            seen.add(ident)
            if t.is_floating_point():
                self.float_elems += t.numel()
            else:
                self.other_bytes += t.numel() * t.element_size()
        return out


@torch.no_grad()
def count(fn: Callable[[], object], setup: Callable[[], object] | None = None,
          reset: Callable[[], object] | None = None) -> Census:
    """Census of one call of fn (setup/reset run outside the count, as when timing)."""
    if setup is not None:
        setup()
    counter = _Counter()
    with counter:
        fn()
    if reset is not None:
        reset()
    return Census(counter.flops, counter.float_elems, counter.other_bytes, counter.kernels)


def roofline_seconds(c: Census, peak_flops: float, bandwidth: float, itemsize: int) -> float:
    """max(compute time, memory time) of a census: the throughput part of the roofline."""
    if not math.isfinite(c.flops):
        return float("inf")
    return max(c.flops / peak_flops, c.bytes_at(itemsize) / bandwidth)
