"""A neural draft's tree and prompt-lookup continuations, merged into one tree and verified in one forward.

The two sources are complementary: lookup is right on copied spans (code, quotes, names repeated
from the prompt), the neural draft on new text. Each cycle the neural draft builds its tree (its
own TreeSpec, from the policy) and lookup its trie (its own LookupSpec: n-gram sizes, branch
length, branches, node cap); the lookup trie is grafted onto the neural tree with shared prefixes
merged (decode.loop.tree.graft). The merged tree therefore contains both trees whole: greedy
verification accepts exactly the longer of the two accepted paths (what nas.treesweep replays),
and the verify forward holds |neural| + |lookup| - |shared| + 1 tokens; cycles where lookup finds
no match cost what the neural draft alone costs.

Leaf chains (LookupSpec.leaf_depth / leaf_count, with a corpus): before the lookup trie is grafted on, a corpus chain
(NgramCorpus.chain) hangs under each of the neural tree's leaf_count best leaves (by cumulative draft log-prob), read
after the history, the root and the leaf's own path. The neural draft, which sees the target's features, picks the
first tokens; the corpus continues the stock phrase they begin, for no draft forward. Replayed on the cpu scale's 168
held-out sequences with its fine-tuned one-token subnet (1x8/8) + lookup n<=2 8x2/16 + corpus 4+2 (union): tau
2.508 -> 2.739 with 6-token chains under all 8 leaves; priced on the stored H200 profile 1.91x -> 2.04x, on the
2-core CPU's a loss (every verified token costs 6-7% of a step there). The search tries them (nas/kinds.py).

Lossless under greedy and sampling: every node is a deterministic candidate (point-mass rule in
decode.loop.verify); sampled neural candidates are refused (their q rule needs all siblings drawn from q).
"""

from __future__ import annotations

import torch

from decode.drafts.base import Draft
from decode.drafts.prompt_lookup import LookupSpec, PromptLookupDraft
from decode.errors import UserError
from decode.loop.tree import DraftTree, graft
from decode.runtime.draft_step import DRAFT_BUCKETS

RULES = ("union", "switch")


def leaf_chains(tokens: list[int], parents: list[int], rank: list[int], count: int, depth: int,
                context: list[int], corpus) -> dict[int, list[int]]:
    """Leaf node -> the corpus chain hung under it (module docstring, "Leaf chains").

    rank: the tree's non-root nodes, best first (a node's parent is parents[node]; nodes of a larger tree not in
    rank are not part of it); the `count` best of them without a child in rank that the corpus can continue are
    the leaves extended (a leaf it knows nothing after is passed over), each by up to `depth` tokens of
    corpus.chain(context + the tokens from the root down to it); context: the history's tail and the root. The one
    function the draft and the search's replay (nas/kinds.py) both call."""
    inner = {parents[i] for i in rank}
    out: dict[int, list[int]] = {}
    for leaf in rank:
        if len(out) == count:
            break
        if leaf in inner:
            continue
        path, j = [], leaf
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        chain = corpus.chain(list(context) + path[::-1], depth)
        if chain:
            out[leaf] = chain
    return out


def with_leaf_chains(tree: DraftTree, tokens: list[int], parents: list[int], chains: dict[int, list[int]]) -> DraftTree:
    """The tree (its tokens and parents read back as lists) with each chain appended under its leaf (new nodes after
    the tree's own, parents first)."""
    if not chains:
        return tree
    tokens, parents = list(tokens), list(parents)
    for leaf, chain in chains.items():
        parent = leaf
        for tok in chain:
            tokens.append(tok)
            parents.append(parent)
            parent = len(tokens) - 1
    depth = None if tree.depth is None else tree.depth + max(len(c) for c in chains.values())
    return DraftTree.of_lists(tokens, parents, depth)


def rank_nodes(tree: DraftTree) -> list[int]:
    """Non-root nodes best first: higher cumulative draft log-prob, ties to the lower id (as the dynamic builder keeps
    them, and as nas/treesweep.py orders an expansion); by id when the tree has no scores."""
    if tree.scores is None:
        return list(range(1, tree.size))
    scores = tree.scores.tolist()
    return sorted(range(1, tree.size), key=lambda i: (-scores[i], i))


class MergedDraft(Draft):
    """rule "union": both trees whole in one verify; "switch": the lookup trie alone when lookup finds a
    match (the neural draft is not run that cycle: it catches up on the accepted tokens next time), the
    neural tree otherwise. Union accepts more, switch verifies and drafts less; the search picks."""

    def __init__(self, neural: Draft, lookup: LookupSpec = LookupSpec(), rule: str = "union", corpus=None):
        if rule not in RULES:
            raise UserError(f"merge rule must be one of {', '.join(RULES)}, got {rule!r}")
        self.neural, self.rule = neural, rule
        self.lookup = PromptLookupDraft(spec=lookup, corpus=corpus)  # corpus: an NgramCorpus for corpus_depth > 0
        self.name = f"{neural.name}+lookup" + ("" if rule == "union" else f"-{rule}")
        self.feature_layers = neural.feature_layers
        self.attention_stats = neural.attention_stats
        self.default_tree = neural.default_tree

    def networks(self) -> tuple:
        return self.neural.networks()

    def max_nodes(self, policy) -> int:
        return self.neural.max_nodes(policy) + self.lookup.spec.nodes  # both trees whole, one shared root

    def warm(self, policy, widest=None, root_rows=None) -> list[int]:
        # the neural root level also feeds the tokens the cycles since the draft last ran emitted: union runs it every
        # cycle (up to a lookup branch and a bonus more than its own tree's), switch not in lookup-only cycles, and a
        # run of those queues up any number (measured: a bucket compiled inside a timed generation made the compiled
        # designed draft's drafting 4.6x its eager time); every root bucket is compiled (more rows run eagerly)
        if root_rows is None:
            after_lookup = policy.widest_level() + self.lookup.spec.nodes + 1
            root_rows = DRAFT_BUCKETS[-1] if self.rule == "switch" else after_lookup
        return self.neural.warm(policy, widest, root_rows)

    def start(self, target, prompt, prefill) -> None:
        self.neural.start(target, prompt, prefill)
        self.lookup.start(target, prompt, prefill)

    def propose(self, root, policy, sampling, generator) -> DraftTree:
        if policy.candidates == "sample":
            raise UserError("a neural+lookup draft needs --candidates topk (sampled children cannot be merged)")
        spec = self.lookup.spec
        look = self.lookup.lookup_tree(root, spec.tree)
        if self.rule == "switch" and look.size > 1:
            return look
        tree = self.neural.propose(root, policy, sampling, generator)
        if spec.leaf_depth:
            corpus = self.lookup.corpus
            tokens, parents = torch.stack([tree.tokens, tree.parents.to(tree.tokens.device)]).tolist()
            context = self.lookup.index.seq[-corpus.max_n:] + [root]
            chains = leaf_chains(tokens, parents, rank_nodes(tree), spec.leaf_count, spec.leaf_depth, context, corpus)
            tree = with_leaf_chains(tree, tokens, parents, chains)
        return graft(tree, look)

    def accept(self, path_tokens, path_hidden, bonus) -> None:
        self.neural.accept(path_tokens, path_hidden, bonus)
        self.lookup.accept(path_tokens, path_hidden, bonus)

