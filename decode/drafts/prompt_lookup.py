"""Prompt-lookup draft: continue the latest n-gram match found in the prompt and output so far.

As in HF prompt-lookup decoding: take the last n tokens (n from max_ngram down to 1), find their
most recent earlier occurrence, and propose the tokens that followed it. With top_k > 1 the
continuations of up to top_k distinct matches are merged into a trie (a static tree), capped
at total_tokens nodes and tree_depth levels. Proposals are deterministic (point-mass verification).
"""

from __future__ import annotations

import torch

from decode.arch import TreeSpec
from decode.drafts.base import Draft
from decode.tree import DraftTree


class PromptLookupDraft(Draft):
    name = "prompt-lookup"
    default_tree = TreeSpec(tree_depth=8, top_k=1, total_tokens=8)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.seq: list[int] = []

    def start(self, target, prompt, prefill) -> None:
        self.seq = prompt.input_ids[0].tolist()

    def accept(self, path_tokens, path_hidden, bonus) -> None:
        self.seq.extend(path_tokens)

    def continuations(self, seq: list[int], depth: int, limit: int) -> list[list[int]]:
        """Up to `limit` distinct continuations of the longest matching suffix n-grams, newest first."""
        found: list[list[int]] = []
        n_seq = len(seq)
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            suffix = seq[n_seq - n :]
            for start in range(n_seq - n - 1, -1, -1):  # most recent earlier occurrence first
                if seq[start : start + n] == suffix:
                    cont = seq[start + n : start + n + depth]
                    if cont and cont not in found:
                        found.append(cont)
                        if len(found) >= limit:
                            return found
            if found:
                return found
        return found

    def propose(self, root, policy, sampling, generator) -> DraftTree:
        spec = policy.spec
        seq = self.seq + [root]
        conts = self.continuations(seq, spec.tree_depth, 1 if policy.kind == "chain" else spec.top_k)
        tokens, parents = [root], [-1]
        child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node: the trie
        for cont in conts:
            node = 0
            for tok in cont:
                if (node, tok) not in child:
                    if len(tokens) - 1 >= spec.total_tokens:
                        break
                    tokens.append(tok)
                    parents.append(node)
                    child[(node, tok)] = len(tokens) - 1
                node = child[(node, tok)]
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))
