"""Decoding-time attention through the native kernel (attention_kernel.cpp, built into the library of
decode/runtime/native_rows.py): a few query tokens (a vanilla step, a tree verification) over the KV cache, on the
CPU in float32, with each (head, query) pair computed the same way whatever else is in the call.

Why: greedy speculative decoding is lossless only if the target's verification of a token computes what a vanilla
step computes. aten's CPU attention does not, bit for bit (its blocking and vector paths depend on the number of
queries): on the default target a token's logits moved by up to 2e-5 between a step and a 2-8 token verification,
enough to flip a near-tie between the two best tokens. With this kernel and the row-independent linear kernel the
default target's verified logits equal its step logits exactly (tests/test_native_attention.py).

`usable(...)` says whether a call can take it (CPU, float32, no gradient, batch 1, a float mask shared by the
heads, at most MAX_QUERIES queries; VLM_DRAFT_NAS_NATIVE_ATTENTION=off turns it off); decode/targets/attention.py
routes the target's attention here when it can, else to aten's SDPA as before. A prompt's prefill (hundreds of
queries) keeps aten's kernel: vanilla and speculative decoding prefill alike.
"""

from __future__ import annotations

import functools
import os

import torch

from decode.runtime import native_rows

ENV = "VLM_DRAFT_NAS_NATIVE_ATTENTION"  # "off" (or 0): aten's attention for every call
MAX_QUERIES = 64  # query tokens per call: decoding steps and tree verifications; a prefill goes to aten
# how the kernel computes (attention_kernel.cpp), recorded in profiles. 2: scores LANES keys at a time (vsum_many),
# values key by key over several output slices
VERSION = "native2"


def unavailable_reason() -> str | None:
    """Why the kernel is not used in this process (None: it is)."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "no", "false"):
        return f"{ENV}=off"
    reason = native_rows.unavailable_reason()
    if reason is not None:
        return reason
    lib = native_rows._library()
    if lib is None:
        return "the native kernels did not build"
    return None if hasattr(lib, "vlm_tree_attention") else "the built library has no attention kernel"


@functools.lru_cache(maxsize=1)
def _ready() -> bool:
    return unavailable_reason() is None


@torch.compiler.assume_constant_result
def available() -> bool:
    """True when the kernel is built and not switched off (decided once per process)."""
    return _ready()


def usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether attention of query (B, H, N, D) over key/value (B, KVH, K, D/Dv) under mask (B, 1, N, K) can take the
    kernel (the mask additive float32, already cut to the keys' length)."""
    return (
        mask is not None and mask.dim() == 4 and mask.shape[0] == 1 and mask.shape[1] == 1
        and query.shape[0] == 1 and 1 <= query.shape[2] <= MAX_QUERIES
        and query.device.type == "cpu" and query.dtype == key.dtype == value.dtype == mask.dtype == torch.float32
        and query.shape[1] % key.shape[1] == 0 and mask.shape[2] == query.shape[2] and mask.shape[3] == key.shape[2]
        and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
        and available()
    )


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                   scale: float, lib=None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for query (1, H, N, D), key (1, KVH, K, D), value (1, KVH, K, Dv), mask
    (1, 1, N, K) -> (1, N, H, Dv), the layout transformers' attention functions return; call where usable().
    lib: another build of the library (native_rows.load; tests of the AVX2 build)."""
    q, k, v, m = (_last_contiguous(t) for t in (query, key, value, mask))
    _, h, n, d = q.shape
    kvh, keys, dv = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty(1, n, h, dv, dtype=torch.float32)
    status = (lib or native_rows._library()).vlm_tree_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), m.data_ptr(), out.data_ptr(), h, kvh, n, keys, d, dv,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2), m.stride(2), float(scale),
        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"native attention refused shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return out


# tree_attention as an operator a torch.compile graph calls as it is (the compiled runtime), as for rows_linear
_OPS = torch.library.Library("vlm_draft_nas", "FRAGMENT")
_OPS.define("tree_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor")
_OPS.impl("tree_attention", tree_attention, "CPU")


@torch.library.register_fake("vlm_draft_nas::tree_attention")
def _(query, key, value, mask, scale):
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[3])


tree_attention_op = torch.ops.vlm_draft_nas.tree_attention.default


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
           scale: float | None) -> torch.Tensor:
    """tree_attention, through its operator inside a torch.compile graph; scale None: 1 / sqrt(D)."""
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    fn = tree_attention_op if torch.compiler.is_compiling() else tree_attention
    return fn(query, key, value, mask, scale)
