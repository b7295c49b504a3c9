"""Capture the hidden states of chosen decoder layers with forward hooks (only those layers).

Layer indices follow HF's `output_hidden_states` numbering for a decoder with L layers:
0 = the input embeddings (after any image features were merged in), i = the output of decoder
layer i-1 for 1 <= i < L, and L = the output of the final norm (HF's `hidden_states[-1]`).
Negative indices count from the end (-1 = L).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


def normalize_layer(index: int, num_layers: int) -> int:
    """Map an index in [-(L+1), L] to [0, L]; raise ValueError outside it."""
    if not -(num_layers + 1) <= index <= num_layers:
        raise ValueError(f"feature layer {index} out of range for a {num_layers}-layer target (use -{num_layers + 1}..{num_layers})")
    return index if index >= 0 else num_layers + 1 + index


def _first_tensor(output: object) -> torch.Tensor:
    # decoder layers return a tensor in transformers 5.x; older ones returned a tuple
    return output[0] if isinstance(output, (tuple, list)) else output  # type: ignore[return-value]


def register_capture(decoder: nn.Module, layers: tuple[int, ...], num_layers: int,
                     store: dict[int, torch.Tensor]) -> list:
    """Forward hooks that put {requested index: (B, T, H) hidden state} into `store` on every forward;
    -> their handles (remove them to stop)."""
    handles = []
    blocks = decoder.layers
    for req in dict.fromkeys(layers):  # de-duplicated, order kept
        idx = normalize_layer(req, num_layers)

        if idx == 0:

            def pre_hook(_mod, args, kwargs, req=req):
                store[req] = args[0] if args else kwargs["hidden_states"]

            handles.append(blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
        else:
            module = decoder.norm if idx == num_layers else blocks[idx - 1]

            def hook(_mod, _args, output, req=req):
                store[req] = _first_tensor(output)

            handles.append(module.register_forward_hook(hook))
    return handles


@contextmanager
def capture_hidden(decoder: nn.Module, layers: tuple[int, ...], num_layers: int) -> Iterator[dict[int, torch.Tensor]]:
    """Yield a dict that fills with {requested index: (B, T, H) hidden state} during forwards."""
    store: dict[int, torch.Tensor] = {}
    handles = register_capture(decoder, layers, num_layers, store)
    try:
        yield store
    finally:
        for h in handles:
            h.remove()
