"""A KV cache layer that appends in place: the eager runtime's target cache.

transformers' DynamicLayer appends a forward's keys and values with torch.cat, which copies every committed entry
of every layer into a new tensor on each forward. For the default target on 2 CPU cores (30 layers, 3 KV heads of
64 at a 300-token context) that is 2 x 30 copies of 230 KB per decoding step, read from memory the weights have
just evicted them from: torch.profiler put aten::cat at a third of a step's own operator time (~4.8 of ~12 ms; the
weight products run in the native kernel beside it). RoomyLayer keeps its keys and values as the first `length`
entries of buffers with room to spare, so a forward writes only its own n new entries; `keys` / `values` stay
ordinary tensors (prefix views of the buffers), so everything that reads or slices them (attention, the tree
commit of TargetModel.keep, crop) works unchanged, and attention reads the same values, bit for bit.

The room: what the caller reserves (TargetModel.prefill's `reserve`: the answer plus its largest tree), else
DEFAULT_ROOM; a cache that outgrows its buffers moves to larger ones (one copy, amortised: the new room is at
least half the length).
"""

from __future__ import annotations

import functools
import os

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

DEFAULT_ROOM = 64  # entries past the prompt when the caller reserves nothing (e.g. a data stage's one prefill)
# VLM_DRAFT_NAS_ROOMY_KV=off: transformers' own DynamicLayer (torch.cat per forward), for A/B benches
ENABLED = os.environ.get("VLM_DRAFT_NAS_ROOMY_KV", "on").strip().lower() not in ("off", "0")


class RoomyLayer(DynamicLayer):
    """A DynamicLayer whose update writes the new entries into preallocated buffers (B, H, capacity, D)."""

    def __init__(self, room: int = DEFAULT_ROOM):
        super().__init__()
        self.room = max(1, int(room))
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    def _holds(self, needed: int) -> bool:
        """Whether keys/values are still prefix views of the buffers (keep, crop and slicing keep them so; anything
        that replaced them with new tensors did not) and the buffers hold `needed` entries."""
        buf = self._kbuf
        if buf is None or needed > buf.shape[-2]:
            return False
        return all(t.data_ptr() == b.data_ptr() and t.stride() == b.stride() and t.shape[:2] == b.shape[:2]
                   for t, b in ((self.keys, self._kbuf), (self.values, self._vbuf)))

    def _grow(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New buffers for `needed` entries and room after them; the current entries copied in."""
        length = self.get_seq_length()
        capacity = needed + max(self.room, needed // 2)
        bufs = []
        for old, new in ((self.keys, key_states), (self.values, value_states)):
            shape = (*new.shape[:-2], capacity, new.shape[-1])  # (B, H, capacity, D)
            buf = torch.empty(shape, dtype=new.dtype, device=new.device)
            if length:
                buf[..., :length, :].copy_(old)
            bufs.append(buf)
        self._kbuf, self._vbuf = bufs
        self.keys, self.values = self._kbuf[..., :length, :], self._vbuf[..., :length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key_states / value_states (B, H, n, D) in place -> all keys and values (B, H, length + n, D)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, n = self.get_seq_length(), key_states.shape[-2]
        if not self._holds(length + n):
            self._grow(length + n, key_states, value_states)
        self._kbuf[..., length:length + n, :].copy_(key_states)
        self._vbuf[..., length:length + n, :].copy_(value_states)
        self.keys = self._kbuf[..., :length + n, :]
        self.values = self._vbuf[..., :length + n, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        super().reset()


def kind() -> str:
    """What roomy_cache makes: "roomy", or "dynamic" (VLM_DRAFT_NAS_ROOMY_KV=off)."""
    return "roomy" if ENABLED else "dynamic"


def roomy_cache(room: int | None = None) -> DynamicCache:
    """An empty DynamicCache whose layers (created as the model's layers first write) are RoomyLayers with
    `room` entries to spare (None: DEFAULT_ROOM); transformers' plain one where ENABLED is off."""
    cache = DynamicCache()
    if not ENABLED:
        return cache
    cache.layer_class_to_replicate = functools.partial(RoomyLayer, DEFAULT_ROOM if room is None else room)
    return cache
