"""A neural draft's tree and prompt-lookup continuations, merged into one tree and verified in one forward.

The two sources are complementary: lookup is right on copied spans (code, quotes, names repeated
from the prompt), the neural draft on new text. Each cycle the neural draft builds its tree (its
own TreeSpec, from the policy) and lookup its trie (its own LookupSpec: n-gram sizes, branch
length, branches, node cap); the lookup trie is grafted onto the neural tree with shared prefixes
merged (decode.loop.tree.graft). The merged tree therefore contains both trees whole: greedy
verification accepts exactly the longer of the two accepted paths (what nas.treesweep replays),
and the verify forward holds |neural| + |lookup| - |shared| + 1 tokens; cycles where lookup finds
no match cost what the neural draft alone costs.

Lossless under greedy and sampling: every node is a deterministic candidate (point-mass rule in
decode.loop.verify); sampled neural candidates are refused (their q rule needs all siblings drawn from q).
"""

from __future__ import annotations

from decode.drafts.base import Draft
from decode.drafts.prompt_lookup import LookupSpec, PromptLookupDraft
from decode.errors import UserError
from decode.loop.tree import DraftTree, graft
from decode.runtime.draft_step import DRAFT_BUCKETS

RULES = ("union", "switch")


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
        look = self.lookup.lookup_tree(root, self.lookup.spec.tree)
        if self.rule == "switch" and look.size > 1:
            return look
        return graft(self.neural.propose(root, policy, sampling, generator), look)

    def accept(self, path_tokens, path_hidden, bonus) -> None:
        self.neural.accept(path_tokens, path_hidden, bonus)
        self.lookup.accept(path_tokens, path_hidden, bonus)

