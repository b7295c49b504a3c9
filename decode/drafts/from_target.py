"""Start a neural draft from the target itself: its decoder layer (and, on request, identity fusion).

A draft trained from random weights on a few thousand CPU-affordable positions memorises; a draft
whose layers begin as the target's own last decoder layer already computes the right kind of
function (attention over earlier tokens in the target's residual space) and only has to learn to
continue one position ahead. This is the cheapest sample-efficiency lever there is.

What is copied (shapes for SmolLM2-135M: H 576, 9 query heads, 3 KV heads, head_dim 64, FFN 1536):

    draft layer i      <- target decoder layer `source_layer(...)` (the last one by default)
      attn_norm        <- input_layernorm                         (H,)
      attn.q/o         <- self_attn.q_proj rows / o_proj columns of the first `heads` query heads
      attn.k/v         <- self_attn.k/v_proj with grouped KV heads EXPANDED: draft head i reads
                          the target KV head i // (q_heads / kv_heads), so attention is exact
      ffn_norm         <- post_attention_layernorm
      mlp gate/up/down <- mlp.*_proj, leading `ffn` channels
      cross-attention  <- the same self_attn weights (no rotary), gate kept
    with fusion=True (else they keep their random initialisation):
    feat_fc            <- identity on the last-hidden-state block (zeros elsewhere), bias 0
    in_fc              <- [I, I]: the layer starts from embed(x_j) + feature(j-1)

The draft's final norm is NOT copied: the draft regresses the target's hidden state AFTER its
final norm (supernet/unroll.py), so applying the target's norm weights again would scale twice.

Weights of a larger draft than the target layer (more heads or channels) keep their random values
beyond the copied block. Gemma-style norms (weight stored as w - 1) are converted. Biases of the
target's projections (Qwen2 q/k/v) have no place in the draft and are dropped (logged).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from decode.errors import UserError
from decode.targets.capture import normalize_layer

logger = logging.getLogger(__name__)


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    """The effective RMSNorm scale of an HF norm module (Gemma stores scale - 1)."""
    w = norm.weight.detach().float()
    return w + 1.0 if "gemma" in type(norm).__name__.lower() else w


def source_layer(num_layers: int, feature_layers: tuple[int, ...]) -> int:
    """The target decoder layer a draft layer starts from: the one after the deepest feature layer
    (HF hidden-state h is the input of decoder layer h), the last layer when that is the final state."""
    deepest = max(normalize_layer(x, num_layers) for x in feature_layers)
    return min(deepest, num_layers - 1)


def expand_kv_rows(weight: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """(kv_heads*d, H) grouped K or V projection -> (q_heads*d, H): query head i gets KV head i // group."""
    if q_heads % kv_heads:
        raise UserError(f"cannot expand {kv_heads} KV heads to {q_heads} query heads (not a multiple)")
    w = weight.view(kv_heads, head_dim, -1)
    return w.repeat_interleave(q_heads // kv_heads, dim=0).reshape(q_heads * head_dim, -1)


def _copy_block(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the overlapping leading block of src into dst (both 1-D or 2-D)."""
    idx = tuple(slice(0, min(a, b)) for a, b in zip(dst.shape, src.shape))
    dst[idx] = src[idx].to(dst.dtype)


@torch.no_grad()
def init_layer_from_target(layer: nn.Module, t_layer: nn.Module, q_heads: int, kv_heads: int, head_dim: int) -> None:
    """Copy one HF decoder layer (llama-like: self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj) into a DraftLayer."""
    attn, mlp = getattr(t_layer, "self_attn", None), getattr(t_layer, "mlp", None)
    if attn is None or mlp is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        raise UserError(f"cannot start the draft from a {type(t_layer).__name__}: it lacks llama-style "
                        "self_attn/mlp projections; train without --init-from-target")
    if any(getattr(getattr(attn, n), "bias", None) is not None for n in ("q_proj", "k_proj", "v_proj")):
        logger.info("target attention biases are dropped in the draft's copy of %s", type(t_layer).__name__)
    q = attn.q_proj.weight.detach()
    k = expand_kv_rows(attn.k_proj.weight.detach(), q_heads, kv_heads, head_dim)
    v = expand_kv_rows(attn.v_proj.weight.detach(), q_heads, kv_heads, head_dim)
    o = attn.o_proj.weight.detach()
    for mod in (layer.attn, layer.cross):
        if mod is None:
            continue
        for name, src in (("q_proj", q), ("k_proj", k), ("v_proj", v), ("o_proj", o)):
            _copy_block(getattr(mod, name).weight, src)
    _copy_block(layer.attn_norm.weight, _norm_weight(t_layer.input_layernorm))
    if layer.cross_norm is not None:
        _copy_block(layer.cross_norm.weight, _norm_weight(t_layer.input_layernorm))
    post = getattr(t_layer, "pre_feedforward_layernorm", None) or t_layer.post_attention_layernorm
    _copy_block(layer.ffn_norm.weight, _norm_weight(post))
    for name in ("gate_proj", "up_proj", "down_proj"):
        _copy_block(getattr(layer.mlp, name).weight, getattr(mlp, name).weight.detach())


@torch.no_grad()
def init_from_target(draft: nn.Module, target, feature_layers: tuple[int, ...] | None = None,
                     fusion: bool = False) -> int:
    """Start `draft` (a decode DraftModel or the supernet) from `target`; -> the source layer index.

    `feature_layers` decides the source layer (default: the draft's own arch). Every draft layer starts
    from that same target layer: depth-1 subnets use layer 0 alone, so it must be the best single layer."""
    cfg = target.text_config
    dims = draft.dims
    q_heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or q_heads)
    if dims.head_dim * q_heads != target.decoder.layers[0].self_attn.q_proj.weight.shape[0]:
        raise UserError("the target's attention width is not heads x head_dim; cannot start from its layers")
    src = source_layer(target.num_layers, tuple(feature_layers or draft.arch.feature_layers))
    t_layer = target.decoder.layers[src]
    for layer in draft.layers:
        init_layer_from_target(layer, t_layer, q_heads, kv_heads, dims.head_dim)
    if not fusion:
        return src
    h = dims.hidden_size
    draft.feat_fc.weight.zero_()
    draft.feat_fc.bias.zero_()
    # feat_fc's column blocks follow the supernet's layer union (canonical numbering) or the arch's layers
    n = dims.num_layers
    layers = [normalize_layer(x, n) for x in (getattr(draft, "union", None) or draft.arch.feature_layers)]
    last = layers.index(n) if n in layers else len(layers) - 1  # the block of the target's final hidden state
    draft.feat_fc.weight[:, last * h: (last + 1) * h] = torch.eye(h, dtype=draft.feat_fc.weight.dtype)
    if draft.in_fc is not None:
        eye = torch.eye(h, dtype=draft.in_fc.weight.dtype)
        draft.in_fc.weight.copy_(torch.cat([eye, eye], dim=1))
    return src

