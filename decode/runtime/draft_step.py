"""The compiled runtime's draft level step: one torch.compile graph per (level bucket, logits rows).

A neural draft builds its tree level by level; each level is a forward of n new positions over the draft's
cache, then its LM head. Eagerly every level has new shapes (n and the cache length change every call), so
each runs op by op with the host in the loop: on the H200 a one-layer draft spent 13.7 ms per cycle drafting a
depth-2 tree whose parts profile at about 3 ms (README, issue 12). Here a level of n <= 32 positions runs as

    tokens, g, positions (B,) / (B, H)       n real rows, then B - n dummies (token 0, position 0)
    allowed (B, C + B)                       over the whole StaticDraftKV buffer (C entries), then the new rows
    -> hidden (B, H), logits (R, V), new K/V (h, B, d) per layer

with B = n rounded up to a bucket (1, 2, 4, 8, 16, 32) and C the buffer's fixed capacity, so a graph's shapes
never change between cycles: DraftModel.forward itself is traced (the same code as eager), its cache being the
whole buffers (stale entries masked out); the new K/V are written into the buffers after the graph (the real n
rows only), so the graph mutates nothing. Dummy rows see only themselves and are dropped. R is every row (tree
levels) or only the last real one (the root level, whose other rows are committed pairs nobody ranks: a
full-vocabulary head costs 1.5-3 ms a row on 2 CPU cores).

A level with more rows (the first one of a generation feeds the whole prompt) or before the buffers exist runs
eagerly on the same buffers. `warm` compiles every bucket up to a tree's widest level outside timed runs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from decode.drafts.static_kv import StaticDraftKV
from decode.runtime.compiled import check_owner, compile_step, new_owner
from decode.runtime.small_rows import measure_linears

if TYPE_CHECKING:
    from decode.drafts.model import DraftModel

logger = logging.getLogger(__name__)

DRAFT_BUCKETS = (1, 2, 4, 8, 16, 32)
CUDA_DRAFT_BUCKETS = (1, 8, 32)  # launch-bound levels on a GPU: fewer CUDA graphs to build (decode/runtime/compiled.py)


def draft_buckets(device_type: str = "cpu") -> tuple[int, ...]:
    """The level row counts compiled on a device type; both end at DRAFT_BUCKETS[-1] (larger levels run eagerly)."""
    return CUDA_DRAFT_BUCKETS if device_type == "cuda" else DRAFT_BUCKETS


def draft_bucket(n: int, device_type: str = "cpu") -> int | None:
    """The padded row count of an n-row level, None when it is larger than every bucket (runs eagerly)."""
    return next((b for b in draft_buckets(device_type) if n <= b), None)


class _Frame:
    """What DraftModel.forward sees inside the graph: the whole buffers as its cache; new entries collected."""

    def __init__(self, kv, mem_kv, mem_pos):
        self.kv, self.mem_kv, self.mem_pos = kv, mem_kv, mem_pos
        self.new: list[tuple[torch.Tensor, torch.Tensor]] = []

    def append(self, layer: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.new.append(kv)


class DraftStepRunner:
    """Compiled level steps of one DraftModel over a StaticDraftKV."""

    def __init__(self, model: "DraftModel", device: torch.device):
        self.model = model
        self.kind = device.type  # bucket sizes per device type
        # CUDA graphs on a GPU (outputs live in buffers the next replay overwrites), single-threaded inductor kernels
        # on a CPU (decode.runtime.compiled.CPU_OPTIONS)
        self.owner = new_owner()
        self._compiled, self._graphs = compile_step(self._level, device.type, frozen="model")
        self._measured: set[int] = set()
        self.calls = {"compiled": 0, "eager": 0}  # levels run each way (tests, benchmarks)

    # ------------------------------------------------------------------ the traced function
    def _level(self, tokens, g, positions, allowed, ks, vs, mem_ks, mem_vs, mem_pos, last, last_only: bool):
        check_owner(self)
        model = self.model
        mem = list(zip(mem_ks, mem_vs)) if mem_ks else [None] * len(ks)
        frame = _Frame(list(zip(ks, vs)), mem, mem_pos)
        hidden = model(tokens, g, positions, allowed, frame)  # (B, H)
        logits = model.logits(hidden.index_select(0, last) if last_only else hidden)  # (R, V)
        return hidden, logits, [kv[0] for kv in frame.new], [kv[1] for kv in frame.new]

    def _inputs(self, cache: StaticDraftKV):
        uses_cross = self.model.uses_cross
        mem_ks = list(cache.mem_k) if uses_cross else []
        mem_vs = list(cache.mem_v) if uses_cross else []
        return list(cache.k), list(cache.v), mem_ks, mem_vs, cache.mem_pos_buf if uses_cross else None

    def usable(self, n: int, cache: StaticDraftKV) -> bool:
        return (draft_bucket(n, self.kind) is not None and cache.ready
                and (not self.model.uses_cross or cache.has_memory()))

    def _measure(self, b: int) -> None:
        """Few-row CPU kernel choices of the draft's linear layers (and a shared LM head) for b rows, before tracing."""
        if b in self._measured:
            return
        measure_linears(self.model, b)
        if self.model.head_rows() is None and self.model._shared:
            measure_linears(self.model._shared[1], b)
        self._measured.add(b)

    # ------------------------------------------------------------------ one level
    def step(self, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
             cache: StaticDraftKV, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The eager DraftModel.forward + logits contract: tokens (n,), g (n, H), positions (n,), allowed (n, L + n)
        over the cache's L entries then the new ones -> hidden (n, H), logits (n, V) (or (1, V) of the last row
        when last_only); the new entries are appended to `cache`."""
        n = tokens.numel()
        if not self.usable(n, cache):
            self.calls["eager"] += 1
            hidden = self.model(tokens, g, positions, allowed, cache)
            return hidden, self.model.logits(hidden[-1:] if last_only else hidden)
        self.calls["compiled"] += 1
        b = draft_bucket(n, self.kind)
        length = cache.length
        if length + b > cache.capacity:
            logger.warning("compiled draft: %d entries outgrow its buffers of %d: larger ones (recompiles)",
                           length + b, cache.capacity)
            cache.grow(length + b)
        cap, dev = cache.capacity, tokens.device
        pad = b - n
        full = torch.zeros(b, cap + b, dtype=torch.bool, device=dev)
        full[:n, :length] = allowed[:, :length]
        full[:n, cap: cap + n] = allowed[:, length:]
        full[n:, cap + n:] = torch.eye(pad, dtype=torch.bool, device=dev)  # dummies see only themselves
        tok = torch.cat([tokens, tokens.new_zeros(pad)])
        gp = torch.cat([g, g.new_zeros(pad, g.shape[1])])
        pos = torch.cat([positions, positions.new_zeros(pad)])
        last = torch.tensor([n - 1], device=dev)
        self._measure(b)
        with torch.no_grad():
            hidden, logits, ks, vs = self._compiled(tok, gp, pos, full, *self._inputs(cache), last, last_only)
        for i, (k, v) in enumerate(zip(ks, vs)):
            cache.append(i, (k[:, :n], v[:, :n]))  # copies out of the graph's outputs
        hidden, logits = hidden[:n], (logits if last_only else logits[:n])
        if self._graphs:
            hidden, logits = hidden.clone(), logits.clone()
        return hidden, logits

    def warm(self, cache: StaticDraftKV, widest: int, root_rows: int = 0) -> list[int]:
        """Compile both variants of every bucket up to bucket(widest), and the root-level variant (logits of the last
        row) of every bucket up to bucket(root_rows), at most 32 rows, on dummy levels over `cache` (its buffers must
        exist; nothing is written to it) -> the buckets compiled."""
        if not cache.ready or (self.model.uses_cross and not cache.has_memory()):
            return []
        done = []
        dev = cache.k[0].device
        top = draft_bucket(min(widest, DRAFT_BUCKETS[-1]), self.kind)
        top_root = draft_bucket(min(max(widest, root_rows), DRAFT_BUCKETS[-1]), self.kind)
        for b in draft_buckets(self.kind):
            if b > top_root:
                break
            self._measure(b)
            cap = cache.capacity
            full = torch.zeros(b, cap + b, dtype=torch.bool, device=dev)
            full[:, cap:] = torch.eye(b, dtype=torch.bool, device=dev)
            tok = torch.zeros(b, dtype=torch.long, device=dev)
            # positions a tensor of their own: passed `tok` twice, dynamo guarded on the aliasing and no real level
            # (distinct tensors) could use the graph, so each bucket compiled again when a generation first met it
            pos = torch.zeros(b, dtype=torch.long, device=dev)
            g = torch.zeros(b, self.model.dims.hidden_size, dtype=cache.k[0].dtype, device=dev)
            last = torch.zeros(1, dtype=torch.long, device=dev)
            with torch.no_grad():
                for last_only in (False, True) if b <= top else (True,):
                    self._compiled(tok, g, pos, full, *self._inputs(cache), last, last_only)
            done.append(b)
        return done
