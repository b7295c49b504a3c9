"""Lossless verification of a draft tree against the target's logits at every node.

Both functions return (path, bonus): path = accepted node ids from the root (node 0, always
accepted: the target itself chose it) down the tree, bonus = one more token drawn from the
target at the last accepted node. The emitted tokens of the cycle are tokens[path[1:]] + [bonus].
"""

from __future__ import annotations

import torch

from decode.loop.sampling import SamplingConfig, probs_from_logits
from decode.loop.tree import DraftTree


def _children_lists(tree: DraftTree) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(tree.size)]
    for i, p in enumerate(tree.parents.tolist()):
        if p >= 0:
            kids[p].append(i)
    return kids


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy: follow the child whose token is the target's argmax; stop when none is.

    logits: (N, V) target logits at the tree nodes. The output equals vanilla greedy decoding
    token for token because every accepted token *is* the target's argmax after its prefix.
    """
    pred = logits.argmax(-1).tolist()  # (N,) target's choice after each node
    tokens = tree.tokens.tolist()
    kids = _children_lists(tree)
    path, node = [0], 0
    while True:
        nxt = next((c for c in kids[node] if tokens[c] == pred[node]), None)
        if nxt is None:
            return path, pred[node]
        path.append(nxt)
        node = nxt


def verify_sampling(
    tree: DraftTree,
    logits: torch.Tensor,
    cfg: SamplingConfig,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Multi-candidate recursive rejection sampling down the tree (exactly the target's distribution).

    At a node with target distribution p (temperature/top-p applied as for vanilla sampling),
    try its children in order:

    * sampled children (tree.sampled: drawn without replacement from the draft's q at this node):
      accept child x with probability min(1, p(x) / q(x)); on rejection continue with the
      normalised residual p <- max(p - q, 0) / sum, and q <- q without x, renormalised (the next
      sibling was drawn from exactly that q). By induction each step outputs p, so the whole
      procedure does.
    * deterministic children (top-k, prompt lookup): q is a point mass on x, so the same rule
      reads: accept with probability p(x); on rejection p <- p with x zeroed, renormalised.

    An accepted child becomes the node (its own target distribution, its own children); when every
    child is rejected the bonus token is drawn from the final residual p.

    (The point-mass rule is exact for any candidate, however chosen; the q rule accepts more
    often when candidates really are draws from q.)
    """
    sampled = tree.sampled
    probs = probs_from_logits(logits, cfg)  # (N, V)
    tokens = tree.tokens.tolist()
    kids = _children_lists(tree)
    path, node = [0], 0
    while True:
        p = probs[node].clone()
        q = tree.dists[node].to(p.device).clone() if sampled else None
        accepted = None
        for c in kids[node]:
            x = tokens[c]
            r = float(torch.rand((), generator=generator, device=generator.device if generator else "cpu"))
            if sampled:
                qx = float(q[x])
                if qx > 0 and r < min(1.0, float(p[x]) / qx):
                    accepted = c
                    break
                residual = (p - q).clamp_(min=0)
                if float(residual.sum()) > 0:
                    p = residual / residual.sum()
                q[x] = 0
                if float(q.sum()) > 0:
                    q = q / q.sum()
            else:
                if r < float(p[x]):
                    accepted = c
                    break
                p[x] = 0
                p = p / p.sum()
        if accepted is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return path, bonus
        path.append(accepted)
        node = accepted


def verify(
    tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None
) -> tuple[list[int], int]:
    if cfg.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, logits, cfg, generator)
