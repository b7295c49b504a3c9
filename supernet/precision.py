"""The precision a training step computes in: bf16 autocast where the hardware multiplies bf16 natively.

Master weights, AdamW moments and the losses' softmax stay fp32 (the loss casts its logits to fp32); autocast runs
the matrix products in bf16. A GPU always has bf16 units; a CPU has them with AVX512-BF16 or AMX (decode.runtime.
machine.cpu_isa), and without them oneDNN emulates bf16 and gains nothing. Measured on 2 cores with AVX512-BF16
(README): a demo supernet step 0.55 -> 0.42 s, with losses within 0.1% of fp32's over its first 40 steps.
Training only: decoding verifies against the target in its own dtype, so a draft trained this way is as lossless
as any other.
"""

from __future__ import annotations

import contextlib

import torch

from decode.runtime.machine import cpu_isa

MODES = ("auto", "bf16", "off")


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 in hardware: any CUDA GPU; a CPU listing avx512_bf16 or amx_tile."""
    if device.type == "cuda":
        return True
    isa = set(cpu_isa().split(","))
    return device.type == "cpu" and bool(isa & {"avx512_bf16", "amx_tile"})


def autocast_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of a training mode ("auto": bf16 where native_bf16, "bf16", "off"); None for fp32."""
    if mode not in MODES:
        raise ValueError(f"autocast mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off" or (mode == "auto" and not native_bf16(device)):
        return None
    return torch.bfloat16


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """The context a training step's forward runs in (a no-op for dtype None)."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
