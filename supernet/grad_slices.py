"""Parts of the supernet's max-size weights whose gradient is added into the weight's `.grad` in place.

A subnet runs leading slices of its supernet's weights (q/k/v rows, o and FFN-down columns, the first
draft_vocab rows of the hot-token head) and column blocks of feat_fc. Autograd's backward of a slice or
an index allocates a zero tensor the size of the *whole* weight at every use and then adds it into
`.grad`: profiled on a demo-scale training step on 2 CPU cores (fp32, AVX2), those fills were 21% of the
step's time (aten::fill_ under SliceBackward0 / IndexBackward0), more than every op but the matmuls.
`part(weight, index)` returns the same values as `weight[index]` (or as `weight[ids]` / `weight[:, ids]` for
ids along a dim: the head rows of a step's candidate tokens, feat_fc's column blocks); its backward adds the
incoming gradient into `weight.grad` where the values came from, creating `.grad` (zeros) once per optimizer step
at most. The gradient is the one autograd computes, summed in another order (tests/test_supernet_train.py).
"""

from __future__ import annotations

import torch

# leading slices, or (dim, LongTensor of ids of any shape): the ids' entries along dim (weight[ids] for dim 0 gives
# shape ids.shape + (H,); weight[:, ids] for dim 1 with 1-D ids)
Index = tuple[slice, ...] | tuple[int, torch.Tensor]

_ANCHORS: dict[torch.device, torch.Tensor] = {}


def _anchor(device: torch.device) -> torch.Tensor:
    """An empty tensor that requires grad: the Function's only autograd input, so that its backward runs (the
    weight itself is passed inside a tuple, out of autograd's sight, and gets its gradient by hand)."""
    if device not in _ANCHORS:
        _ANCHORS[device] = torch.empty(0, device=device, requires_grad=True)
    return _ANCHORS[device]


def _take(weight: torch.Tensor, index: Index) -> torch.Tensor:
    if isinstance(index[0], slice):
        return weight[index]
    dim, ids = index
    return weight.index_select(dim, ids.reshape(-1)).unflatten(dim, ids.shape)


class _Into(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, holder: tuple[torch.nn.Parameter], index: Index) -> torch.Tensor:
        ctx.holder, ctx.index = holder, index
        return _take(holder[0].detach(), index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.holder
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        grad = grad.to(weight.grad.dtype)
        if isinstance(ctx.index[0], slice):
            weight.grad[ctx.index] += grad
        else:
            dim, ids = ctx.index
            weight.grad.index_add_(dim, ids.reshape(-1), grad.flatten(dim, dim + ids.dim() - 1))
        return None, None, None


def part(weight: torch.nn.Parameter, index: Index) -> torch.Tensor:
    """weight[index] (leading slices) or the ids' entries along a dim ((0, ids): the hot-token head's rows of a step's
    candidate tokens; (1, cols): feat_fc's column blocks); when it is trained, a tensor whose backward adds into
    weight.grad in place instead of through a zero-filled full-size gradient."""
    if not isinstance(index[0], slice):
        index = (index[0], index[1].to(weight.device))
    if not (weight.requires_grad and torch.is_grad_enabled()):
        return _take(weight, index)
    return _Into.apply(_anchor(weight.device), (weight,), index)
