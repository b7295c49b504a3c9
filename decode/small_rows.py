"""Faster CPU linear layers for the few-row inputs of decoding (a small draft tree, its verification).

torch's `F.linear(x, W)` computes x @ W^T through MKL's GEMM with a transposed weight, which re-packs the
whole weight on every call when x has a few rows: on 2 cores the target's LM head (49152 x 576) took
9.4 ms for one row but 22.5 ms for two and 33.6 ms for three, while W @ x^T (the same product, W read in
place) took 3.1 and 4.0 ms; verifying a 2-3 token tree cost 1.6-2x a decoding step. `linear` takes the
W @ x^T path for 2-4 rows of every projection and up to SMALL_ROWS rows of LM heads (WIDE outputs and
more), on CPU float32 inference calls; one row (MKL's GEMV), prefill and training keep F.linear.

The draft blocks call `linear`; `use_small_rows(model)` switches every nn.Linear of a target to it
(decode.loader does so for every target). Vanilla and speculative decoding run the same layers, so
speed-ups stay like-for-like; outputs stay token-identical (tested), values within 1e-5 of F.linear.
VLM_DRAFT_NAS_PLAIN_LINEAR=1 keeps F.linear everywhere (A/B runs).
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
