"""Every kind of draft scored on the same held-out replay and hardware profile, so the search can pick any.

    vanilla         plain decoding: 1.00x by definition
    prompt-lookup   n-gram lookup in the prompt and output so far (decode.drafts.prompt_lookup), over a grid
                    of LookupSpecs (n-gram sizes, branch length, branches); with a corpus (decode/drafts/corpus.py)
                    also corpus branches (CORPUS_BRANCHES, WIDE_CORPUS) beside them, alone and merged
    neural          a subnet of the supernet with its best tree for the device (the Optuna study's trials)
    neural+lookup   the neural tree and the lookup trie merged into one verified tree (decode.drafts.merged)
    layerskip       the target's first K layers (K a stored feature layer) drafting a chain of depth D

Why the replay is exact for lookup and merged trees too. Lookup's trie at a root position r depends only
on the tokens before r (its n-gram index grows token by token, whatever the cycle boundaries were), so
one trie per root position serves every walk. The merged tree holds the neural tree and the lookup trie
whole, so greedy verification accepts max(neural accepted, lookup accepted) at r, and it verifies
1 + |neural| + |lookup| - |shared prefixes| tokens. With the neural expansions of a tree sweep
(nas/treesweep.py) every (depth, total_tokens, LookupSpec) is scored without a draft forward.

Layer-skip chains replay exactly from the stored features too: every node that can be accepted lies on the
target's own continuation, where the first K layers compute exactly the stored hidden_states[K], so the
draft's proposal after position j is argmax(norm + LM head of hidden[K][j]) (TargetModel.exit_logits) and a
chain accepts while those equal the continuation. Its tokens cost K layers + the LM head each: priced as
that share of a measured target step (decoding one token is bound by the weights it reads) + the
profile's per-cycle overhead for a chain of depth D.

Leaf chains (decode/drafts/merged.py) replay exactly too: the chain under a leaf depends on the history, the root and
the leaf's path only, and the leaves extended are the kept tree's best by the same order the sweep stores
(Expansion.order); a greedy walk that ends at an extended leaf goes on along its chain.

Cost. Cycles differ in size (lookup often finds no match and verifies the root alone), so the predicted
speed-up is tau x T_step / mean cycle time over the replayed cycles, each cycle priced with the
profile's verify(n) for its own n, plus the neural draft's cycle and the lookup's own host time
(`lookup_ms`, measured on this host: it is Python work on the CPU whatever the accelerator).
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from decode.arch import DraftArch, max_tree_nodes
from decode.drafts.corpus import NgramCorpus
from decode.drafts.merged import RULES, leaf_chains
from decode.drafts.prompt_lookup import LookupSpec, NgramIndex, pick_continuations, proposal_nodes, trie
from hwprofile.latency import LatencyModel
from nas.acceptance import Acceptance
from nas.treesweep import Expansion, TreeSweep

# n-gram sizes x branch length x branches; total_tokens = length x branches (a full trie); plus long single
# branches after full-size matches only (one token after a shorter match): merged with a one-token neural draft
# (switch) this was the best design replayed on the 168 demo held-out sequences (tau 1.41, predicted 1.48x against
# 1.45x for the best point without it)
LOOKUP_GRID = tuple(LookupSpec(max_ngram=n, tree_depth=d, top_k=k, total_tokens=d * k)
                    for n in (2, 3) for d in (2, 4, 8) for k in (1, 2)) + tuple(
    LookupSpec(max_ngram=n, tree_depth=d, top_k=1, total_tokens=d, weak_depth=1) for n in (2, 3) for d in (4, 8))
# lookup alone tries more weak-match branch lengths (each merged point is replayed for every neural tree)
LOOKUP_ALONE_GRID = LOOKUP_GRID + tuple(
    LookupSpec(max_ngram=n, tree_depth=d, top_k=k, total_tokens=d * k, weak_depth=w)
    for n in (2, 3) for d in (4, 8) for k in (1, 2) for w in (1, 2) if (k, w) != (1, 1))
LAYERSKIP_DEPTHS = (1, 2, 3, 4)  # chain depths tried for the layer-skip self-draft
# corpus branches (decode/drafts/corpus.py) tried beside single-branch lookups of length 2 and 4, when the search has
# a corpus, as (first branch, second branch) lengths: on the 168 demo held-out sequences a 4-token corpus branch took
# lookup's replayed tau from 1.29 to 1.71; on the cpu scale's, a 2-token second branch beside it 1.83 -> 1.94
CORPUS_BRANCHES = ((2, 0), (4, 0), (2, 1), (4, 1), (4, 2))
# and the widest of them beside every other lookup of the grid (two branches, 8 tokens, weak matches): a device whose
# verify costs the same for 16 tokens as for 60 (a GPU) pairs wide neural trees with wide lookups (the h200 design:
# lookup 8x2/16), and a few more corpus tokens cost it nothing
WIDE_CORPUS = ((4, 2),)
# corpus chains under the neural tree's best leaves (merged designs with a corpus), as (leaf_depth, leaf_count): tried
# beside each neural row's best merged design. Replayed on the cpu scale's 168 held-out sequences (its fine-tuned
# one-token subnet 1x8/8 + lookup n<=2 8x2/16 + corpus 4+2): 6-token chains under the 8 leaves took tau 2.51 -> 2.74,
# 1.91x -> 2.04x on the stored H200 profile; on the 2-core CPU's profile every variant lost
LEAF_CHAINS = ((2, 2), (2, 4), (4, 4), (2, 8), (4, 8), (6, 8), (4, 16))
# a merged design whose network drafts in fewer cycles than this share is the lookup design with weights it hardly
# uses (the switch rule beside a corpus branch: the lookup trie is never empty, so the network never runs; the demo's
# table showed such a row tying prompt + corpus lookup to the last digit, hiding the best merged design that does
# use its network): best_merged passes over it
MIN_NEURAL_SHARE = 0.05


def with_corpus(grid: tuple[LookupSpec, ...]) -> tuple[LookupSpec, ...]:
    """Corpus-branch variants of the grid's lookups: CORPUS_BRANCHES beside the single-branch, full-depth lookups of
    length <= 4, WIDE_CORPUS beside the others."""
    def narrow(s: LookupSpec) -> bool:
        return s.top_k == 1 and not s.weak_depth and s.tree_depth <= 4

    return tuple(replace(s, corpus_depth=c, corpus_second=b) for s in grid
                 for c, b in (CORPUS_BRANCHES if narrow(s) else WIDE_CORPUS))


@dataclass(frozen=True)
class EarlyExit:
    """What the layer-skip rows need from the target: its early-exit head and the cost share of K layers."""

    head: object  # (N, H) hidden_states[K] -> (N, V) logits (TargetModel.exit_logits)
    num_layers: int
    layer_params: int  # weights one decoder layer reads per token
    head_params: int  # LM head (+ final norm) weights read per token

    @classmethod
    def of(cls, target) -> "EarlyExit":
        layer = sum(p.numel() for p in target.decoder.layers[0].parameters())
        head = sum(p.numel() for m in (target.lm_head, target.decoder.norm) for p in m.parameters())
        return cls(target.exit_logits, target.num_layers, layer, head)

    def cost_share(self, k: int) -> float:
        """One token through K layers + the head, as a share of one through the whole target."""
        return (self.head_params + k * self.layer_params) / (self.head_params + self.num_layers * self.layer_params)


@dataclass
class RootTrie:
    """Lookup's proposal at one root position: its trie and how many of its tokens greedy accepts."""

    tokens: list[int]
    parents: list[int]
    accepted: int
    depth: list[int] = field(default_factory=list)  # per node, root 0

    def __post_init__(self) -> None:
        if not self.depth:
            self.depth = [0] + [0] * (len(self.tokens) - 1)
            for i in range(1, len(self.tokens)):
                self.depth[i] = self.depth[self.parents[i]] + 1

    def size(self, max_depth: int) -> int:
        """Nodes the loop verifies when it truncates the trie at max_depth (root included)."""
        return sum(d <= max_depth for d in self.depth)


