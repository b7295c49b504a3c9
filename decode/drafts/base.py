"""The one interface every draft implements, and the bookkeeping shared by model-based drafts.

    draft.start(target, prompt, prefill)            once per generation, after the target's prefill
    tree = draft.propose(root, policy, sampling, g) a DraftTree rooted at the last emitted token
    draft.accept(path_tokens, path_hidden, bonus)   the verified outcome of that tree

path_tokens are the tokens the target committed this cycle (the root first), path_hidden the
target's hidden states at those nodes for the draft's feature layers ({layer: (m, H)}), bonus the
next root (emitted, not yet seen by the target).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from decode.arch import TreeSpec
from decode.loop.sampling import SamplingConfig, probs_from_logits
from decode.loop.tree import DraftTree, TreePolicy, build_tree

if TYPE_CHECKING:
    from decode.prompt import Prompt
    from decode.targets.target import PrefillOutput, TargetModel


class Draft(ABC):
    name: str = "draft"
    feature_layers: tuple[int, ...] = ()  # target layers whose hidden states the draft reads
    attention_stats: bool = False  # needs the target's attention statistics at prefill
    default_tree: TreeSpec = TreeSpec()

    def prefill_stats(self, prompt: "Prompt") -> bool:
        """Whether the prefill of `prompt` must return attention statistics (an eager-attention prefill over the
        whole cache: on the compiled runtime 2.1 s against 0.4 s): they only rank image tokens, so a prompt
        without an image never needs them."""
        return self.attention_stats and prompt.has_image

    def max_nodes(self, policy: TreePolicy) -> int:
        """The most nodes (root included) a tree of this draft can have under `policy`: the compiled runtime
        reserves cache room for it (more still works, at the cost of a larger cache and a recompilation)."""
        return policy.spec.total_tokens + 1

    def networks(self) -> tuple[torch.nn.Module, ...]:
        """The draft's own networks (not the target's), whose linear layers it runs with few-row inputs: a warm-up
        times their kernel choices (decode.runtime.small_rows) before any timed generation."""
        return ()

    def warm(self, policy: TreePolicy, widest: int | None = None, root_rows: int | None = None) -> list[int]:
        """Compiled runtime, after a generation: compile the draft's own steps for every level size a tree under
        `policy` (or levels of up to `widest` rows) may need, and root levels (committed pairs + the root) of up to
        `root_rows` rows, outside timed runs -> the level buckets compiled."""
        return []

    @abstractmethod
    def start(self, target: "TargetModel", prompt: "Prompt", prefill: "PrefillOutput") -> None: ...

    @abstractmethod
    def propose(
        self, root: int, policy: TreePolicy, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> DraftTree: ...

    def accept(self, path_tokens: list[int], path_hidden: dict[int, torch.Tensor], bonus: int) -> None:
        """Default: nothing to update."""


class TentativeSlots:
    """Maps tree node ids to tentative cache entries and builds their masks and depths, with tensor ops only
    (no per-node host work, nothing read back: see decode.loop.tree.build_tree).

    root_committed: the root's entry is already committed (neural drafts commit it, since its
    inputs are exact); otherwise the root is tentative slot 0 at depth 0.
    capacity: more than the largest node id the tree builder creates (TreePolicy.created_nodes()).
    """

    def __init__(self, root_committed: bool, capacity: int, device: torch.device | str = "cpu"):
        self.root_committed = root_committed
        self.device = torch.device(device)
        self.slot_of = torch.full((capacity,), -1, dtype=torch.long, device=self.device)  # node -> slot (-1: none)
        self.depth_of = torch.zeros(capacity, dtype=torch.long, device=self.device)  # node -> depth (root 0)
        self.anc = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # (M, M) ancestors-or-self over slots
        self.depths = torch.zeros(0, dtype=torch.long, device=self.device)  # (M,) slot depths

    def add(self, nodes: torch.Tensor, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """nodes (n,), parents (n,) long (-1: the root) -> tent_mask (n, M) bool over all M slots, q_depths (n,),
        k_depths (M,). A parent with no slot (the committed root) contributes no ancestors."""
        nodes, parents = nodes.to(self.device), parents.to(self.device)
        n, start = nodes.numel(), self.depths.numel()
        has_parent = parents >= 0
        pslot = torch.where(has_parent, self.slot_of[parents.clamp(min=0)], -1)  # (n,)
        if start:
            inherited = self.anc[pslot.clamp(min=0)] & (pslot >= 0)[:, None]  # (n, start): the parent's row
        else:
            inherited = torch.zeros(n, 0, dtype=torch.bool, device=self.device)
        rows = torch.cat([inherited, torch.eye(n, dtype=torch.bool, device=self.device)], dim=1)  # (n, start + n)
        q_depths = torch.where(has_parent, self.depth_of[parents.clamp(min=0)] + 1, 0)
        self.slot_of[nodes] = torch.arange(start, start + n, device=self.device)
        self.depth_of[nodes] = q_depths
        grown = torch.zeros(start, n, dtype=torch.bool, device=self.device)
        self.anc = torch.cat([torch.cat([self.anc, grown], dim=1), rows])
        self.depths = torch.cat([self.depths, q_depths])
        return rows, q_depths, self.depths


class _Scorer:
    """Adapts a draft's raw logits to the log-probs the tree builders rank and sample by."""

    def __init__(self, logits_fn, sampling: SamplingConfig, sample: bool):
        self.logits_fn, self.sampling, self.sample = logits_fn, sampling, sample

    def score(self, nodes: list[int], tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        logits = self.logits_fn(nodes, tokens, parents).float()  # (n, V)
        if self.sample:  # sampled candidates: the draft's q with the same temperature/top-p as the target
            return probs_from_logits(logits, self.sampling).log()
        return torch.log_softmax(logits, dim=-1)


class ModelDraft(Draft):
    """A draft that scores tree nodes with a network: implement _begin/_node_logits/_end."""

    def propose(self, root, policy, sampling, generator):
        device = self._device()
        self._begin(root, policy.created_nodes(), device)
        try:
            scorer = _Scorer(self._node_logits, sampling, policy.candidates == "sample")
            return build_tree(scorer, root, policy, generator, device)
        finally:
            self._end()

    @abstractmethod
    def _device(self) -> torch.device:
        """Where the draft runs: its trees are built there."""

    @abstractmethod
    def _begin(self, root: int, capacity: int, device: torch.device) -> None:
        """A new proposal whose builder creates fewer than `capacity` nodes, on `device`."""

    @abstractmethod
    def _node_logits(self, nodes: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Feed nodes (n,) with tokens (n,) under parents (n,) (device tensors, the root's call first) -> (n, V)."""

    @abstractmethod
    def _end(self) -> None: ...
