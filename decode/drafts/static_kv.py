"""StaticDraftKV: the neural draft's cache in pre-allocated buffers, for the compiled runtime.

Same interface as DraftKV (decode/drafts/blocks.py), so the eager DraftModel.forward runs on it unchanged:
`kv[i]` is a view of layer i's first `length` entries, `append` writes new entries in place after them,
`commit` / `drop_tentative` move a length, not tensors. The buffers themselves, (heads_i, capacity, head_dim)
per layer, never move between calls, so a compiled level step (decode/runtime/draft_step.py) sees the same
shapes every cycle: it attends over the whole buffer under a mask and leaves the writes to `append`.

The cross-attention memory (DREAM fusion) is kept the same way; its unused entries carry the position
UNUSED, which no query position exceeds, so a mask `mem_pos < query position` never shows them.

Buffers are allocated on a layer's first append, in the dtype and head count of what it receives (a supernet's
active subnet works too). A generation that outgrows `capacity` gets larger buffers holding every entry (one
recompilation of the compiled step, logged by the caller).
"""

from __future__ import annotations

import torch

UNUSED = 1 << 40  # position of an unused memory entry: no query sees it


class StaticDraftKV:
    def __init__(self, num_layers: int, capacity: int, mem_capacity: int | None = None):
        self.capacity = int(capacity)
        self.mem_capacity = int(mem_capacity or capacity)
        self.k: list[torch.Tensor | None] = [None] * num_layers  # (h, capacity, d) per layer
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.lens = [0] * num_layers  # entries written per layer (they differ only inside one forward)
        self.committed = 0  # entries [0, committed) are final; the rest are tentative tree nodes
        self.mem_k: list[torch.Tensor | None] = [None] * num_layers
        self.mem_v: list[torch.Tensor | None] = [None] * num_layers
        self.mem_lens = [0] * num_layers
        self.mem_pos_buf: torch.Tensor | None = None  # (mem_capacity,) target positions, UNUSED where empty
        self.mem_count = 0

    def reset(self) -> None:
        """Empty, buffers kept (a new generation: the compiled step's shapes and addresses stay the same)."""
        self.lens = [0] * len(self.lens)
        self.mem_lens = [0] * len(self.mem_lens)
        self.committed = self.mem_count = 0
        if self.mem_pos_buf is not None:
            self.mem_pos_buf.fill_(UNUSED)

    # ------------------------------------------------------------------ the DraftKV interface
    @property
    def length(self) -> int:
        return self.lens[0]

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        return [None if k is None or n == 0 else (k[:, :n], v[:, :n]) for k, v, n in zip(self.k, self.v, self.lens)]

    @property
    def mem_kv(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        return [None if k is None or n == 0 else (k[:, :n], v[:, :n])
                for k, v, n in zip(self.mem_k, self.mem_v, self.mem_lens)]

    @property
    def mem_pos(self) -> torch.Tensor | None:
        return None if self.mem_pos_buf is None or self.mem_count == 0 else self.mem_pos_buf[: self.mem_count]

    def append(self, layer: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Write kv (h, n, d) each after layer `layer`'s entries."""
        if self.lens[layer] + kv[0].shape[1] > self.capacity:
            self.grow(self.lens[layer] + kv[0].shape[1])
        self.lens[layer] = _write(self.k, self.v, layer, self.lens[layer], kv, self.capacity)

    def commit(self) -> None:
        self.committed = self.length

    def drop_tentative(self) -> None:
        self.lens = [min(n, self.committed) for n in self.lens]

    def append_memory(self, layer: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        if self.mem_lens[layer] + kv[0].shape[1] > self.mem_capacity:
            self.grow_memory(self.mem_lens[layer] + kv[0].shape[1])
        self.mem_lens[layer] = _write(self.mem_k, self.mem_v, layer, self.mem_lens[layer], kv, self.mem_capacity)

    def append_positions(self, positions: torch.Tensor) -> None:
        """Target positions (m,) of the memory entries just appended."""
        m = positions.numel()
        if self.mem_pos_buf is None:
            self.mem_pos_buf = torch.full((self.mem_capacity,), UNUSED, dtype=torch.long, device=positions.device)
        if self.mem_count + m > self.mem_capacity:
            self.grow_memory(self.mem_count + m)
        self.mem_pos_buf[self.mem_count: self.mem_count + m].copy_(positions)
        self.mem_count += m

    # ------------------------------------------------------------------ static view (the compiled step)
    @property
    def ready(self) -> bool:
        """Every buffer the compiled step reads exists (the first forward of a generation runs eagerly)."""
        return all(k is not None for k in self.k)

    def has_memory(self) -> bool:
        return self.mem_pos_buf is not None and all(k is not None for k in self.mem_k)

    # ------------------------------------------------------------------ growth
    def grow(self, needed: int) -> None:
        """Larger self-attention buffers (needed rounded up to a multiple of 128 and at least 1.5x), entries kept."""
        self.capacity = max(-(-needed // 128) * 128, self.capacity * 3 // 2)
        self.k = [None if b is None else _widen(b, self.capacity) for b in self.k]
        self.v = [None if b is None else _widen(b, self.capacity) for b in self.v]

    def grow_memory(self, needed: int) -> None:
        self.mem_capacity = max(-(-needed // 128) * 128, self.mem_capacity * 3 // 2)
        self.mem_k = [None if b is None else _widen(b, self.mem_capacity) for b in self.mem_k]
        self.mem_v = [None if b is None else _widen(b, self.mem_capacity) for b in self.mem_v]
        if self.mem_pos_buf is not None:
            pos = torch.full((self.mem_capacity,), UNUSED, dtype=torch.long, device=self.mem_pos_buf.device)
            pos[: self.mem_pos_buf.numel()] = self.mem_pos_buf
            self.mem_pos_buf = pos


def _write(ks: list, vs: list, layer: int, at: int, kv: tuple[torch.Tensor, torch.Tensor], capacity: int) -> int:
    """Copy kv (h, n, d) each into buffers ks[layer] / vs[layer] (allocated (h, capacity, d) on first use) at
    entries at..at+n-1 -> at + n."""
    if ks[layer] is None:
        ks[layer] = kv[0].new_zeros(kv[0].shape[0], capacity, kv[0].shape[2])
        vs[layer] = kv[1].new_zeros(kv[1].shape[0], capacity, kv[1].shape[2])
    n = kv[0].shape[1]
    ks[layer][:, at: at + n].copy_(kv[0])
    vs[layer][:, at: at + n].copy_(kv[1])
    return at + n


def _widen(buf: torch.Tensor, capacity: int) -> torch.Tensor:
    """(h, L, d) -> (h, capacity, d) with the first L entries copied."""
    out = buf.new_zeros(buf.shape[0], capacity, buf.shape[2])
    out[:, : buf.shape[1]] = buf
    return out
