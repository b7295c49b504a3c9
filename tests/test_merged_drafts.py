"""Merged neural + prompt-lookup trees, prompt lookup's match choice, and training-free checkpoint kinds."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import tiny_prompt, tiny_target
from stats import chi2_critical, chi2_statistic
from test_speculative_sampling import SharpFullDraft, _joint_counts, _joint_target_probs

from decode.arch import TreeSpec
from decode.drafts import LookupSpec, MergedDraft, NoDraft, PromptLookupDraft, make_draft
from decode.drafts.kinds import load_draft_dir, save_training_free
from decode.drafts.prompt_lookup import NgramIndex, pick_continuations
from decode.errors import UserError
from decode.loop.sampling import SamplingConfig
from decode.loop.speculative import speculative_generate
from decode.loop.tree import DraftTree, TreePolicy, graft
from decode.loop.vanilla import vanilla_generate

REPEATING = "one two three four one two three four one two three four one two"
N = 24


def _tree(tokens, parents):
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))


def test_graft_merges_shared_prefixes_and_keeps_both_trees_whole():
    base = _tree([9, 1, 2, 3], [-1, 0, 0, 1])  # 9 -> 1 -> 3, 9 -> 2
    extra = _tree([9, 1, 3, 5, 7], [-1, 0, 1, 2, 0])  # 9 -> 1 -> 3 -> 5, 9 -> 7
    got = graft(base, extra)
    assert got.tokens.tolist() == [9, 1, 2, 3, 5, 7]
    assert got.parents.tolist() == [-1, 0, 0, 1, 3, 0]
    paths = lambda t: {tuple(t.tokens[i].item() for i in range(t.size) if t.mask[j, i]) for j in range(t.size)}
    assert paths(base) | paths(extra) == paths(got)
    assert graft(base, _tree([9, 2], [-1, 0])) is base  # nothing new: the same tree
    with pytest.raises(ValueError):
        graft(base, _tree([8, 1], [-1, 0]))  # another root (checked when there is something to add)


def test_lookup_prefers_the_match_whose_continuation_is_full_length():
    idx = NgramIndex(1, 3)
    # "a b c d e f" early, then "a b" right before the end: the newest "a b" match continues with 1 token only
    idx.extend([1, 2, 3, 4, 5, 6, 7, 1, 2])
    assert idx.continuations(3, 4, 1) == [[4, 5, 6, 7]]  # suffix (1, 2, 3) -> the early copy, whole
    idx2 = NgramIndex(1, 2)
    idx2.extend([5, 6, 7, 8, 9, 5, 6, 7, 1])
    assert idx2.continuations(5, 3, 2) == [[6, 7, 1], [6, 7, 8]]  # full-length matches, newest first
    assert NgramIndex(1, 2).continuations(5, 3, 1) == []


def test_weak_matches_get_the_short_branch():
    idx = NgramIndex(1, 3)
    idx.extend([1, 2, 3, 4, 5, 6, 7, 9, 9, 1, 2])
    assert idx.continuations(3, 4, 1, weak_depth=2) == [[4, 5, 6, 7]]  # (1, 2, 3): a full-size match, long
    assert idx.continuations(5, 4, 1, weak_depth=2) == [[6, 7]]  # only (5,) matches: short
    assert idx.continuations(5, 4, 1) == [[6, 7, 9, 9]]  # weak_depth 0: the long branch for every match
    assert idx.continuations(5, 1, 1, weak_depth=2) == [[6]]  # never longer than the depth asked for
    with pytest.raises(UserError, match="weak_depth"):
        LookupSpec(tree_depth=2, total_tokens=2, weak_depth=3)


def _continuations_by_full_scan(hist, root, min_n, max_n, depth, limit, weak_depth):
    """The lookup rule (module docstring of decode.drafts.prompt_lookup) by brute force: every occurrence scanned."""
    seq = hist + [root]
    for n in range(min(max_n, len(hist)), min_n - 1, -1):
        d = min(depth, weak_depth) if n < max_n and weak_depth else depth
        found = []
        for s in range(len(hist) - n, -1, -1):  # newest first; the occurrence ends before the suffix
            if seq[s:s + n] == seq[-n:]:
                cont = seq[s + n: s + n + d]
                if cont and cont not in found:
                    found.append(cont)
        if found:
            best = max(len(c) for c in found)
            return ([c for c in found if len(c) == best] + [c for c in found if len(c) < best])[:limit]
    return []


def test_lookup_continuations_equal_a_full_scan_on_random_histories():
    # the index stops scanning once `limit` full-length continuations are found; it must pick what a full scan picks
    rng = random.Random(0)
    for trial in range(300):
        vocab = rng.choice([3, 5, 20])  # small vocabularies: many repeats, ties and short matches near the end
        hist = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        root = rng.randrange(vocab)
        min_n = rng.choice([1, 2])
        max_n = rng.choice([min_n, 3, 4])
        depth, limit, weak = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3]), rng.choice([0, 1, 2])
        weak = min(weak, depth)
        idx = NgramIndex(min_n, max_n)
        idx.extend(hist)
        want = _continuations_by_full_scan(hist, root, min_n, max_n, depth, limit, weak)
        assert idx.continuations(root, depth, limit, weak) == want, (trial, hist, root)
        # the replay's form: the whole sequence given, the history cut at r
        n, starts = idx.match(root)
        assert pick_continuations(hist + [root] + [rng.randrange(vocab) for _ in range(5)], len(hist), root, n,
                                  tuple(starts), max_n, depth, limit, weak) == want


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-llava", "tiny-qwen2.5-vl"])
@pytest.mark.parametrize("fusion", ["concat", "cross", "hybrid"])
def test_merged_drafts_are_lossless_greedy(family, fusion):
    target = tiny_target(family)
    draft = make_draft(f"random:{fusion}+lookup", target)
    assert isinstance(draft, MergedDraft)
    grew = 0
    for text in (REPEATING, "List three colours:"):
        prompt = tiny_prompt(target, text)
        want = vanilla_generate(target, prompt, N).tokens
        for tree in ("chain", "static:3,2,1", "dynamic"):
            policy = TreePolicy.parse(tree, TreeSpec(tree_depth=3, top_k=2, total_tokens=6))
            got = speculative_generate(target, draft, prompt, N, policy=policy)
            assert got.tokens == want, (fusion, tree, text)
            grew += sum(s > 1 + policy_nodes(policy) for s in got.tree_sizes)
    assert grew > 0  # lookup really added nodes beyond the neural tree on some cycle


def policy_nodes(policy: TreePolicy) -> int:
    if policy.kind == "dynamic":
        return policy.spec.total_tokens
    n, width = 0, 1
    for k in policy.levels:
        width *= k
        n += width
    return n


def test_merged_refuses_sampled_candidates():
    target = tiny_target("tiny-llama")
    draft = make_draft("random:concat+lookup", target)
    policy = TreePolicy.parse("chain", TreeSpec(2, 1, 2), "sample")
    with pytest.raises(UserError, match="topk"):
        speculative_generate(target, draft, tiny_prompt(target, REPEATING), 8, SamplingConfig(1.0, 1.0, 0), policy)


@pytest.fixture(scope="module")
def repeating_setup():
    target = tiny_target("tiny-llama")
    prompt = tiny_prompt(target, REPEATING)
    cfg = SamplingConfig(temperature=0.2, top_p=0.95)
    joint = _joint_target_probs(target, prompt, cfg)
    keys = list(joint)
    return target, prompt, cfg, keys, torch.tensor([joint[k] for k in keys] + [0.0])


@pytest.mark.parametrize("case", ["sharp+lookup", "lookup+lookup", "sharp+leaf-chains"])
def test_merged_sampling_matches_target_joint(repeating_setup, case):
    """Exact target distribution when sampling; lookup+lookup: every lookup node coincides with a 'neural' one;
    leaf chains: corpus chains (of the target's greedy text) under the neural leaves."""
    target, prompt, cfg, keys, probs = repeating_setup
    base = PromptLookupDraft(spec=LookupSpec(2, 1, 2, 2, 4)) if case == "lookup+lookup" else SharpFullDraft(target)
    spec = LookupSpec(max_ngram=3, tree_depth=2, top_k=2, total_tokens=4)
    leaf = case == "sharp+leaf-chains"
    if leaf:
        spec = LookupSpec(**{**vars(spec), "leaf_depth": 2, "leaf_count": 3})
    draft = MergedDraft(base, spec, corpus=_greedy_corpus(target, prompt) if leaf else None)
    policy = TreePolicy.parse("dynamic", TreeSpec(2, 3, 6))
    counts = _joint_counts(target, prompt, draft, cfg, policy, 1200, keys)
    assert counts[-1] == 0
    stat, df = chi2_statistic(counts, probs)
    assert df >= 5
    assert stat < chi2_critical(df), (stat, df)


def test_training_free_checkpoints_load_as_their_kind(tmp_path):
    target = tiny_target("tiny-llama")
    spec = LookupSpec(max_ngram=2, tree_depth=5, top_k=2, total_tokens=7)
    look = load_draft_dir(save_training_free(tmp_path / "pl", "prompt-lookup", target, spec), target)
    assert isinstance(look, PromptLookupDraft) and look.spec == spec and look.default_tree == spec.tree
    assert isinstance(make_draft(str(save_training_free(tmp_path / "none", "none", target, None)), target), NoDraft)
    prompt = tiny_prompt(target, REPEATING)
    want = vanilla_generate(target, prompt, N).tokens
    for draft in (look, NoDraft()):
        got = speculative_generate(target, draft, prompt, N)
        assert got.tokens == want
    none = speculative_generate(target, NoDraft(), prompt, N)
    assert none.cycles == N - 1 and set(none.tree_sizes) == {1}
    with pytest.raises(UserError, match="lookup"):
        make_draft(str(tmp_path / "pl") + "+lookup", target)


def test_neural_plus_lookup_checkpoint_round_trip(tmp_path):
    target = tiny_target("tiny-llama")
    neural = make_draft("random:hybrid", target)
    spec = LookupSpec(max_ngram=4, tree_depth=6, top_k=1, total_tokens=6)
    neural.model.save_pretrained(tmp_path / "d", target, extra={"kind": "neural+lookup", "lookup": vars(spec)})
    draft = make_draft(str(tmp_path / "d"), target)
    assert isinstance(draft, MergedDraft) and draft.lookup.spec == spec
    prompt = tiny_prompt(target, REPEATING)
    assert speculative_generate(target, draft, prompt, N).tokens == vanilla_generate(target, prompt, N).tokens
    cfg = json.loads((tmp_path / "d" / "draft_config.json").read_text())
    cfg["kind"] = "mystery"
    (tmp_path / "d" / "draft_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="unknown draft kind"):
        make_draft(str(tmp_path / "d"), target)


def test_prompt_lookup_spec_strings():
    target = tiny_target("tiny-llama")
    d = make_draft("prompt-lookup:10:2", target)
    assert d.spec == LookupSpec(max_ngram=2, tree_depth=10, top_k=1, total_tokens=10)
    assert make_draft("prompt-lookup:4:3:2", target).spec.total_tokens == 8
    assert make_draft("prompt-lookup:8:3:1:2", target).spec == LookupSpec(max_ngram=3, tree_depth=8, top_k=1,
                                                                          total_tokens=8, weak_depth=2)
    for bad in ("prompt-lookup:x", "prompt-lookup:0", "prompt-lookup:4:0", "prompt-lookup:1:2:3:4",
                "prompt-lookup:2:2:1:3", "prompt-lookup:8:3:1:2:1"):
        with pytest.raises(UserError, match="prompt-lookup:D"):
            make_draft(bad, target)


@pytest.mark.parametrize("fusion", ["concat", "hybrid"])
def test_switch_rule_is_lossless_and_skips_the_neural_draft_on_lookup_cycles(fusion):
    """switch: the lookup trie alone when it matched; the neural draft catches up on the skipped tokens, so
    its cache after the run equals a draft that proposed every cycle (same committed entries)."""
    target = tiny_target("tiny-llama")
    prompt = tiny_prompt(target, REPEATING)
    want = vanilla_generate(target, prompt, N).tokens
    neural = make_draft(f"random:{fusion}", target)
    calls = []
    original = neural.propose
    neural.propose = lambda *a, **k: calls.append(1) or original(*a, **k)
    draft = MergedDraft(neural, LookupSpec(max_ngram=3, tree_depth=4, top_k=1, total_tokens=4), rule="switch")
    policy = TreePolicy.parse("dynamic", TreeSpec(2, 2, 3))
    got = speculative_generate(target, draft, prompt, N, policy=policy)
    assert got.tokens == want
    assert 0 < len(calls) < got.cycles  # some cycles were lookup-only
    with pytest.raises(UserError, match="merge rule"):
        MergedDraft(neural, rule="mix")


def _greedy_corpus(target, prompt, n=N):
    """A corpus holding the target's own greedy continuation of `prompt` (leaf chains then draft it right)."""
    from decode.drafts.corpus import NgramCorpus

    ids = prompt.input_ids[0].tolist() + vanilla_generate(target, prompt, n).tokens
    return NgramCorpus.build([ids], target.vocab_size)


def test_leaf_chains_hang_corpus_chains_under_the_best_leaves():
    """leaf_chains: the `count` best leaves by rank (inner nodes skipped), each continued by the corpus after the
    context and its own path; a leaf the corpus knows nothing after gets no chain; with_leaf_chains appends them."""
    from decode.drafts.corpus import NgramCorpus
    from decode.drafts.merged import leaf_chains, rank_nodes, with_leaf_chains

    corpus = NgramCorpus.build([[5, 9, 1, 3, 7, 8, 6], [4, 9, 2, 4, 4]], 16)
    tree = DraftTree(torch.tensor([9, 1, 2, 3, 11]), torch.tensor([-1, 0, 0, 1, 0]),
                     scores=torch.tensor([0.0, -0.1, -0.5, -0.3, -0.2]))
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    rank = rank_nodes(tree)
    assert rank == [1, 4, 3, 2]  # best first; node 1 is inner, node 4 (token 11) unknown to the corpus
    # the best leaf (node 4) has no continuation: the next best the corpus continues take its place
    assert leaf_chains(tokens, parents, rank, 1, 2, [5, 9], corpus) == {3: [7, 8]}
    assert leaf_chains(tokens, parents, rank, 2, 2, [5, 9], corpus) == {3: [7, 8], 2: [4, 4]}
    chains = leaf_chains(tokens, parents, rank, 3, 3, [4, 9], corpus)
    assert chains == {3: [7, 8, 6], 2: [4, 4, 4]}  # (2, 4, 4) and (4, 4) end a sequence: (4,) -> 4
    got = with_leaf_chains(tree, tokens, parents, chains)
    assert got.tokens.tolist() == [9, 1, 2, 3, 11, 7, 8, 6, 4, 4, 4]
    assert got.parents.tolist() == [-1, 0, 0, 1, 0, 3, 5, 6, 2, 8, 9]
    got.validate()
    assert with_leaf_chains(tree, tokens, parents, {}) is tree
    with pytest.raises(UserError, match="leaf_depth and leaf_count"):
        LookupSpec(leaf_depth=2)
    with pytest.raises(UserError, match="corpus"):
        PromptLookupDraft(spec=LookupSpec(leaf_depth=2, leaf_count=2))  # chains need a corpus


@pytest.mark.parametrize("rule", ["union", "switch"])
def test_leaf_chains_are_lossless_and_accept_the_corpus_phrase(rule):
    """Greedy output unchanged with corpus chains under the neural leaves (dynamic and static trees); with a
    draft whose first token is the target's own and a corpus of the target's text, the chains cut the cycles."""
    from test_speculative_sampling import SharpFullDraft

    target = tiny_target("tiny-llama")
    for text in (REPEATING, "List three colours:"):
        prompt = tiny_prompt(target, text)
        want = vanilla_generate(target, prompt, N).tokens
        corpus = _greedy_corpus(target, prompt)
        spec = LookupSpec(max_ngram=3, tree_depth=2, top_k=1, total_tokens=2)
        for tree in ("dynamic", "static:2"):
            policy = TreePolicy.parse(tree, TreeSpec(tree_depth=1, top_k=2, total_tokens=2))
            cycles = []
            for leaf in (0, 4):
                leafy = LookupSpec(**{**vars(spec), "leaf_depth": leaf, "leaf_count": 2 if leaf else 0})
                for neural in (make_draft("random:concat", target), SharpFullDraft(target)):
                    draft = MergedDraft(neural, leafy, rule, corpus=corpus)
                    got = speculative_generate(target, draft, prompt, N, policy=policy)
                    assert got.tokens == want, (rule, tree, leaf, text)
                cycles.append(got.cycles)  # the sharp draft's
            assert cycles[1] < cycles[0], (rule, tree, text, cycles)


def test_leaf_chain_checkpoint_loads_its_corpus(tmp_path):
    target = tiny_target("tiny-llama")
    prompt = tiny_prompt(target, REPEATING)
    corpus = _greedy_corpus(target, prompt)
    neural = make_draft("random:concat", target)
    spec = LookupSpec(max_ngram=3, tree_depth=2, top_k=1, total_tokens=2, leaf_depth=3, leaf_count=2)
    neural.model.save_pretrained(tmp_path / "d", target, extra={"kind": "neural+lookup", "lookup": vars(spec)})
    with pytest.raises(UserError, match="corpus.safetensors"):
        make_draft(str(tmp_path / "d"), target)  # leaf chains without the corpus they draft from
    corpus.save(tmp_path / "d" / "corpus.safetensors")
    draft = make_draft(str(tmp_path / "d"), target)
    assert isinstance(draft, MergedDraft) and draft.lookup.spec == spec and draft.lookup.corpus is not None
    assert speculative_generate(target, draft, prompt, N).tokens == vanilla_generate(target, prompt, N).tokens
