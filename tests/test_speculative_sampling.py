"""Speculative sampling keeps the target's distribution exactly; a wrong acceptance rule is caught."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_prompt, tiny_target
from stats import chi2_critical, chi2_statistic

from decode.arch import TreeSpec
from decode.drafts import LayerSkipDraft, PromptLookupDraft
from decode.loop import speculative as spec_mod
from decode.loop.sampling import SamplingConfig, probs_from_logits
from decode.loop.speculative import speculative_generate
from decode.loop.tree import DraftTree, TreePolicy
from decode.loop.verify import Verdict, verify_sampling

CFG = SamplingConfig(temperature=1.0)


# ---------------------------------------------------------------- the rule alone (synthetic p, q)
def wrong_verify(tree, logits, cfg, generator):
    """A classic mistake: accept with min(1, p/q) but, on rejection, keep sampling from p instead
    of the residual max(p - q, 0) (q ignored after a rejection). Chains/single level only."""
    probs = probs_from_logits(logits, cfg)
    path, node = [0], 0
    while True:
        p = probs[node]
        kids = tree.children(node)
        nxt = None
        for c in kids:
            x = int(tree.tokens[c])
            q = tree.dists[node] if tree.sampled else torch.nn.functional.one_hot(torch.tensor(x), p.numel()).float()
            if float(torch.rand((), generator=generator)) < min(1.0, float(p[x] / q[x])):
                nxt = c
                break
        if nxt is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return Verdict(path, tree.tokens[path].tolist(), bonus)
        path.append(nxt)
        node = nxt


def _first_token_counts(tree_fn, p_logits, n, verify_fn=verify_sampling, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p_logits.shape[-1])
    for _ in range(n):
        tree = tree_fn(g)
        path, _, bonus = verify_fn(tree, p_logits.expand(tree.size, -1), CFG, g)  # (path, path tokens, bonus)
        counts[tree.tokens[path[1]] if len(path) > 1 else bonus] += 1
    return counts


def _sampled_children_tree(q: torch.Tensor, k: int):
    def make(g):
        keys = q.log() - torch.log(-torch.log(torch.rand(q.shape, generator=g).clamp(1e-20, 1)))
        kids = keys.topk(k).indices  # k draws without replacement, in draw order
        dists = torch.zeros(k + 1, q.numel())
        dists[0] = q
        return DraftTree(torch.cat([torch.tensor([0]), kids]), torch.tensor([-1] + [0] * k), dists=dists, sampled=True)
    return make


P_LOGITS = torch.tensor([2.0, 1.2, 0.4, 0.0, -0.5, -1.0])
Q = torch.softmax(torch.tensor([-0.5, 0.3, 1.5, 0.9, 0.0, 0.2]), -1)  # deliberately unlike p


@pytest.mark.parametrize("k", [1, 2, 4])
def test_recursive_rejection_with_sampled_candidates_is_exact(k):
    p = torch.softmax(P_LOGITS, -1)
    counts = _first_token_counts(_sampled_children_tree(Q, k), P_LOGITS, 6000)
    stat, df = chi2_statistic(counts, p)
    assert stat < chi2_critical(df), (stat, df)


def test_a_wrong_rule_is_caught():
    p = torch.softmax(P_LOGITS, -1)
    counts = _first_token_counts(_sampled_children_tree(Q, 1), P_LOGITS, 6000, verify_fn=wrong_verify)
    stat, df = chi2_statistic(counts, p)
    assert stat > 3 * chi2_critical(df), (stat, df)


@pytest.mark.parametrize("kids", [[2], [2, 3, 0], [5, 4, 1, 0, 2]])
def test_point_mass_rule_for_deterministic_candidates_is_exact(kids):
    p = torch.softmax(P_LOGITS, -1)
    tree = DraftTree(torch.tensor([0] + kids), torch.tensor([-1] + [0] * len(kids)))
    counts = _first_token_counts(lambda g: tree, P_LOGITS, 6000)
    stat, df = chi2_statistic(counts, p)
    assert stat < chi2_critical(df), (stat, df)


# ---------------------------------------------------------------- end to end on a tiny target
class SharpFullDraft(LayerSkipDraft):
    """All target layers with logits sharpened: q overlaps p but differs from it, so a wrong rule shows."""

    def __init__(self, target):
        super().__init__(target.num_layers)
        self.name = "sharp-full"

    def start(self, target, prompt, prefill):
        self.target = target

    def _node_logits(self, nodes, tokens, parents):
        return 2.5 * super()._node_logits(nodes, tokens, parents)


def _joint_target_probs(target, prompt, cfg):
    """Exact joint distribution of the first two new tokens, {(x0, x1): prob}."""
    p0 = probs_from_logits(target.prefill(prompt).logits[-1], cfg)
    joint = {}
    for x0 in p0.nonzero().flatten().tolist():
        if x0 in target.eos_token_ids:  # generation ends after an EOS
            joint[(x0, None)] = float(p0[x0])
            continue
        target.prefill(prompt)
        p1 = probs_from_logits(target.step(x0).logits[-1], cfg)
        for x1 in p1.nonzero().flatten().tolist():
            joint[(x0, x1)] = float(p0[x0] * p1[x1])
    return joint


def _joint_counts(target, prompt, draft, cfg, policy, n, keys):
    index = {k: i for i, k in enumerate(keys)}
    counts = torch.zeros(len(keys) + 1)
    for seed in range(n):
        toks = speculative_generate(target, draft, prompt, 3, SamplingConfig(cfg.temperature, cfg.top_p, seed),
                                    policy).tokens
        counts[index.get((toks[0], toks[1] if len(toks) > 1 else None), len(keys))] += 1
    return counts


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("tiny-llama")
    prompt = tiny_prompt(target, "Once upon")
    cfg = SamplingConfig(temperature=0.05, top_p=0.9)  # sharp enough that (x0, x1) has few likely outcomes
    joint = _joint_target_probs(target, prompt, cfg)
    keys = list(joint)
    probs = torch.tensor([joint[k] for k in keys] + [0.0])
    return target, prompt, cfg, keys, probs


CASES = [
    ("sharp-full", "chain", "sample"),  # standard speculative sampling with q
    ("sharp-full", "static:3,1", "sample"),  # multi-candidate recursive rejection with q
    ("sharp-full", "dynamic", "topk"),  # EAGLE-2 tree, point-mass rule
    ("layerskip", "static:2,2", "topk"),
    ("prompt-lookup", "dynamic", "topk"),
    ("corpus-lookup", "dynamic", "topk"),  # prompt lookup + two corpus branches: the target's two likeliest starts
]


def _corpus_lookup(target, prompt, keys, probs):
    """Prompt lookup with a corpus whose greedy and runner-up branches after the prompt are the target's two likeliest
    (x0, x1) pairs (so both get accepted, and their first tokens may coincide with the lookup trie's)."""
    from decode.drafts import LookupSpec
    from decode.drafts.corpus import NgramCorpus

    tail = prompt.input_ids[0, -2:].tolist()
    ranked = [keys[i] for i in probs[:-1].argsort(descending=True).tolist() if keys[i][1] is not None]
    first, second = ranked[0], next(k for k in ranked if k[0] != ranked[0][0])
    corpus = NgramCorpus.build([tail + list(first)] * 3 + [tail + list(second)] * 2, target.vocab_size)
    spec = LookupSpec(max_ngram=2, tree_depth=2, top_k=1, total_tokens=2, corpus_depth=2, corpus_second=2)
    return PromptLookupDraft(spec=spec, corpus=corpus)


@pytest.mark.parametrize("draft_name,tree,candidates", CASES)
def test_speculative_sampling_matches_target_joint(setup, draft_name, tree, candidates):
    target, prompt, cfg, keys, probs = setup
    draft = _corpus_lookup(target, prompt, keys, probs) if draft_name == "corpus-lookup" else {
        "sharp-full": SharpFullDraft(target), "layerskip": LayerSkipDraft(1), "prompt-lookup": PromptLookupDraft()}[
        draft_name]
    policy = TreePolicy.parse(tree, TreeSpec(2, 3, 6), candidates)
    counts = _joint_counts(target, prompt, draft, cfg, policy, 1200, keys)
    assert counts[-1] == 0  # nothing outside the target's support
    stat, df = chi2_statistic(counts, probs)
    assert df >= 5
    assert stat < chi2_critical(df), (stat, df)


@pytest.mark.parametrize("draft_name,tree,candidates", [("sharp-full", "static:3,1", "sample"),
                                                         ("prompt-lookup", "dynamic", "topk")])
def test_speculative_sampling_on_the_compiled_runtime_matches_target_joint(setup, draft_name, tree, candidates):
    """The same statistic with the target on the compiled runtime (static cache, padded trees, inductor),
    against the joint distribution computed on the eager runtime."""
    target, prompt, cfg, keys, probs = setup
    draft = SharpFullDraft(target) if draft_name == "sharp-full" else PromptLookupDraft()
    policy = TreePolicy.parse(tree, TreeSpec(2, 3, 6), candidates)
    target.use_runtime("compiled")
    try:
        counts = _joint_counts(target, prompt, draft, cfg, policy, 1200, keys)
    finally:
        target.use_runtime("eager")
    assert counts[-1] == 0
    stat, df = chi2_statistic(counts, probs)
    assert df >= 5
    assert stat < chi2_critical(df), (stat, df)


def test_wrong_rule_fails_end_to_end(setup, monkeypatch):
    """Same statistic with a wrong acceptance rule in the loop: must be rejected."""
    target, prompt, cfg, keys, probs = setup
    monkeypatch.setattr(spec_mod, "verify", wrong_verify)
    policy = TreePolicy.parse("chain", TreeSpec(2, 1, 2), "sample")
    counts = _joint_counts(target, prompt, SharpFullDraft(target), cfg, policy, 1200, keys)
    stat, df = chi2_statistic(counts, probs)
    assert stat > chi2_critical(df), (stat, df)
