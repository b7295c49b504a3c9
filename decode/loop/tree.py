"""Draft trees: the DraftTree container and the builders (chain, static, EAGLE-2 dynamic).

Node 0 of every tree is the *root*: the last emitted token, which the target has not seen yet.
The other nodes are draft guesses; parents come before children. The verify forward scores all
N nodes at once: node i's target logits predict the token after node i.

Builders talk to a draft through `NodeScorer.score(tokens, parents)`: feed these new nodes (their
parents are earlier node ids, -1 for the root) and return their next-token log-probabilities.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from decode.arch import TreeSpec
from decode.errors import UserError
from decode.loop.tree_mask import ancestor_mask, depths_from_mask


@dataclass
class DraftTree:
    tokens: torch.Tensor  # (N,) long, node 0 = root
    parents: torch.Tensor  # (N,) long, parents[0] = -1
    scores: torch.Tensor | None = None  # (N,) cumulative draft log-prob (root 0), for information
    dists: torch.Tensor | None = None  # (N, V) draft probs each node's children were *sampled* from
    sampled: bool = False  # children drawn without replacement from dists, in index order

    def __post_init__(self) -> None:
        self.tokens = self.tokens.reshape(-1).long()
        self.parents = self.parents.reshape(-1).long()
        if self.tokens.numel() != self.parents.numel() or int(self.parents[0]) != -1:
            raise ValueError("a DraftTree needs one parent per token and node 0 as the only root")
        if self.sampled and self.dists is None:
            raise ValueError("a sampled DraftTree needs the draft distributions")

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def mask(self) -> torch.Tensor:
        """(N, N) bool ancestor-or-self mask."""
        return ancestor_mask(self.parents)

    @property
    def depths(self) -> torch.Tensor:
        return depths_from_mask(self.mask)

    def children(self, node: int) -> list[int]:
        return (self.parents == node).nonzero().flatten().tolist()

    def truncated(self, max_depth: int) -> "DraftTree":
        """The sub-tree of nodes at depth <= max_depth (the loop never verifies more than it may emit)."""
        keep = (self.depths <= max_depth).nonzero().flatten()
        if keep.numel() == self.size:
            return self
        remap = torch.full((self.size,), -1, dtype=torch.long)
        remap[keep] = torch.arange(keep.numel())
        parents = self.parents[keep]
        parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        return DraftTree(
            tokens=self.tokens[keep], parents=parents,
            scores=None if self.scores is None else self.scores[keep],
            dists=None if self.dists is None else self.dists[keep.to(self.dists.device)],
            sampled=self.sampled,
        )


def root_only(root: int) -> DraftTree:
    return DraftTree(torch.tensor([root]), torch.tensor([-1]), scores=torch.zeros(1))


class NodeScorer(Protocol):
    def score(self, nodes: list[int], tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Feed new nodes (ids (n,), tokens (n,), parent ids (n,), -1 for the root) -> (n, V) log-probs."""


@dataclass(frozen=True)
class TreePolicy:
    """How to shape the tree: `dynamic` (EAGLE-2, from TreeSpec), `chain`, or a `static` branching list.

    candidates: "topk" picks each node's children deterministically (verified with the point-mass
    rule: lossless for any deterministic choice); "sample" draws them without replacement from
    the draft distribution (verified with the draft's q); only for chain/static shapes, whose
    shape does not depend on the drawn values (a value-dependent pruning would bias sampling).
    """

    kind: str = "dynamic"  # dynamic | chain | static
    spec: TreeSpec = TreeSpec()
    branching: tuple[int, ...] = ()  # static: children per node at each depth, e.g. (3, 2, 1)
    candidates: str = "topk"  # topk | sample

    def __post_init__(self) -> None:
        if self.kind not in ("dynamic", "chain", "static"):
            raise UserError(f"tree kind must be dynamic, chain or static:B1,B2,..., got '{self.kind}'")
        if self.kind == "static" and (not self.branching or min(self.branching) < 1):
            raise UserError("a static tree needs branching factors >= 1, e.g. static:3,2,1")
        if self.candidates not in ("topk", "sample"):
            raise UserError(f"candidates must be topk or sample, got '{self.candidates}'")
        if self.candidates == "sample" and self.kind == "dynamic":
            raise UserError("sampled candidates need a chain or static tree (dynamic pruning depends on the draws)")

    @classmethod
    def parse(cls, text: str | None, spec: TreeSpec, candidates: str = "topk") -> "TreePolicy":
        """'dynamic' | 'chain' | 'static:3,2,1' (None = dynamic with the draft's TreeSpec)."""
        text = (text or "dynamic").strip()
        if text.startswith("static:"):
            try:
                branching = tuple(int(v) for v in text.split(":", 1)[1].split(","))
            except ValueError:
                raise UserError(f"bad static tree '{text}'; use static:B1,B2,... with integers") from None
            return cls("static", spec, branching, candidates)
        return cls(text, spec, (), candidates)

    @property
    def levels(self) -> tuple[int, ...]:
        """Children per expanded node at each depth (chain/static)."""
        if self.kind == "chain":
            return (1,) * self.spec.tree_depth
        return self.branching

    def widest_level(self) -> int:
        """The most rows one level forward of a draft feeds under this policy: the top_k frontier nodes (dynamic) or
        one depth's nodes (chain/static), or the root level's pending pairs (up to depth + 1 accepted tokens) and
        the root (the compiled runtime compiles a level step for each size up to this)."""
        if self.kind == "dynamic":
            width, depth = self.spec.top_k, self.spec.tree_depth
        else:
            width, depth = max(math.prod(self.levels[: d + 1]) for d in range(len(self.levels))), len(self.levels)
        return max(width, depth + 2)