def expected_tokens(seq: dict) -> list[int]:
    """cont[j]: the token a node at position j must equal to be accepted (-1: none), as nas.acceptance."""
    ids = seq["input_ids"].tolist()
    argmax = seq["topk_ids"][:, 0].tolist()
    return [ids[j] if j == 0 or argmax[j - 1] == ids[j] else -1 for j in range(len(ids))]


def corpus_branches(seq: dict, corpus: NgramCorpus, depth: int, second: int) -> list[list[list[int]]]:
    """The corpus branches (NgramCorpus.branches: `depth` and `second` tokens at most) at every root position p..t-2
    of one FeatureData item (index r - p): they depend on the tokens up to the root only, and shorter branches are
    prefixes of longer ones."""
    ids = seq["input_ids"].tolist()
    p = int(seq["prompt_len"])
    return [corpus.branches(ids[max(0, r + 1 - corpus.max_n): r + 1], depth, second) for r in range(p, len(ids) - 1)]


def lookup_matches(seq: dict, min_n: int, max_n: int) -> list[tuple[int, tuple[int, ...]]]:
    """Lookup's n-gram match (NgramIndex.match: n and the earlier start positions) at every root position p..t-2 of
    one FeatureData item (index r - p). Every lookup spec with this n-gram range shares them."""
    ids = seq["input_ids"].tolist()
    p = int(seq["prompt_len"])
    index = NgramIndex(min_n, max_n)
    index.extend(ids[:p])
    out = []
    for r in range(p, len(ids) - 1):
        n, starts = index.match(ids[r])
        out.append((n, tuple(starts)))  # a snapshot: the index's list grows with the history
        index.extend([ids[r]])
    return out


