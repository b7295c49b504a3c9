"""A draft's weights packed for CPU decoding: its linear weights stored as bfloat16, read by the native kernel.

On a CPU every draft level streams the draft's weights from memory for a few input rows (decode/runtime/small_rows.py),
and at that size the stream is the cost: a 16384-row draft head (576 wide) took 1.12 ms per product in float32 and
0.41 ms in bfloat16 through the native kernel on a 2-core AMD EPYC (cold weights). The draft may run in any precision
without touching the output: the target verifies every token (lossless whatever the draft proposes), so only the
acceptance could move, by rounding each weight to 8 significant bits.

What is packed: every nn.Linear weight of the draft's own modules (feature projection, input fusion, layers, its
hot-token head), never the target's shared embedding and LM head, nor norms, biases and gates. Only where it pays:
CPU, float32 weights, the native kernel available (without it a bfloat16 weight would be widened on every call).
Activations stay float32 (decode/runtime/small_rows.linear takes float32 inputs through bfloat16 weights).

Checkpoints stay float32 on disk; packing happens when a draft is loaded for decoding (decode.drafts.kinds) and on
the probes the hardware profile times (hwprofile/bench_draft.py), so the costs the search predicts are those of the
packed draft. VLM_DRAFT_NAS_DRAFT_WEIGHTS=fp32 keeps float32 weights (A/B runs, one process per format).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from decode.runtime import native_rows

ENV = "VLM_DRAFT_NAS_DRAFT_WEIGHTS"  # bf16 (default) | fp32


def requested() -> str:
    """The draft weight format asked for through ENV (bf16 unless it says fp32)."""
    value = os.environ.get(ENV, "bf16").strip().lower()
    return "fp32" if value in ("fp32", "float32", "off", "0") else "bf16"


def packs(weight: torch.Tensor) -> bool:
    """Whether a draft weight like this one is packed here: CPU float32, and cpu_format() says bf16."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and cpu_format() == "bf16"


@torch.no_grad()
def pack_for_decoding(module: nn.Module) -> int:
    """Store the weights of every nn.Linear under `module` as bfloat16 where `packs` says so (inference only: the
    parameters stop requiring gradients) -> weights packed. Idempotent."""
    n = 0
    for sub in module.modules():
        if type(sub) is nn.Linear and packs(sub.weight):
            sub.weight = nn.Parameter(sub.weight.to(torch.bfloat16), requires_grad=False)
            n += 1
    return n


def cpu_format() -> str:
    """The weight format drafts decode with on this machine's CPU: "bf16" (packed) or "fp32". CPU profiles record it
    (versions["draft_weights"]): a profile timed with the other format prices every draft level wrongly."""
    return "bf16" if requested() == "bf16" and native_rows.available() else "fp32"


def weight_format(module: nn.Module) -> str:
    """"bf16" when any linear weight of `module` is packed, else "fp32"."""
    packed = any(type(sub) is nn.Linear and sub.weight.dtype == torch.bfloat16 and sub.weight.device.type == "cpu"
                 for sub in module.modules())
    return "bf16" if packed else "fp32"
