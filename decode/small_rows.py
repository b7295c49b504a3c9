"""Faster CPU linear layers for the few-row inputs of decoding (one token, a small draft tree).

torch's `F.linear(x, W)` computes x @ W^T through MKL's sgemm with a transposed weight. For 2-16 input
rows that call re-packs the whole weight on every call: on 2 cores the target's LM head (49152 x 576)
took 12 ms for one row but 40 ms for two and 55 ms for three, so verifying a 2-3 token tree cost more
than verifying 8 (measured by hwprofile: verify(2) = 70 ms, verify(3) = 88 ms, verify(8) = 61 ms). The
same product written W @ x^T reads W in place (a GEMM with a tiny N), which is what `small_rows_forward`
does for inputs of at most SMALL_ROWS rows; larger inputs (prefill, training) keep F.linear.

`linear` is that choice as a function (the draft blocks call it); `use_small_rows(model)` switches every
nn.Linear of a module (the target) to it. It is
a runtime choice like the attention kernel: vanilla and speculative decoding both use it, so speed-ups
stay like-for-like, and greedy outputs stay identical between them (tested); values differ from
F.linear's by float rounding only (tested to 1e-5 relative).
"""

from __future__ import annotations

import os
import types

import torch

WIDE = 8192  # output features from which W @ x^T wins at every row count up to SMALL_ROWS (LM heads)
SMALL_ROWS = 16  # inputs with more rows (prefill, training batches) always keep F.linear
ENABLED = os.environ.get("VLM_DRAFT_NAS_PLAIN_LINEAR", "") in ("", "0")  # =1: torch's F.linear everywhere (A/B)


def _path(rows: int, out_features: int) -> bool:
    """True when W @ x^T beats F.linear for (rows x in) @ (out x in)^T on a CPU (measured per shape on 2
    cores, see the module doc): 2-4 rows for every projection, up to SMALL_ROWS rows for LM heads. One row
    stays with F.linear (MKL's GEMV); W @ x^T of a doubled row is faster alone but slower inside a model."""
    return 2 <= rows <= 4 or (2 <= rows <= SMALL_ROWS and out_features >= WIDE)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through W @ x^T where that is faster (few rows, CPU, float32, inference).
    x: (..., in), weight (out, in) -> (..., out)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (not ENABLED or not _path(rows, weight.shape[0]) or x.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype != torch.float32 or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return torch.nn.functional.linear(x, weight, bias)
    y = (weight @ x.reshape(rows, x.shape[-1]).T).T  # (rows, out): W (out, in) is read in place, not re-packed
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def use_small_rows(model: torch.nn.Module) -> int:
    """Route every nn.Linear of `model` (a target) through `linear`; -> layers switched. The path is taken
    per call (CPU, float32, few rows, no gradient), so the model may still move to a GPU or train."""
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_forward, module)
            n += 1
    return n