class LookupRoots:
    """Lookup's proposal (RootTrie) at the root positions of one held-out sequence, built when the replay first asks
    for one (it visits one root per cycle, not all of them) from the shared n-gram matches (lookup_matches)."""

    def __init__(self, ids: list[int], p: int, cont: list[int], spec: LookupSpec,
                 matches: list[tuple[int, tuple[int, ...]]], branches: list[list[list[int]]] | None = None):
        """ids: the sequence's tokens, p its prompt length, cont its expected_tokens; matches: lookup_matches of
        the spec's n-gram range; branches: the corpus branches (corpus_branches) for a spec with corpus_depth."""
        if spec.corpus_depth and branches is None:
            raise ValueError("a lookup spec with corpus_depth > 0 needs the corpus branches")
        self.ids, self.p, self.cont = ids, p, cont
        self.spec, self.matches, self.branches = spec, matches, branches
        self._tries: dict[int, RootTrie] = {}

    def __getitem__(self, k: int) -> RootTrie:
        """The proposal at root position p + k."""
        got = self._tries.get(k)
        if got is None:
            got = self._tries[k] = self._build(k)
        return got

    def _build(self, k: int) -> RootTrie:
        spec, ids, cont, r = self.spec, self.ids, self.cont, self.p + k
        n, starts = self.matches[k]
        conts = pick_continuations(ids, r, ids[r], n, starts, spec.max_ngram, spec.tree_depth, spec.top_k,
                                   spec.weak_depth)
        tokens, parents, _ = proposal_nodes(ids[r], conts, spec, spec.total_tokens,
                                            self.branches[k] if spec.corpus_depth else None)
        node, d = 0, 0
        while r + d + 1 < len(cont):
            nxt = next((c for c in range(1, len(tokens)) if parents[c] == node and tokens[c] == cont[r + d + 1]), None)
            if nxt is None:
                break
            node, d = nxt, d + 1
        return RootTrie(tokens, parents, d)


