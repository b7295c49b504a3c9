"""Grouped-query attention for tree verification without copying the KV cache.

transformers' SDPA path (integrations/sdpa_attention.py) handles grouped KV heads three ways: `enable_gqa`
when there is no mask, a packed query when there is one query token, and otherwise `repeat_kv`, which
materialises every cached key and value `num_key_value_groups` times, in every layer, on every call. A
verified tree has N > 1 query tokens and a tree mask, so it always took the copy: for the default target
(9 query heads on 3 KV heads) at a 277-token context that was 60 copies of (1, 9, 277, 64) per cycle,
10.8 ms of a 71 ms 3-token verify on 2 CPU cores, and it grows with the context.

Here the N queries of the `n_rep` heads that share a KV head are stacked along the query axis instead:
query (B, H, N, D) is viewed as (B, KVH, n_rep * N, D) (head h = kvh * n_rep + r, as repeat_kv orders
them, so this is a view), the (B, 1, N, K) mask is tiled n_rep times along its query axis (a few rows),
and SDPA runs on the KV heads as stored. Every (query, key) pair meets the same values as before. For one
token this is transformers' own packed path, which it skips under torch.compile (the compiled runtime then
copied its whole static cache per layer on every vanilla step too); here both runtimes take it.

On a CPU in float32, a step or tree of at most native_attention.MAX_QUERIES tokens (grouped heads or not) takes
the native decoding attention kernel instead (decode/runtime/native_attention.py), which computes each query the
same way whatever else is in the call: a token verified in a tree gets the bits a vanilla step gives it, so greedy
speculative decoding is the target's own output exactly, not up to a near-tie.

`use_packed_gqa(model)` switches a model from "sdpa" to this implementation (registered under PACKED_SDPA,
with transformers' SDPA mask builder); anything it does not cover (no mask, a per-head mask,
position biases, attention sinks, no grouped heads) goes to transformers' SDPA function unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from decode.runtime import native_attention

PACKED_SDPA = "sdpa_packed_gqa"


def packed_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H, N, D)
    key: torch.Tensor,  # (B, KVH, K, D)
    value: torch.Tensor,  # (B, KVH, K, Dv)
    attention_mask: torch.Tensor | None,  # (B or 1, 1, N, K) additive or bool
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if attention_mask is not None and attention_mask.dim() == 4:
        # the keys the mask covers: all of them, except under the compiled runtime's window over its static cache
        # (a shorter mask; the cache's later positions are all masked), where attention reads only those. Sliced
        # unconditionally: a length test would make torch.compile specialise the window's symbolic length
        key, value = key[:, :, : attention_mask.shape[-1]], value[:, :, : attention_mask.shape[-1]]
    plain = (kwargs.get("position_bias") is None and kwargs.get("s_aux") is None and kwargs.get("sinks") is None
             and kwargs.get("softcap") is None and not kwargs.get("output_attentions", False) and not dropout)
    if plain and native_attention.usable(query, key, value, attention_mask):
        return native_attention.attend(query, key, value, attention_mask, scaling), None
    n_rep = getattr(module, "num_key_value_groups", 1)
    b, h, n, _ = query.shape
    packable = (
        n_rep > 1 and attention_mask is not None and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1 and h == key.shape[1] * n_rep and plain
    )
    if not packable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kvh = key.shape[1]
    q = query.reshape(b, kvh, n_rep * n, query.shape[-1])  # row r * N + i = head kvh * n_rep + r, token i
    mask = attention_mask.repeat(1, 1, n_rep, 1)  # (B, 1, n_rep * N, K): row r * N + i is token i's mask
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=False)
    # (B, KVH, n_rep * N, Dv) -> (B, H, N, Dv) -> (B, N, H, Dv) as transformers' attention functions return it
    return out.reshape(b, h, n, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_SDPA, packed_gqa_attention)
AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)


def use_packed_gqa(model: PreTrainedModel) -> bool:
    """Switch a model that runs transformers' "sdpa" to PACKED_SDPA (vision towers included: without grouped
    heads they fall through to the same SDPA call). -> whether it switched."""
    if model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(PACKED_SDPA)
    return True
