"""Draft trees: the DraftTree container and the builders (chain, static, EAGLE-2 dynamic).

Node 0 of every tree is the *root*: the last emitted token, which the target has not seen yet.
The other nodes are draft guesses; parents come before children. The verify forward scores all
N nodes at once: node i's target logits predict the token after node i.

Builders talk to a draft through `NodeScorer.score(nodes, tokens, parents)`: feed these new nodes (their
parents are earlier node ids, -1 for the root) and return their next-token log-probabilities. Node ids, tokens
and parents are tensors on the draft's device and a builder never reads them back (see build_tree).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from decode.arch import TreeSpec
from decode.errors import UserError
from decode.loop.tree_mask import ancestor_mask, depths_from_mask, validate_parents


@dataclass
class DraftTree:
    tokens: torch.Tensor  # (N,) long, node 0 = root
    parents: torch.Tensor  # (N,) long, parents[0] = -1
    scores: torch.Tensor | None = None  # (N,) cumulative draft log-prob (root 0), for information
    dists: torch.Tensor | None = None  # (N, V) draft probs each node's children were *sampled* from
    sampled: bool = False  # children drawn without replacement from dists, in index order
    depth: int | None = None  # a bound on the deepest node's depth known to the builder (None: read the tree)

    def __post_init__(self) -> None:
        # shapes only: reading values would stall a GPU's queue once per tree (the builders make valid trees;
        # validate() checks one made elsewhere)
        self.tokens = self.tokens.reshape(-1).long()
        self.parents = self.parents.reshape(-1).long()
        if self.tokens.numel() != self.parents.numel() or self.tokens.numel() == 0:
            raise ValueError("a DraftTree needs one parent per token and at least the root")
        if self.sampled and self.dists is None:
            raise ValueError("a sampled DraftTree needs the draft distributions")

    @classmethod
    def of_lists(cls, tokens: list[int], parents: list[int], depth: int | None = None) -> "DraftTree":
        """A tree built on the host as lists (lookup tries, merged trees), on the CPU."""
        return cls(torch.tensor(tokens), torch.tensor(parents), depth=depth)

    def validate(self) -> "DraftTree":
        """Raise ValueError unless node 0 is the only root and parents come before children (reads the values)."""
        if int(self.parents[0]) != -1 or bool((self.parents[1:] < 0).any()):
            raise ValueError("a DraftTree needs node 0 as the only root")
        validate_parents(self.parents)
        return self

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """(N, N) bool ancestor-or-self mask (computed once per tree, on the tree's device)."""
        return ancestor_mask(self.parents, check=False)

    @functools.cached_property
    def depths(self) -> torch.Tensor:
        return depths_from_mask(self.mask)

    def children(self, node: int) -> list[int]:
        return (self.parents == node).nonzero().flatten().tolist()

    def truncated(self, max_depth: int) -> "DraftTree":
        """The sub-tree of nodes at depth <= max_depth (the loop never verifies more than it may emit)."""
        if self.depth is not None and self.depth <= max_depth:
            return self  # known without reading the tree back: every cycle but the last few of a generation
        keep = (self.depths <= max_depth).nonzero().flatten()
        if keep.numel() == self.size:
            return self
        remap = torch.full((self.size,), -1, dtype=torch.long, device=self.parents.device)
        remap[keep] = torch.arange(keep.numel(), device=keep.device)
        parents = self.parents[keep]
        parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        return DraftTree(
            tokens=self.tokens[keep], parents=parents,
            scores=None if self.scores is None else self.scores[keep],
            dists=None if self.dists is None else self.dists[keep.to(self.dists.device)],
            sampled=self.sampled, depth=max_depth,
        )


def root_only(root: int) -> DraftTree:
    return DraftTree(torch.tensor([root]), torch.tensor([-1]), scores=torch.zeros(1), depth=0)


class NodeScorer(Protocol):
    def score(self, nodes: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Feed new nodes (ids (n,), tokens (n,), parent ids (n,), -1 for the root; long tensors on the draft's
        device, the root's call first) -> (n, V) log-probs."""


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

    def created_nodes(self) -> int:
        """How many nodes (root included) a builder creates under this policy before any selection: node ids
        stay below it (a draft sizes its per-node buffers with it)."""
        if self.kind == "dynamic":
            k, depth = self.spec.top_k, self.spec.tree_depth
            return 1 + k + (depth - 1) * k * k
        return 1 + sum(math.prod(self.levels[: d + 1]) for d in range(len(self.levels)))

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
    scorer: NodeScorer, root: int, policy: TreePolicy, generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> DraftTree:
    """The draft tree of `policy` rooted at `root`, built on `device` (the draft's): node ids, tokens, parents and
    scores are device tensors and every selection (top-k, EAGLE-2 re-ranking) a tensor op, so that building a tree
    reads nothing back to the host (a GPU runs a whole cycle with one sync, the accepted length)."""
    if policy.kind == "dynamic":
        return _build_dynamic(scorer, root, policy.spec, torch.device(device))
    return _build_levels(scorer, root, policy.levels, policy.candidates == "sample", generator, torch.device(device))


def _root(root: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, tokens, parents) of the root level: node 0, token `root`, parent -1, each (1,) on `device`."""
    return (torch.zeros(1, dtype=torch.long, device=device), torch.tensor([root], device=device),
            torch.full((1,), -1, dtype=torch.long, device=device))


def _build_levels(
    scorer: NodeScorer, root: int, levels: tuple[int, ...], sample: bool, generator: torch.Generator | None,
    device: torch.device,
) -> DraftTree:
    """Chain/static: every node at depth d gets levels[d] children (top-k or sampled), numbered level by level
    (parent by parent, then in pick order: the order verification tries siblings in)."""
    ids, tokens, parents = _root(root, device)
    scores = torch.zeros(1, device=device)
    logp = scorer.score(ids, tokens, parents)  # (1, V)
    frontier = ids
    dist_nodes, dist_rows = [], []
    for d, k in enumerate(levels):
        k = min(k, logp.shape[-1])
        picks = _pick_children(logp, k, sample, generator)  # (n, k)
        if sample:
            dist_nodes.append(frontier)
            dist_rows.append(logp.exp())
        start = tokens.numel()
        new = torch.arange(start, start + frontier.numel() * k, device=device)
        tokens = torch.cat([tokens, picks.reshape(-1)])
        parents = torch.cat([parents, frontier.repeat_interleave(k)])
        scores = torch.cat([scores, (scores[frontier][:, None] + logp.float().gather(1, picks)).reshape(-1)])
        frontier = new
        if d + 1 < len(levels):
            logp = scorer.score(new, tokens[new], parents[new])
    dists = None
    if sample:  # (N, V): the q each node's children were drawn from (zero rows for leaves)
        dists = torch.zeros(tokens.numel(), logp.shape[-1], device=device)
        dists[torch.cat(dist_nodes)] = torch.cat(dist_rows).float()
    return DraftTree(tokens, parents, scores, dists, sample, depth=len(levels))


def _top_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, ties toward the lower index (a stable descending sort), in index order."""
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return order.sort().values


def _build_dynamic(scorer: NodeScorer, root: int, spec: TreeSpec, device: torch.device) -> DraftTree:
    """EAGLE-2: expand the top_k best frontier nodes by top_k children per level, then keep the
    total_tokens best nodes overall by cumulative draft log-prob.

    Per level one draft forward over top_k nodes. Cumulative log-probs never increase along a path and ties go
    to the lower node id (a parent's id is below its children's), so the best nodes always form a connected
    tree: a node is never chosen before its parent.
    """
    k = spec.top_k
    ids, tokens, parents = _root(root, device)
    scores = torch.zeros(1, device=device)
    frontier = ids
    logp = scorer.score(ids, tokens, parents)  # (1, V)
    for level in range(spec.tree_depth):
        top = logp.float().topk(min(k, logp.shape[-1]), dim=-1)  # (n, k) each, descending
        start, width = tokens.numel(), top.indices.numel()
        new = torch.arange(start, start + width, device=device)
        tokens = torch.cat([tokens, top.indices.reshape(-1)])
        parents = torch.cat([parents, frontier.repeat_interleave(top.indices.shape[1])])
        scores = torch.cat([scores, (scores[frontier][:, None] + top.values).reshape(-1)])
        if level + 1 == spec.tree_depth:
            break
        frontier = new[_top_rows(scores[new], k)]
        logp = scorer.score(frontier, tokens[frontier], parents[frontier])
    n = tokens.numel()
    best = _top_rows(scores[1:], spec.total_tokens) + 1  # node ids, ascending (= topological)
    keep = torch.cat([ids, best])
    remap = torch.full((n,), -1, dtype=torch.long, device=device)
    remap[keep] = torch.arange(keep.numel(), device=device)
    kept_parents = parents[keep]
    return DraftTree(
        tokens=tokens[keep],
        parents=torch.where(kept_parents >= 0, remap[kept_parents.clamp(min=0)], kept_parents),
        scores=scores[keep],
        depth=spec.tree_depth,
    )


def graft(base: DraftTree, extra: DraftTree) -> DraftTree:
    """The union of two trees over the same root: `extra`'s nodes are added under `base` where their
    (parent, token) path is not there yet (shared prefixes merged, `base`'s nodes and order kept).

    Both trees must be deterministic proposals (point-mass verification): a sampled tree's children
    must all be draws from its q, which a grafted child is not.
    """
    if base.sampled or extra.sampled:
        raise UserError("sampled candidates cannot be merged with other drafts' nodes; use --candidates topk")
    if extra.size == 1:  # nothing to add (a lookup without a match): no need to read the base tree back
        return base
    extra_tokens, extra_parents = extra.tokens.tolist(), extra.parents.tolist()
    tokens, parents = torch.stack([base.tokens, base.parents.to(base.tokens.device)]).tolist()  # one read
    if tokens[0] != extra_tokens[0]:
        raise ValueError("graft needs two trees over the same root token")
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if p >= 0}
    where = {0: 0}  # extra's node id -> merged node id
    for i, (p, t) in enumerate(zip(extra_parents, extra_tokens)):
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
    depth = None if base.depth is None or extra.depth is None else max(base.depth, extra.depth)
    return DraftTree.of_lists(tokens, parents, depth)