def new_lookup_nodes(exp: Expansion, kept: set[int], look: RootTrie, max_depth: int,
                     chains: dict[int, list[int]] | None = None) -> int:
    """Lookup trie nodes (depth <= max_depth) that the neural tree (with its leaf chains) does not hold already (same
    token path)."""
    child = {(exp.parents[i], exp.tokens[i]): i for i in kept}
    fresh = len(exp.tokens)  # ids for the chain nodes, past the expansion's own
    for leaf, chain in (chains or {}).items():
        parent = leaf
        for tok in chain:
            child[(parent, tok)] = parent = fresh
            fresh += 1
    where: dict[int, int | None] = {0: 0}
    new = 0
    for i in range(1, len(look.tokens)):
        parent = where.get(look.parents[i])
        node = child.get((parent, look.tokens[i])) if parent is not None else None
        where[i] = node
        new += node is None and look.depth[i] <= max_depth
    return new


@dataclass
class Replay:
    """A greedy replay of one draft kind over held-out sequences: per-sequence totals and cycle sizes."""

    per_seq: list[tuple[int, int]]  # (emitted tokens after the first, cycles) per sequence
    hist: Counter = field(default_factory=Counter)  # accepted draft tokens per cycle -> cycles
    sizes: Counter = field(default_factory=Counter)  # verified tokens (root included) per cycle -> cycles
    drafted: int = 0  # cycles in which the neural draft ran (all of them but a switch rule's lookup-only ones)

    @property
    def acceptance(self) -> Acceptance:
        e, c = sum(x for x, _ in self.per_seq), sum(y for _, y in self.per_seq)
        return Acceptance(tau=e / c if c else 1.0, cycles=c, emitted=e, hist=dict(self.hist))

    def tau_interval(self, n: int = 1000, seed: int = 0, level: float = 0.95,
                     groups: list | None = None) -> tuple[float, float]:
        """Bootstrap interval of tau over sequences (resampled with replacement; the pooled ratio each time).
        groups: one label per sequence (its conversation, decode.datasets.conversation_of): sequences that share one
        are resampled together, as the dependent samples they are (chat turns, parts of one conversation)."""
        labels = groups if groups is not None else list(range(len(self.per_seq)))
        pooled: dict = {}
        for label, (e, c) in zip(labels, self.per_seq):
            if c:
                pe, pc = pooled.get(label, (0, 0))
                pooled[label] = (pe + e, pc + c)
        if len(pooled) < 2:
            t = self.acceptance.tau
            return t, t
        emitted = np.array([e for e, _ in pooled.values()], dtype=np.float64)  # (G,) per resampled unit
        cycles = np.array([c for _, c in pooled.values()], dtype=np.float64)  # (G,)
        draws = np.random.default_rng(seed).integers(0, len(pooled), size=(n, len(pooled)))  # (n, G) resampled units
        taus = np.sort(emitted[draws].sum(axis=1) / cycles[draws].sum(axis=1)).tolist()  # (n,) pooled ratios
        lo = taus[int((1 - level) / 2 * n)]
        hi = taus[min(n - 1, int((1 + level) / 2 * n))]
        return lo, hi


def paired_tau_gain(a: Replay, b: Replay, n: int = 2000, seed: int = 0) -> dict:
    """b's tau minus a's over the same sequences, with a paired bootstrap 95% interval (sequences resampled together),
    and on how many sequences b needs fewer / more target forwards (cycles)."""
    ea, ca = (np.array(v, dtype=np.float64) for v in zip(*a.per_seq))  # (S,) emitted after the first, cycles
    eb, cb = (np.array(v, dtype=np.float64) for v in zip(*b.per_seq))
    draws = np.random.default_rng(seed).integers(0, len(ea), size=(n, len(ea)))  # (n, S) resampled indices
    diff = eb[draws].sum(1) / cb[draws].sum(1) - ea[draws].sum(1) / ca[draws].sum(1)  # (n,)
    return {"tau_gain": round(b.acceptance.tau - a.acceptance.tau, 4),
            "tau_gain_ci95": [round(float(np.quantile(diff, q)), 4) for q in (0.025, 0.975)],
            "sequences_b_better": int((cb < ca).sum()), "sequences_b_worse": int((cb > ca).sum())}


