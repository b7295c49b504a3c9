"""Prompt-lookup draft: continue the latest n-gram match found in the prompt and output so far.

Take the last n tokens of the history (root included), n from max_ngram down to min_ngram, find
their earlier occurrences, newest first, and propose the tokens that followed. With top_k > 1 the
continuations of up to top_k distinct matches are merged into a trie (a static tree), capped at
total_tokens nodes and tree_depth levels. Proposals are deterministic (point-mass verification).

Which match: the newest occurrence of the longest matching n-gram whose continuation is at least
as long as any other found for that n (a match right before the end of the history has only a
one- or two-token continuation; an older match of the same n-gram usually continues further), so
a long copied span is proposed whole. The history is indexed once per generation (n-gram ->
positions), so a proposal costs O(matches), not O(history).

How far: tree_depth tokens after a match of the longest n-gram size (max_ngram), and weak_depth tokens
(when set) after a shorter one. A one- or two-token match is often a coincidence (a common word), and
every proposed token costs verification; a full-size match is usually a copied span worth proposing far.
The branch length still depends on the history only, so the search's per-root replay stays exact.

Corpus lookup: with a corpus (decode/drafts/corpus.py, an n-gram model of many answers) and corpus_depth > 0, a
branch of that many tokens drafted from the corpus joins the trie (shared prefixes merged, room of its own): it
finds the stock phrasing of answers that the prompt does not hold. With corpus_second > 0 a second corpus branch of
that many tokens joins too: the corpus's runner-up next token, then greedy (NgramCorpus.branches).

Leaf chains (merged with a neural draft only, decode/drafts/merged.py): with leaf_depth > 0 a corpus chain of that
many tokens hangs under each of the neural tree's leaf_count best leaves. The neural draft, which reads the target's
features, picks the first tokens; the corpus continues the stock phrase they begin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from decode.arch import TreeSpec
from decode.drafts.base import Draft
from decode.errors import UserError
from decode.loop.tree import DraftTree

if TYPE_CHECKING:
    from decode.drafts.corpus import NgramCorpus


@dataclass(frozen=True)
class LookupSpec:
    """Prompt-lookup settings: n-gram sizes tried (longest first) and the trie it proposes."""

    max_ngram: int = 3
    min_ngram: int = 1
    tree_depth: int = 8  # branch length: tokens proposed after a match
    top_k: int = 1  # branches: distinct matches merged into one trie
    total_tokens: int = 8  # trie nodes kept (the root excluded)
    weak_depth: int = 0  # branch length after a match shorter than max_ngram (0: tree_depth as well)
    corpus_depth: int = 0  # a corpus n-gram branch of this length beside the trie (decode/drafts/corpus.py); 0: none
    corpus_second: int = 0  # a second corpus branch (the runner-up first token) of this length; 0: none
    leaf_depth: int = 0  # merged with a neural draft: a corpus chain of this length under each of the neural tree's
    leaf_count: int = 0  # `leaf_count` best leaves (decode/drafts/merged.py); 0 and 0: none

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise UserError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}..{self.max_ngram}")
        TreeSpec(self.tree_depth, self.top_k, self.total_tokens)  # validates the tree fields
        if self.corpus_depth < 0:
            raise UserError(f"prompt lookup needs corpus_depth >= 0, got {self.corpus_depth}")
        if not 0 <= self.corpus_second <= self.corpus_depth:
            raise UserError(f"prompt lookup needs 0 <= corpus_second <= corpus_depth, got {self.corpus_second} "
                            f"(corpus_depth {self.corpus_depth})")
        if self.leaf_depth < 0 or self.leaf_count < 0 or (self.leaf_depth > 0) != (self.leaf_count > 0):
            raise UserError(f"prompt lookup's leaf chains need leaf_depth and leaf_count both > 0 (or both 0), got "
                            f"{self.leaf_depth} and {self.leaf_count}")
        if not 0 <= self.weak_depth <= self.tree_depth:
            raise UserError(f"prompt lookup needs 0 <= weak_depth <= tree_depth, got {self.weak_depth} "
                            f"(tree_depth {self.tree_depth})")

    @property
    def nodes(self) -> int:
        """Nodes a proposal may hold beside the root: the trie's, the corpus branches' and the leaf chains'."""
        return self.total_tokens + self.corpus_depth + self.corpus_second + self.leaf_depth * self.leaf_count

    @property
    def uses_corpus(self) -> bool:
        """Whether drafting needs the corpus: corpus branches at the root or chains under neural leaves."""
        return self.corpus_depth > 0 or self.leaf_depth > 0

    @property
    def tree(self) -> TreeSpec:
        return TreeSpec(self.tree_depth, self.top_k, self.total_tokens)

    @classmethod
    def from_dict(cls, d: dict) -> "LookupSpec":
        known = {k: int(v) for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def trie(root: int, conts: list[list[int]], total_tokens: int, extra: list[list[int]] = ()) -> DraftTree:
    """A trie rooted at `root` over the continuations (shared prefixes merged), at most total_tokens nodes; the `extra`
    branches (the corpus's) are merged in after them, each with room of its own (at most its length in nodes more)."""
    return DraftTree.of_lists(*trie_nodes(root, conts, total_tokens, extra))


def trie_nodes(root: int, conts: list[list[int]], total_tokens: int,
               extra: list[list[int]] = ()) -> tuple[list[int], list[int], int]:
    """trie's nodes as lists: (tokens, parents, depth of the deepest node); the search's replay reads these at
    every root position of its held-out set, where building tensors took a third of the kinds table's time."""
    tokens, parents, depths = [root], [-1], [0]
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    cap = total_tokens
    for j, cont in enumerate(list(conts) + list(extra)):
        if j >= len(conts):
            cap = len(tokens) - 1 + len(cont)
        node = 0
        for tok in cont:
            if (node, tok) not in child:
                if len(tokens) - 1 >= cap:
                    break
                tokens.append(tok)
                parents.append(node)
                depths.append(depths[node] + 1)
                child[(node, tok)] = len(tokens) - 1
            node = child[(node, tok)]
    return tokens, parents, max(depths)


class NgramIndex:
    """Positions of every n-gram (n in min..max) of a growing token history."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.seq: list[int] = []
        self.where: dict[tuple[int, ...], list[int]] = {}  # n-gram -> start positions, increasing

    def extend(self, tokens: list[int]) -> None:
        for tok in tokens:
            self.seq.append(tok)
            end = len(self.seq)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.where.setdefault(tuple(self.seq[end - n:]), []).append(end - n)

    def match(self, root: int) -> tuple[int, list[int]]:
        """(n, start positions) of the longest n-gram (max_n down to min_n) ending in history + [root] that occurred
        before, or (0, []). The positions list is the index's own (it grows with extend): read it before extending."""
        hist = self.seq
        end = len(hist) + 1
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            starts = self.where.get((*hist[end - n:], root))
            if starts:  # the root is not indexed: every occurrence ends before the suffix itself
                return n, starts
        return 0, []

    def continuations(self, root: int, depth: int, limit: int, weak_depth: int = 0) -> list[list[int]]:
        """Up to `limit` distinct continuations of the history + [root], best first (module docstring), of at
        most `depth` tokens, or `weak_depth` (when > 0) after a match shorter than max_n."""
        n, starts = self.match(root)
        return pick_continuations(self.seq, len(self.seq), root, n, starts, self.max_n, depth, limit, weak_depth)


def pick_continuations(seq: list[int], r: int, root: int, n: int, starts, max_n: int, depth: int, limit: int,
                       weak_depth: int = 0) -> list[list[int]]:
    """NgramIndex.continuations from its match (n, starts) at root position r: seq[:r] is the history (seq may go on
    past it: the search's replay passes whole held-out sequences), `root` follows it. Shared by the draft and the
    search's replay (nas/kinds.py), which matches once per n-gram range and picks once per branch shape."""
    if not n:
        return []
    if n < max_n and weak_depth:
        depth = min(depth, weak_depth)
    found: list[list[int]] = []
    full = 0
    for s in reversed(starts):  # newest first
        a, b = s + n, s + n + depth
        cont = seq[a:min(b, r)] + ([root] if b > r >= a else [])  # history + [root], sliced
        if cont and cont not in found:
            found.append(cont)
            full += len(cont) == depth
            if full == limit:  # `limit` full-length ones, newest first: what the sort below would keep
                break
    best = max((len(c) for c in found), default=0)
    found.sort(key=lambda c: len(c) < best)  # stable: full-length newest first, then the rest
    return found[:limit]


def lookup_trie(index: NgramIndex, root: int, spec: LookupSpec, tree: TreeSpec, top_k: int,
                corpus: "NgramCorpus | None" = None, branches: list[list[int]] | None = None) -> DraftTree:
    """Lookup's proposal at `root` after the history `index` holds (lookup_nodes) as a DraftTree."""
    return DraftTree.of_lists(*lookup_nodes(index, root, spec, tree, top_k, corpus, branches))


def lookup_nodes(index: NgramIndex, root: int, spec: LookupSpec, tree: TreeSpec, top_k: int,
                 corpus: "NgramCorpus | None" = None,
                 branches: list[list[int]] | None = None) -> tuple[list[int], list[int], int]:
    """Lookup's proposal at `root` after the history `index` holds, as trie_nodes' lists: the trie of up to `top_k`
    continuations (tree's depth and node cap) and, with a corpus and spec.corpus_depth, the corpus's branches beside
    it (`branches`: those computed already by NgramCorpus.branches, at least as deep as the spec asks). The one
    function both the draft (lookup_trie) and the search's replay (nas/kinds.py) call, so the replay is exact."""
    conts = index.continuations(root, tree.tree_depth, top_k, spec.weak_depth)
    if spec.corpus_depth and branches is None and corpus is not None:
        branches = corpus.branches(index.seq[-corpus.max_n:] + [root], spec.corpus_depth, spec.corpus_second)
    return proposal_nodes(root, conts, spec, tree.total_tokens, branches)


def proposal_nodes(root: int, conts: list[list[int]], spec: LookupSpec, total_tokens: int,
                   branches: list[list[int]] | None) -> tuple[list[int], list[int], int]:
    """lookup_nodes from the continuations picked already: their trie, and with spec.corpus_depth the corpus branches
    (`branches`, None: none) beside it."""
    extra: list[list[int]] = []
    if spec.corpus_depth and branches is not None:
        extra = [branches[0][: spec.corpus_depth]] + [b[: spec.corpus_second] for b in branches[1:2]
                                                      if spec.corpus_second]
    return trie_nodes(root, conts, total_tokens, extra)


class PromptLookupDraft(Draft):
    """Prompt lookup; with a corpus (decode/drafts/corpus.py) and spec.corpus_depth > 0, corpus lookup beside it."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, spec: LookupSpec | None = None,
                 corpus: "NgramCorpus | None" = None):
        self.spec = spec or LookupSpec(max_ngram=max_ngram, min_ngram=min_ngram)
        if self.spec.uses_corpus and corpus is None:
            raise UserError("a lookup with corpus branches or leaf chains needs a corpus (corpus.safetensors in the "
                            "draft folder)")
        self.corpus = corpus if self.spec.uses_corpus else None
        self.default_tree = self.spec.tree
        self.index = NgramIndex(self.spec.min_ngram, self.spec.max_ngram)

    def max_nodes(self, policy) -> int:
        # the trie, the corpus branches (each with room of its own, see trie), the root
        return policy.spec.total_tokens + self.spec.corpus_depth + self.spec.corpus_second + 1

    def start(self, target, prompt, prefill) -> None:
        self.index = NgramIndex(self.spec.min_ngram, self.spec.max_ngram)
        self.index.extend(prompt.input_ids[0].tolist())

    def accept(self, path_tokens, path_hidden, bonus) -> None:
        self.index.extend(path_tokens)

    def lookup_tree(self, root: int, spec: TreeSpec, chain: bool = False) -> DraftTree:
        if chain:  # one path: the trie's best continuation only
            return lookup_trie(self.index, root, self.spec, spec, 1)
        return lookup_trie(self.index, root, self.spec, spec, spec.top_k, self.corpus)

    def propose(self, root, policy, sampling, generator) -> DraftTree:
        return self.lookup_tree(root, policy.spec, chain=policy.kind == "chain")
