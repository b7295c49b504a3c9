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
    """Maps tree node ids to tentative cache entries and builds their masks and depths.

    root_committed: the root's entry is already committed (neural drafts commit it, since its
    inputs are exact); otherwise the root is tentative slot 0 at depth 0.
    """

    def __init__(self, root_committed: bool):
        self.root_committed = root_committed
        self.slot_of: dict[int, int] = {}
        self.depth_of: dict[int, int] = {0: 0}
        self.anc: list[torch.Tensor] = []  # per slot: bool row over slots (ancestors incl. itself)
        self.depths: list[int] = []

    def add(self, nodes: list[int], parents: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> tent_mask (n, M) bool over all M slots, q_depths (n,), k_depths (M,)."""
        start = len(self.depths)
        total = start + len(nodes)
        rows = []
        for i, (node, parent) in enumerate(zip(nodes, parents)):
            row = torch.zeros(total, dtype=torch.bool)
            if parent in self.slot_of:
                prev = self.anc[self.slot_of[parent]]
                row[: prev.numel()] = prev
            row[start + i] = True
            depth = 0 if parent < 0 else self.depth_of[parent] + 1
            self.slot_of[node] = start + i
            self.depth_of[node] = depth
            self.depths.append(depth)
            rows.append(row)
        self.anc = [torch.cat([a, torch.zeros(total - a.numel(), dtype=torch.bool)]) for a in self.anc] + rows
        q_depths = torch.tensor(self.depths[start:], dtype=torch.long)
        return torch.stack(rows), q_depths, torch.tensor(self.depths, dtype=torch.long)


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
        self._begin(root)
        try:
            scorer = _Scorer(self._node_logits, sampling, policy.candidates == "sample")
            return build_tree(scorer, root, policy, generator)
        finally:
            self._end()

    @abstractmethod
    def _begin(self, root: int) -> None: ...

    @abstractmethod
    def _node_logits(self, nodes: list[int], tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _end(self) -> None: ...