def replay(n_seqs: int, bounds: list[tuple[int, int]], at_root, max_new_tokens: int | None = None) -> Replay:
    """Walk roots r -> r + accepted + 1 as greedy speculative decoding does.

    bounds[i] = (prompt_len, sequence length); at_root(i, r, max_depth) -> (accepted, verified tokens)."""
    out = Replay([])
    for i in range(n_seqs):
        p, t = bounds[i]
        limit = t - p if max_new_tokens is None else min(max_new_tokens, t - p)
        if limit < 1:
            out.per_seq.append((0, 0))
            continue
        e, c, r = 1, 0, p
        while e < limit:
            m, n, *drafted = at_root(i, r, limit - e - 1)
            out.drafted += bool(drafted[0]) if drafted else 0
            c += 1
            out.hist[m] += 1
            out.sizes[n] += 1
            e += m + 1
            r += m + 1
        out.per_seq.append((min(e, limit) - 1, c))
    return out


class KindScorer:
    """Replays and predicted speed-ups of every kind on one set of held-out sequences and one profile."""

    def __init__(self, sequences, latency: LatencyModel | None, context: float = 512.0,
                 lookup_ms: float | None = None, early_exit: EarlyExit | None = None,
                 corpus: NgramCorpus | None = None, corpus_ms: float | None = None):
        """latency None: replays only (no speed-ups); early_exit None: no layer-skip rows; corpus None: no corpus
        branches (lookup specs with corpus_depth > 0 are refused); corpus_ms: its host time per drafted token."""
        self.seqs = list(sequences)
        # tau intervals resample a conversation's sequences together (nas.loading.heldout_sequences labels them)
        self.groups = [s.get("group", f"#{i}") for i, s in enumerate(self.seqs)]
        self.ids = [s["input_ids"].tolist() for s in self.seqs]
        self.bounds = [(int(s["prompt_len"]), s["input_ids"].numel()) for s in self.seqs]
        self.conts = [expected_tokens(s) for s in self.seqs]
        self.latency, self.context = latency, context
        self.lookup_ms = (0.0 if latency is None else measure_lookup_ms(int(context))) if lookup_ms is None \
            else lookup_ms
        self._roots: dict[LookupSpec, list[LookupRoots]] = {}
        self._matches: dict[tuple[int, int], list[list[tuple[int, tuple[int, ...]]]]] = {}  # per n-gram range
        self.corpus = corpus
        self._branches: list[list[list[list[int]]]] = []  # per sequence and root: the corpus branches, _depths deep
        self._depths = (0, 0)  # (first, second) branch lengths the stored branches hold
        self.corpus_ms = (0.0 if latency is None or corpus is None else measure_corpus_ms(corpus)) \
            if corpus_ms is None else corpus_ms
        self.early_exit = early_exit
        self._exits: dict[int, list[list[int]]] = {}

    def roots(self, spec: LookupSpec) -> list[LookupRoots]:
        if spec not in self._roots:
            if spec.corpus_depth and self.corpus is None:
                raise ValueError("lookup spec with a corpus branch, but the scorer has no corpus")
            if spec.corpus_depth > self._depths[0] or spec.corpus_second > self._depths[1]:
                # once, as deep as any spec asks (shorter branches are prefixes)
                self._depths = (max(spec.corpus_depth, *(c for c, _ in CORPUS_BRANCHES)),
                                max(spec.corpus_second, *(s for _, s in CORPUS_BRANCHES)))
                self._branches = [corpus_branches(s, self.corpus, *self._depths) for s in self.seqs]
            ngrams = (spec.min_ngram, spec.max_ngram)
            if ngrams not in self._matches:
                self._matches[ngrams] = [lookup_matches(s, *ngrams) for s in self.seqs]
            self._roots[spec] = [LookupRoots(self.ids[i], self.bounds[i][0], self.conts[i], spec,
                                             self._matches[ngrams][i], self._branches[i] if spec.corpus_depth else None)
                                 for i in range(len(self.seqs))]
        return self._roots[spec]

    def lookup_cost_ms(self, spec: LookupSpec) -> float:
        """Host time of one lookup proposal: the n-gram index and trie, plus the corpus branches' tokens."""
        return self.lookup_ms + (spec.corpus_depth + spec.corpus_second + spec.leaf_depth * spec.leaf_count) * \
            self.corpus_ms

    def leaf_chains_at(self, i: int, r: int, exp: Expansion, kept: set[int], spec: LookupSpec) -> dict[int, list[int]]:
        """The leaf chains of sequence i's neural tree (the `kept` nodes of expansion `exp`) at root position r."""
        if self.corpus is None:
            raise ValueError("a lookup spec with leaf chains, but the scorer has no corpus")
        rank = [j for j in exp.order if j in kept]
        context = self.ids[i][max(0, r + 1 - self.corpus.max_n): r + 1]
        return leaf_chains(exp.tokens, exp.parents, rank, spec.leaf_count, spec.leaf_depth, context, self.corpus)

    def grids(self) -> tuple[tuple[LookupSpec, ...], tuple[LookupSpec, ...]]:
        """(lookups merged with neural trees, corpus lookups tried alone): with a corpus, the merged grid has the
        corpus-branch variants too; without one there are no corpus lookups."""
        if self.corpus is None:
            return LOOKUP_GRID, ()
        more = with_corpus(LOOKUP_GRID)
        return LOOKUP_GRID + more, more

    def _speedup(self, rep: Replay, fixed_ms: float) -> tuple[float, float]:
        """(speed-up, mean cycle ms): fixed_ms per cycle + the profile's verify(n) of each cycle's own n."""
        cycles = sum(rep.sizes.values())
        if not cycles:
            return 1.0, self.latency.target_step_ms(self.context)
        verify = sum(k * self.latency.verify_ms(n, self.context) for n, k in rep.sizes.items()) / cycles
        cycle = fixed_ms + verify
        return rep.acceptance.tau * self.latency.target_step_ms(self.context) / cycle, cycle

    # ------------------------------------------------------------------ kinds
    def replay_lookup(self, spec: LookupSpec, max_new_tokens: int | None = None) -> Replay:
        roots = self.roots(spec)
        return replay(len(self.seqs), self.bounds,
                       lambda i, r, md: (min(roots[i][r - self.bounds[i][0]].accepted, md),
                                        roots[i][r - self.bounds[i][0]].size(md)), max_new_tokens)

    def lookup(self, spec: LookupSpec, max_new_tokens: int | None = None) -> dict:
        return self._row("prompt-lookup", self.replay_lookup(spec, max_new_tokens), self.lookup_cost_ms(spec),
                         lookup=spec)

    def replay_neural(self, arch: DraftArch, sweep: TreeSweep, lookup: LookupSpec | None = None,
                      max_new_tokens: int | None = None, rule: str = "union") -> Replay:
        """The neural subnet `arch` (its tree_depth / total_tokens) from its sweep, merged with lookup if given
        (rule as decode.drafts.merged: union of both trees, or switch to the lookup trie when it matched)."""
        exps = {i: sweep.sequences[i][1] for i in range(len(self.seqs))}
        roots = self.roots(lookup) if lookup is not None else None
        D, N = arch.tree_depth, arch.total_tokens

        def at_root(i, r, md):
            p = self.bounds[i][0]
            if roots is not None and rule == "switch" and len(roots[i][r - p].tokens) > 1:
                look = roots[i][r - p]
                return min(look.accepted, md), look.size(md), False
            exp, cont = exps[i][r - p], self.conts[i]
            kept = exp.kept(D, N)
            m, node = exp.walk(kept, D, cont, r, md)
            n = 1 + sum(exp.depth[j] <= md for j in kept)  # the loop truncates the tree at md
            chains = self.leaf_chains_at(i, r, exp, kept, lookup) if lookup is not None and lookup.leaf_depth else {}
            if chains:
                chain, base = chains.get(node, ()), exp.depth[node]  # a walk ending at an extended leaf goes on
                limit = min(md, len(cont) - r - 1)
                while m < limit and m - base < len(chain) and chain[m - base] == cont[r + m + 1]:
                    m += 1
                n += sum(max(0, min(len(c), md - exp.depth[leaf])) for leaf, c in chains.items())
            if roots is not None:
                look = roots[i][r - p]
                m = max(m, min(look.accepted, md))
                n += new_lookup_nodes(exp, kept, look, md, chains)
            return m, n, True

        return replay(len(self.seqs), self.bounds, at_root, max_new_tokens)

    def neural(self, arch: DraftArch, sweep: TreeSweep, lookup: LookupSpec | None = None,
               max_new_tokens: int | None = None, rule: str = "union") -> dict:
        rep = self.replay_neural(arch, sweep, lookup, max_new_tokens, rule)
        parts = self.latency.breakdown(arch, accepted=rep.acceptance.tau, context=self.context)
        share = rep.drafted / max(1, rep.acceptance.cycles)  # cycles that ran the neural draft
        own = self.lookup_cost_ms(lookup) if lookup is not None else 0.0
        fixed = share * (parts["total"] - parts["verify"]) + own
        row = self._row("neural+lookup" if lookup is not None else "neural", rep, fixed, arch=arch, lookup=lookup)
        if lookup is not None:
            row["merge"] = rule
            row["neural_share"] = round(share, 4)
        return row

    def _row(self, kind: str, rep: Replay, fixed_ms: float, arch: DraftArch | None = None,
             lookup: LookupSpec | None = None) -> dict:
        speedup, cycle = self._speedup(rep, fixed_ms)
        acc = rep.acceptance
        lo, hi = rep.tau_interval(groups=self.groups)
        cycles = max(1, acc.cycles)
        return {"kind": kind, "tau": round(acc.tau, 4), "tau_ci95": [round(lo, 4), round(hi, 4)],
                "speedup": round(speedup, 4), "cycle_ms": round(cycle, 3),
                "verify_tokens": round(sum(n * k for n, k in rep.sizes.items()) / cycles, 2),
                "cycles": acc.cycles, "sequences": len(self.seqs), "arch": arch.to_json() if arch is not None else None,
                "lookup": asdict(lookup) if lookup is not None else None}

    def layerskip_layers(self) -> list[int]:
        """The K that layer-skip rows can use: intermediate layers every sequence stores (1 <= K < L)."""
        if self.early_exit is None or not self.seqs:
            return []
        common = set.intersection(*(set(s["hidden"]) for s in self.seqs))
        return sorted(k for k in common if 1 <= k < self.early_exit.num_layers)

    def exit_argmax(self, k: int) -> list[list[int]]:
        """Per sequence, the layer-skip:K proposal after each position (argmax of the early-exit logits)."""
        if k not in self._exits:  # the replay reads positions from the prompt's end on: the head skips the prompt
            self._exits[k] = [[-1] * p + self.early_exit.head(s["hidden"][k][p:]).argmax(-1).tolist()
                              for s, (p, _) in zip(self.seqs, self.bounds)]
        return self._exits[k]

    def replay_layerskip(self, k: int, depth: int, max_new_tokens: int | None = None) -> Replay:
        """layerskip:K drafting a chain of `depth` tokens per cycle (the loop truncates it near the end)."""
        preds = self.exit_argmax(k)

        def at_root(i, r, md):
            d, m = min(depth, md), 0
            while m < d and preds[i][r + m] == self.conts[i][r + m + 1]:
                m += 1
            return m, 1 + d

        return replay(len(self.seqs), self.bounds, at_root, max_new_tokens)

    def layerskip(self, k: int, depth: int, max_new_tokens: int | None = None) -> dict:
        rep = self.replay_layerskip(k, depth, max_new_tokens)
        step = self.latency.target_step_ms(self.context)
        chain = DraftArch(tree_depth=depth, top_k=1, total_tokens=depth)
        fixed = depth * step * self.early_exit.cost_share(k) + self.latency.overhead_ms(chain)
        return {**self._row("layerskip", rep, fixed), "layerskip": {"layers": k, "tree_depth": depth}}

    def best_layerskip(self, depths=LAYERSKIP_DEPTHS) -> dict | None:
        """The fastest (K, chain depth) on this profile; None without stored intermediate layers."""
        rows = [self.layerskip(k, d) for k in self.layerskip_layers() for d in depths]
        return max(rows, key=lambda row: row["speedup"]) if rows else None

    def vanilla(self) -> dict:
        return {"kind": "none", "tau": 1.0, "tau_ci95": [1.0, 1.0], "speedup": 1.0,
                "cycle_ms": round(self.latency.target_step_ms(self.context), 3), "verify_tokens": 1.0, "cycles": 0,
                "sequences": len(self.seqs), "arch": None, "lookup": None}

    def best_lookup(self, grid=LOOKUP_ALONE_GRID) -> dict:
        return max((self.lookup(s) for s in grid), key=lambda row: row["speedup"])

    def best_merged(self, arch: DraftArch, sweep: TreeSweep, depths, totals, grid=LOOKUP_GRID) -> dict:
        """The best (tree depth, total_tokens, LookupSpec) of `arch` merged with lookup (grid None: the
        neural draft alone, best tree), on this profile; merged designs whose network drafts in fewer than
        MIN_NEURAL_SHARE of the cycles are passed over (they are the lookup rows' designs) unless all are such."""
        best, idle = None, None
        for d in depths:
            if d > sweep.max_depth:
                continue
            for n in totals:
                a = replace(arch, tree_depth=d, total_tokens=min(n, max_tree_nodes(d, arch.top_k)))
                for spec in grid if grid is not None else (None,):
                    for rule in RULES if spec is not None else ("union",):
                        row = self.neural(a, sweep, spec, rule=rule)
                        if row.get("neural_share", 1.0) < MIN_NEURAL_SHARE:
                            idle = row if idle is None or row["speedup"] > idle["speedup"] else idle
                        elif best is None or row["speedup"] > best["speedup"]:
                            best = row
        best = best or idle
        return self.best_leaf_chains(best, sweep) if best is not None else None

    def best_leaf_chains(self, row: dict, sweep: TreeSweep) -> dict:
        """A merged row's design with leaf chains (LEAF_CHAINS) under its neural tree, when one is faster on this
        profile (the row itself without a corpus or a lookup)."""
        if self.corpus is None or not row.get("lookup"):
            return row
        arch, spec = DraftArch.from_json(row["arch"]), LookupSpec.from_dict(row["lookup"])
        best = row
        for depth, count in LEAF_CHAINS:
            new = self.neural(arch, sweep, replace(spec, leaf_depth=depth, leaf_count=count), rule=row["merge"])
            if new["speedup"] > best["speedup"]:
                best = new
        return best


def measure_corpus_ms(corpus: NgramCorpus, repeats: int = 200, seed: int = 0) -> float:
    """Host time per token of the corpus branch (NgramCorpus.chain over random contexts), median."""
    rng = random.Random(seed)
    vocab = int(corpus.info.vocab_size)
    times = []
    for _ in range(repeats):
        ctx = [rng.randrange(vocab) for _ in range(corpus.max_n)]
        t0 = time.perf_counter()
        corpus.next_of(ctx)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000.0


def measure_lookup_ms(context: int, repeats: int = 200, seed: int = 0) -> float:
    """Host time of one lookup proposal (n-gram index query + trie) over a `context`-token history, median."""
    rng = random.Random(seed)
    history = [rng.randrange(2000) for _ in range(max(8, context))]
    spec = LookupSpec(max_ngram=3, tree_depth=8, top_k=2, total_tokens=16)
    index = NgramIndex(spec.min_ngram, spec.max_ngram)
    index.extend(history)
    times = []
    for i in range(repeats):
        root = history[i % len(history)]
        t0 = time.perf_counter()
        trie(root, index.continuations(root, spec.tree_depth, spec.top_k), spec.total_tokens)
        index.extend([root])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000.0