def _pick_children(logp: torch.Tensor, k: int, sample: bool, generator: torch.Generator | None) -> torch.Tensor:
    """(n, V) log-probs -> (n, k) token ids: top-k, or k draws without replacement (Gumbel-top-k, in draw order)."""
    k = min(k, logp.shape[-1])
    if not sample:
        return logp.topk(k, dim=-1).indices
    u = torch.rand(logp.shape, generator=generator, device=logp.device).clamp_(1e-20, 1.0)
    gumbel = -torch.log(-torch.log(u))
    keys = torch.where(torch.isfinite(logp), logp + gumbel, torch.full_like(logp, -float("inf")))
    return keys.topk(k, dim=-1).indices  # descending keys = the order of sequential draws


def build_tree(
    scorer: NodeScorer, root: int, policy: TreePolicy, generator: torch.Generator | None = None
) -> DraftTree:
    if policy.kind == "dynamic":
        return _build_dynamic(scorer, root, policy.spec)
    return _build_levels(scorer, root, policy.levels, policy.candidates == "sample", generator)


def _build_levels(
    scorer: NodeScorer, root: int, levels: tuple[int, ...], sample: bool, generator: torch.Generator | None
) -> DraftTree:
    """Chain/static: every node at depth d gets levels[d] children (top-k or sampled)."""
    tokens, parents, scores = [root], [-1], [0.0]
    dist_rows: dict[int, torch.Tensor] = {}
    frontier = [0]
    logp = scorer.score([0], torch.tensor([root]), torch.tensor([-1]))  # (1, V)
    for d, k in enumerate(levels):
        picks = _pick_children(logp, k, sample, generator)  # (n, k)
        new = []
        for row, node in enumerate(frontier):
            if sample:
                dist_rows[node] = logp[row].exp()
            for tok in picks[row].tolist():
                tokens.append(tok)
                parents.append(node)
                scores.append(scores[node] + float(logp[row, tok]))
                new.append(len(tokens) - 1)
        frontier = new
        if d + 1 < len(levels):
            logp = scorer.score(new, torch.tensor([tokens[i] for i in new]), torch.tensor([parents[i] for i in new]))
    dists = None
    if sample:
        vocab = next(iter(dist_rows.values())).numel()
        dists = torch.zeros(len(tokens), vocab)
        for node, row in dist_rows.items():
            dists[node] = row.cpu()
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores), dists, sample)


def _build_dynamic(scorer: NodeScorer, root: int, spec: TreeSpec) -> DraftTree:
    """EAGLE-2: expand the top_k best frontier nodes by top_k children per level, then keep the
    total_tokens best nodes overall by cumulative draft log-prob.

    Per level one draft forward over top_k nodes. Cumulative log-probs only decrease along a path,
    so the best nodes form a connected tree; ties are broken toward shallower, earlier nodes, and
    any missing ancestor is added so the result is always a tree.
    """
    k = spec.top_k
    tokens, parents, scores, depth = [root], [-1], [0.0], [0]
    logp = scorer.score([0], torch.tensor([root]), torch.tensor([-1]))  # (1, V)
    frontier = [0]
    for level in range(spec.tree_depth):
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        new = []
        for row, node in enumerate(frontier):
            for lp, tok in zip(top.values[row].tolist(), top.indices[row].tolist()):
                tokens.append(tok)
                parents.append(node)
                scores.append(scores[node] + lp)
                depth.append(level + 1)
                new.append(len(tokens) - 1)
        if level + 1 == spec.tree_depth:
            break
        frontier = heapq.nlargest(k, new, key=lambda i: (scores[i], -i))
        frontier.sort()
        logp = scorer.score(
            frontier, torch.tensor([tokens[i] for i in frontier]), torch.tensor([parents[i] for i in frontier])
        )
    candidates = range(1, len(tokens))
    best = heapq.nlargest(spec.total_tokens, candidates, key=lambda i: (scores[i], -depth[i], -i))
    chosen = set(best)
    for i in best:  # close under ancestors (only matters on exact ties)
        p = parents[i]
        while p > 0 and p not in chosen:
            chosen.add(p)
            p = parents[p]
    keep = [0] + sorted(chosen)  # creation order is topological
    remap = {old: new for new, old in enumerate(keep)}
    return DraftTree(
        tokens=torch.tensor([tokens[i] for i in keep]),
        parents=torch.tensor([-1] + [remap[parents[i]] for i in keep[1:]]),
        scores=torch.tensor([scores[i] for i in keep]),
    )


def graft(base: DraftTree, extra: DraftTree) -> DraftTree:
    """The union of two trees over the same root: `extra`'s nodes are added under `base` where their
    (parent, token) path is not there yet (shared prefixes merged, `base`'s nodes and order kept).

    Both trees must be deterministic proposals (point-mass verification): a sampled tree's children
    must all be draws from its q, which a grafted child is not.
    """
    if base.sampled or extra.sampled:
        raise UserError("sampled candidates cannot be merged with other drafts' nodes; use --candidates topk")
    if int(base.tokens[0]) != int(extra.tokens[0]):
        raise ValueError("graft needs two trees over the same root token")
    tokens, parents = base.tokens.tolist(), base.parents.tolist()
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if p >= 0}
    where = {0: 0}  # extra's node id -> merged node id
    for i, (p, t) in enumerate(zip(extra.parents.tolist(), extra.tokens.tolist())):
        if p < 0:
            continue
        key = (where[p], t)
        if key not in child:
            child[key] = len(tokens)
            tokens.append(t)
            parents.append(where[p])
        where[i] = child[key]
    if len(tokens) == base.size:
        return base
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))
