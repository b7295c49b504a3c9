"""Greedy acceptance of every dynamic tree (depth, total_tokens) of one subnet and top_k, from one sweep.

Why this is exact. In the greedy replay (nas/acceptance.py) the draft's state at a root position r
depends only on r: the committed tokens before r and their *target* features (tentative tree nodes
are dropped after each proposal). An EAGLE-2 dynamic tree (decode/loop/tree.py `_build_dynamic`) grows
level by level, expanding the top_k best nodes of each level with top_k children, and only then keeps
the total_tokens best nodes (by cumulative log-prob, ties toward shallower and earlier nodes). So the
tree of (depth D, top_k k, total N) at root r is: the nodes of levels <= D of the depth-D_max expansion
at r (same nodes, same creation order, same scores), of which the best N are kept.

The sweep therefore builds, once per root position of every held-out sequence, the full depth-D_max
expansion (the draft then commits only the root and moves one position on), and any (D, N) is scored
afterwards without a draft forward: walk the roots r -> r + accepted + 1 exactly as the replay does.
One sweep costs about tau x D_max/D times one replay of a depth-D tree and serves every (D, N) pair,
which is what lets the search pick the best tree for each device (nas/objective.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from decode.arch import TreeSpec, max_tree_nodes
from decode.drafts.neural import NeuralDraft
from decode.loop.tree import TreePolicy
from nas.acceptance import GREEDY, Acceptance, start_replay


@dataclass
class Expansion:
    """The depth-D_max dynamic expansion at one root, nodes in creation order (node 0 = root)."""

    tokens: list[int]
    parents: list[int]
    depth: list[int]
    order: list[int]  # non-root nodes, best first: the order `_build_dynamic` keeps them in
    kids: dict[int, list[int]] = field(init=False, repr=False)  # node -> its children, from parents

    def __post_init__(self) -> None:
        self.kids = {}
        for i, p in enumerate(self.parents):
            if p >= 0:
                self.kids.setdefault(p, []).append(i)

    def kept(self, depth: int, total: int) -> set[int]:
        """Node ids of the (depth, total) tree: the `total` best of levels <= depth, closed under ancestors."""
        kept = set()
        for i in self.order:
            if len(kept) == total:
                break
            if self.depth[i] <= depth:
                kept.add(i)
        for i in list(kept):  # close under ancestors, as the builder does (only differs on exact ties)
            p = self.parents[i]
            while p > 0 and p not in kept:
                kept.add(p)
                p = self.parents[p]
        return kept

    def accepted(self, depth: int, total: int, cont: list[int], root: int, max_depth: int) -> int:
        """Draft tokens the greedy verify accepts for the (depth, total) tree, truncated at max_depth.

        cont[root + d] is the token expected at depth d below the root (cont[root] is the root itself).
        """
        return self.walk(self.kept(depth, total), depth, cont, root, max_depth)[0]

    def walk(self, kept: set[int], depth: int, cont: list[int], root: int, max_depth: int) -> tuple[int, int]:
        """(tokens accepted, the node the greedy walk ends at) in the tree of the `kept` nodes (levels <= depth)."""
        node, d = 0, 0
        limit = min(depth, max_depth, len(cont) - root - 1)
        while d < limit:
            want = cont[root + d + 1]
            nxt = next((c for c in self.kids.get(node, ()) if c in kept and self.tokens[c] == want), None)
            if nxt is None:
                break
            node, d = nxt, d + 1
        return d, node


def _expansion(tree) -> Expansion:
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    depth = tree.depths.tolist()
    scores = tree.scores.tolist()
    # the builder's ranking key: higher score, then shallower, then earlier
    order = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], depth[i], i))
    return Expansion(tokens, parents, depth, order)


@torch.no_grad()
def sweep_sequence(draft: NeuralDraft, seq: dict, prompt_len: int, num_layers: int, top_k: int,
                   max_depth: int) -> tuple[list[Expansion], list[int]]:
    """(expansion per root position p..t-2, expected tokens cont) for one FeatureData item."""
    ids = seq["input_ids"].tolist()
    t, p = len(ids), prompt_len
    hidden, cont = start_replay(draft, seq, p, num_layers)
    # every node of the expansion is kept: total_tokens at least what a depth-D_max tree can hold
    full = TreePolicy(spec=TreeSpec(tree_depth=max_depth, top_k=top_k, total_tokens=max_tree_nodes(max_depth, top_k)))
    out = []
    for r in range(p, t - 1):
        out.append(_expansion(draft.propose(ids[r], full, GREEDY, None)))
        if r + 1 < t - 1:
            draft.accept(ids[r:r + 1], {x: h[r:r + 1] for x, h in hidden.items()}, ids[r + 1])
    return out, cont


@dataclass
class TreeSweep:
    """Expansions of one subnet at one top_k over held-out sequences; `acceptance(D, N)` for any tree."""

    top_k: int
    max_depth: int
    sequences: list[tuple[int, list[Expansion], list[int]]]  # (prompt_len, expansions, cont)

    @classmethod
    def run(cls, draft: NeuralDraft, sequences, num_layers: int, top_k: int, max_depth: int) -> "TreeSweep":
        seqs = []
        for seq in sequences:
            p = int(seq["prompt_len"])
            exps, cont = sweep_sequence(draft, seq, p, num_layers, top_k, max_depth)
            seqs.append((p, exps, cont))
        return cls(top_k, max_depth, seqs)

    def acceptance(self, depth: int, total: int, max_new_tokens: int | None = None) -> Acceptance:
        """What nas.acceptance.estimate_tau gives for TreeSpec(depth, top_k, total), without a forward."""
        if not 1 <= depth <= self.max_depth:
            raise ValueError(f"tree depth {depth} outside the sweep's 1..{self.max_depth}")
        emitted = cycles = 0
        hist: Counter = Counter()
        for p, exps, cont in self.sequences:
            t = len(cont)
            limit = t - p if max_new_tokens is None else min(max_new_tokens, t - p)
            if limit < 1:
                continue
            e, c, r = 1, 0, p
            while e < limit:
                m = exps[r - p].accepted(depth, total, cont, r, limit - e - 1)
                c += 1
                hist[m] += 1
                e += m + 1
                r += m + 1
            emitted += min(e, limit) - 1
            cycles += c
        return Acceptance(tau=emitted / cycles if cycles else 1.0, cycles=cycles, emitted=emitted, hist=dict(hist))

    # ------------------------------------------------------------------ storage
    def save(self, path: str | Path) -> None:
        """One safetensors file (int tensors only); written atomically so a killed search leaves no half file."""
        tensors: dict[str, torch.Tensor] = {}
        for i, (p, exps, cont) in enumerate(self.sequences):
            tensors[f"{i}.prompt_len"] = torch.tensor([p])
            tensors[f"{i}.cont"] = torch.tensor(cont, dtype=torch.long)
            tensors[f"{i}.sizes"] = torch.tensor([len(e.tokens) for e in exps], dtype=torch.long)
            for name in ("tokens", "parents", "depth"):
                tensors[f"{i}.{name}"] = torch.tensor([v for e in exps for v in getattr(e, name)], dtype=torch.long)
            tensors[f"{i}.order"] = torch.tensor([v for e in exps for v in [0, *e.order]], dtype=torch.long)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"top_k": str(self.top_k), "max_depth": str(self.max_depth),
                                                "sequences": str(len(self.sequences))})
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "TreeSweep":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        t = load_file(str(path))
        seqs = []
        for i in range(int(meta["sequences"])):
            sizes = t[f"{i}.sizes"].tolist()
            cols = {name: t[f"{i}.{name}"].tolist() for name in ("tokens", "parents", "depth", "order")}
            exps, at = [], 0
            for n in sizes:
                sl = slice(at, at + n)
                exps.append(Expansion(cols["tokens"][sl], cols["parents"][sl], cols["depth"][sl], cols["order"][sl][1:]))
                at += n
            seqs.append((int(t[f"{i}.prompt_len"][0]), exps, t[f"{i}.cont"].tolist()))
        return cls(int(meta["top_k"]), int(meta["max_depth"]), seqs)
