"""What a draft costs besides time: its own parameters and the extra memory it needs next to the target.

Counted analytically from the DraftArch and the target's shapes, exactly as decode.DraftModel builds
the network (tests check the count against an extracted model), so a trial never has to build one:

    feat_fc     F*H x H + H        F = len(feature_layers) target features projected to the draft width
    in_fc       2H x H             concat / hybrid fusion: fc over [token embedding; feature]
    per layer   2 RMSNorms (2H) + self-attention 4 x H x (heads * head_dim) + SwiGLU 3 x H x ffn
                cross / hybrid: + RMSNorm (H) + cross-attention 4 x H x (heads * head_dim) + 1 gate
    norm        H
    head        draft_vocab x H    only for a reduced vocabulary; the full-vocab draft shares the
                                   target's LM head (and always its token embedding): no extra weights

Extra memory = the draft's weights + its KV cache at the given context (self-attention K/V of every
layer over the positions the draft sees) + the cross-attention memory (K/V of projected target
features) for cross/hybrid fusion. The target's own memory is not counted: it is there anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from decode.arch import DraftArch
from decode.drafts.model import TargetDims


def draft_params(arch: DraftArch, dims: TargetDims) -> int:
    """Trainable parameters the draft adds to the target (shared embedding / LM head excluded)."""
    h, d = dims.hidden_size, dims.head_dim
    n = len(arch.feature_layers) * h * h + h  # feat_fc (weight + bias)
    if arch.uses_concat:
        n += 2 * h * h  # in_fc, no bias
    for heads, ffn in zip(arch.heads, arch.ffn):
        inner = heads * d
        n += 2 * h + 4 * h * inner + 3 * h * ffn  # attn_norm, ffn_norm, q/k/v/o, gate/up/down
        if arch.uses_cross:
            n += h + 4 * h * inner + 1  # cross_norm, q/k/v/o, tanh gate
    n += h  # final norm
    if arch.draft_vocab is not None and arch.draft_vocab < dims.vocab_size:
        n += arch.draft_vocab * h  # own hot-token head
    return n


@dataclass(frozen=True)
class MemoryCost:
    weights_mb: float
    kv_mb: float
    cross_memory_mb: float

    @property
    def total_mb(self) -> float:
        return self.weights_mb + self.kv_mb + self.cross_memory_mb


def extra_memory(arch: DraftArch, dims: TargetDims, context: float, bytes_per_value: int = 4,
                 image_tokens: float = 0.0) -> MemoryCost:
    """Memory the draft needs beyond the target at `context` committed tokens (MB = 1e6 bytes).

    Positions the draft sees: context minus the image tokens it drops (visual_keep < 1).
    """
    seen = max(1.0, context - image_tokens * (1.0 - arch.visual_keep))
    kv = sum(2 * heads * dims.head_dim * seen for heads in arch.heads)  # K and V, (heads, seen, head_dim)
    cross = sum(2 * heads * dims.head_dim * seen for heads in arch.heads) if arch.uses_cross else 0.0
    mb = bytes_per_value / 1e6
    return MemoryCost(weights_mb=draft_params(arch, dims) * mb, kv_mb=kv * mb, cross_memory_mb=cross * mb)
