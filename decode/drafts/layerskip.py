"""Layer-skip self-draft: the target's first K layers + its final norm and LM head (no training).

Its committed KV is the target's own (the first K layers see the same inputs), so it costs no
catch-up forward, only K/L of a target step per drafted token; it pays when the early exit agrees
with the full model often, which on small targets it rarely does (nas.kinds prices it per device).
"""

from __future__ import annotations

import torch

from decode.arch import TreeSpec
from decode.drafts.base import ModelDraft, TentativeSlots


class LayerSkipDraft(ModelDraft):
    def __init__(self, num_layers: int, tree: TreeSpec | None = None):
        """tree: its default tree (the search exports a chain of the depth it picked)."""
        self.k = num_layers
        self.name = f"layerskip:{num_layers}"
        if tree is not None:
            self.default_tree = tree
        self.target = None
        self.cache = None
        self.slots: TentativeSlots | None = None

    def start(self, target, prompt, prefill) -> None:
        if not 1 <= self.k < target.num_layers:
            from decode.errors import UserError

            raise UserError(f"layerskip:K needs 1 <= K < {target.num_layers} (the target's layers), got {self.k}")
        self.target = target

    def _device(self) -> torch.device:
        return self.target.device

    def _begin(self, root: int, capacity: int, device: torch.device) -> None:
        # the target's first K layers hold exactly this draft's committed KV: copy, no catch-up
        self.cache = self.target.prefix_cache(self.k)
        self.slots = TentativeSlots(root_committed=False, capacity=capacity, device=device)

    def _node_logits(self, nodes, tokens, parents) -> torch.Tensor:
        tent_mask, q_depths, k_depths = self.slots.add(nodes, parents)
        return self.target.forward_prefix(self.k, self.cache, tokens, tent_mask, q_depths, k_depths)

    def _end(self) -> None:
        self.cache = None
        self.slots = None
