"""Parts of the supernet's max-size weights whose gradient is added into the weight's `.grad` in place.

A subnet runs leading slices of its supernet's weights (q/k/v rows, o and FFN-down columns, the first
draft_vocab rows of the hot-token head) and column blocks of feat_fc. Autograd's backward of a slice or
an index allocates a zero tensor the size of the *whole* weight at every use and then adds it into
`.grad`: profiled on a demo-scale training step on 2 CPU cores (fp32, AVX2), those fills were 21% of the
step's time (aten::fill_ under SliceBackward0 / IndexBackward0), more than every op but the matmuls.
`part(weight, index)` returns the same values as `weight[index]` (and `rows(weight, ids)` as `weight[ids]`,
the head rows of a step's candidate tokens); its backward adds the incoming gradient into `weight.grad`
where the values came from, creating `.grad` (zeros) once per optimizer step at most. The
gradient is the one autograd computes, summed in another order (tests/test_supernet_train.py).
"""

from __future__ import annotations

import torch

Index = tuple[slice, ...] | torch.Tensor  # leading slices, or column ids (dim 1) as a LongTensor

_ANCHORS: dict[torch.device, torch.Tensor] = {}


def _anchor(device: torch.device) -> torch.Tensor:
    """An empty tensor that requires grad: the Function's only autograd input, so that its backward runs (the
    weight itself is passed inside a tuple, out of autograd's sight, and gets its gradient by hand)."""
    if device not in _ANCHORS:
        _ANCHORS[device] = torch.empty(0, device=device, requires_grad=True)
    return _ANCHORS[device]


class _PartInto(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, holder: tuple[torch.nn.Parameter], index: Index) -> torch.Tensor:
        ctx.holder, ctx.index = holder, index
        weight = holder[0].detach()
        return weight.index_select(1, index) if isinstance(index, torch.Tensor) else weight[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.holder
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        if isinstance(ctx.index, torch.Tensor):
            weight.grad.index_add_(1, ctx.index, grad.to(weight.grad.dtype))
        else:
            weight.grad[ctx.index] += grad.to(weight.grad.dtype)
        return None, None, None


class _RowsInto(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, holder: tuple[torch.nn.Parameter], ids: torch.Tensor) -> torch.Tensor:
        ctx.holder, ctx.ids = holder, ids
        return holder[0].detach()[ids]  # ids (...,) -> (..., H)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.holder
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, ctx.ids.reshape(-1), grad.reshape(-1, weight.shape[1]).to(weight.grad.dtype))
        return None, None, None


def rows(weight: torch.nn.Parameter, ids: torch.Tensor) -> torch.Tensor:
    """weight[ids] for a LongTensor of row ids of any shape (the hot-token head's rows of a step's candidate tokens);
    when it is trained, its backward adds into weight.grad's rows in place (no zero-filled full-size gradient)."""
    if not (weight.requires_grad and torch.is_grad_enabled()):
        return weight[ids]
    return _RowsInto.apply(_anchor(weight.device), (weight,), ids)


def part(weight: torch.nn.Parameter, index: Index) -> torch.Tensor:
    """weight[index] (leading slices) or weight[:, index] (a LongTensor of column ids); when it is trained, a
    tensor whose backward adds into weight.grad in place instead of through a zero-filled full-size gradient."""
    if isinstance(index, torch.Tensor):
        index = index.to(weight.device)
    if not (weight.requires_grad and torch.is_grad_enabled()):
        return weight[:, index] if isinstance(index, torch.Tensor) else weight[index]
    return _PartInto.apply(_anchor(weight.device), (weight,), index)
