"""Tree construction: masks/depths/positions vs brute force, builders' shapes and EAGLE-2 selection."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_prompt, tiny_target

from decode.arch import TreeSpec
from decode.errors import UserError
from decode.loop.tree import DraftTree, TreePolicy, build_tree
from decode.loop.tree_mask import ancestor_mask, depths_from_mask, tree_attention_allowed


def random_parents(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return torch.tensor(parents)


def brute_ancestors(parents: list[int]) -> tuple[list[set[int]], list[int]]:
    anc, depth = [], []
    for i in range(len(parents)):
        chain, node = {i}, parents[i]
        while node >= 0:
            chain.add(node)
            node = parents[node]
        anc.append(chain)
        depth.append(len(chain) - 1)
    return anc, depth


@pytest.mark.parametrize("seed", range(5))
def test_mask_depths_positions_match_brute_force(seed):
    parents = random_parents(12, seed)
    anc, depth = brute_ancestors(parents.tolist())
    mask = ancestor_mask(parents)
    for i, j in itertools.product(range(12), range(12)):
        assert bool(mask[i, j]) == (j in anc[i])
    assert depths_from_mask(mask).tolist() == depth
    # full attention pattern over 5 committed + 12 tree tokens, with and without a window of 3
    for window in (None, 3):
        allowed = tree_attention_allowed(mask, depths_from_mask(mask), depths_from_mask(mask), 5, window)
        for i in range(12):
            q_pos = 5 + depth[i]
            for k in range(17):
                k_pos, visible = (k, True) if k < 5 else (5 + depth[k - 5], (k - 5) in anc[i])
                if window is not None:
                    visible = visible and q_pos - k_pos < window
                assert bool(allowed[i, k]) == visible


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 9, 33, 130])
def test_ancestor_mask_deep_chains_and_forests(n):
    # a chain is the deepest tree (n - 1 levels): it needs every squaring step of the closure
    chain = torch.arange(n) - 1
    assert torch.equal(ancestor_mask(chain), torch.ones(n, n, dtype=torch.bool).tril())
    # a forest with several root-level tokens and random depths
    g = torch.Generator().manual_seed(n)
    forest = torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)])
    anc, depth = brute_ancestors(forest.tolist())
    want = torch.tensor([[j in anc[i] for j in range(n)] for i in range(n)])
    mask = ancestor_mask(forest)
    assert torch.equal(mask, want)
    assert depths_from_mask(mask).tolist() == depth


def test_target_masks_agree_with_reference_for_hybrid_layers():
    target = tiny_target("tiny-gemma3-text")  # sliding + full layers
    parents = random_parents(6, 1)
    mask = ancestor_mask(parents)
    d = depths_from_mask(mask)
    masks = target._masks(mask, d, d, 10)
    assert set(masks) == {"sliding_attention", "full_attention"}
    full = masks["full_attention"][0, 0] == 0
    slide = masks["sliding_attention"][0, 0] == 0
    assert bool((full == tree_attention_allowed(mask, d, d, 10, None)).all())
    assert bool((slide == tree_attention_allowed(mask, d, d, 10, target.text_config.sliding_window)).all())
    assert bool((slide <= full).all()) and not bool((slide == full).all())


def test_truncated_keeps_shallow_nodes_and_reindexes():
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    tree = DraftTree(torch.arange(6) + 10, parents, scores=torch.arange(6).float())
    t1 = tree.truncated(1)
    assert t1.tokens.tolist() == [10, 11, 12] and t1.parents.tolist() == [-1, 0, 0]
    t2 = tree.truncated(2)
    assert t2.tokens.tolist() == [10, 11, 12, 13, 15] and t2.parents.tolist() == [-1, 0, 0, 1, 2]
    assert tree.truncated(9) is tree


class TableScorer:
    """Deterministic fake draft: log-probs depend on (parent token, depth) through a fixed table."""

    def __init__(self, vocab: int = 11, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.log_softmax(torch.randn(vocab, 8, vocab, generator=g) * 2, dim=-1)
        self.depth: dict[int, int] = {}
        self.calls: list[int] = []

    def score(self, nodes, tokens, parents):
        rows = []
        for node, tok, par in zip(nodes.tolist(), tokens.tolist(), parents.tolist()):
            d = 0 if par < 0 else self.depth[par] + 1
            self.depth[node] = d
            rows.append(self.table[tok, d])
        self.calls.append(len(nodes))
        return torch.stack(rows)


def reference_dynamic(scorer_table: torch.Tensor, root: int, spec: TreeSpec) -> list[tuple[float, tuple[int, ...]]]:
    """EAGLE-2 by brute force over token paths: expand the top_k best frontier paths per level, rank all."""
    k = spec.top_k
    cands: list[tuple[float, tuple[int, ...]]] = []
    frontier = [(0.0, (root,))]
    for level in range(spec.tree_depth):
        new = []
        for score, path in frontier:
            lp = scorer_table[path[-1], len(path) - 1]
            top = lp.topk(k)
            new += [(score + float(v), path + (int(t),)) for v, t in zip(top.values, top.indices)]
        cands += new
        frontier = sorted(new, key=lambda c: -c[0])[:k]
    return sorted(cands, key=lambda c: -c[0])[: spec.total_tokens]


@pytest.mark.parametrize("spec", [TreeSpec(3, 2, 5), TreeSpec(4, 3, 10), TreeSpec(5, 4, 30), TreeSpec(2, 1, 2)])
def test_dynamic_tree_matches_brute_force_eagle2(spec):
    scorer = TableScorer()
    tree = build_tree(scorer, 3, TreePolicy("dynamic", spec))
    assert tree.size == spec.total_tokens + 1
    assert scorer.calls == [1] + [spec.top_k] * (spec.tree_depth - 1)  # one draft forward per level
    anc, _ = brute_ancestors(tree.parents.tolist())
    got = set()
    for i in range(1, tree.size):
        path = tuple(tree.tokens[sorted(anc[i], key=lambda n: len(anc[n]))].tolist())
        got.add(path)
    want = {p for _, p in reference_dynamic(scorer.table, 3, spec)}
    assert got == want
    assert bool((tree.parents[1:] < torch.arange(1, tree.size)).all())


def test_static_and_chain_shapes():
    scorer = TableScorer()
    tree = build_tree(scorer, 1, TreePolicy.parse("static:3,2,1", TreeSpec()))
    assert tree.size == 1 + 3 + 6 + 6
    assert tree.depths.bincount().tolist() == [1, 3, 6, 6]
    assert scorer.calls == [1, 3, 6]
    chain = build_tree(TableScorer(), 1, TreePolicy.parse("chain", TreeSpec(tree_depth=4)))
    assert chain.parents.tolist() == [-1, 0, 1, 2, 3]


def test_sampled_static_tree_draws_distinct_children_with_dists():
    scorer = TableScorer()
    g = torch.Generator().manual_seed(0)
    tree = build_tree(scorer, 1, TreePolicy.parse("static:4,2", TreeSpec(), "sample"), g)
    assert tree.sampled and tree.dists.shape == (tree.size, 11)
    for node in range(tree.size):
        kids = tree.tokens[tree.children(node)].tolist()
        assert len(kids) == len(set(kids))
    torch.testing.assert_close(tree.dists[0].sum(), torch.tensor(1.0))


def test_bad_tree_settings():
    with pytest.raises(UserError):
        TreeSpec(tree_depth=0)
    with pytest.raises(UserError):
        TreeSpec(total_tokens=0)
    with pytest.raises(UserError):
        TreeSpec(top_k=0)
    with pytest.raises(UserError):
        TreePolicy.parse("static:2,x", TreeSpec())
    with pytest.raises(UserError):
        TreePolicy.parse("bushy", TreeSpec())
    with pytest.raises(UserError):
        TreePolicy.parse("dynamic", TreeSpec(), "sample")


def test_forward_tree_rejects_bad_trees():
    target = tiny_target("tiny-llama")
    target.prefill(tiny_prompt(target))
    with pytest.raises(ValueError):
        target.forward_tree(torch.tensor([1, 2]), torch.tensor([-1, 1]))  # parent not before child
