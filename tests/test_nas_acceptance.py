"""Simulated greedy tau (replay on stored target data) equals tau of real speculative decoding."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from conftest import single_thread, tiny_target

from decode.datasets import PromptItem
from decode.drafts import NeuralDraft
from decode.drafts.model import TargetDims
from decode.loop.speculative import speculative_generate
from decode.loop.tree import TreePolicy
from decode.space import SearchSpace
from nas.acceptance import estimate_tau
from supernet import checkpoint as ckpt
from supernet.data import DataConfig, build_data, features_on_the_fly
from supernet.dataset import FeatureData
from supernet.elastic import DraftSupernet
from supernet.train import TrainConfig, train

TARGET = "tiny-llava"
ITEMS = [
    PromptItem("a", "Tell me a story about a cat and a dog. The cat and the dog", None, None),
    PromptItem("b", "the cat sat on the mat and the cat", None, None),
    PromptItem("c", "What is in the picture?", "skimage:coffee", None),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny supernet trained briefly so that its drafts accept some tokens."""
    root = tmp_path_factory.mktemp("acc")
    target = tiny_target(TARGET)
    with single_thread():
        build_data(DataConfig(target=TARGET, prompts="sharegpt:8", space="tiny", mode="regenerate", max_len=56,
                              max_new_tokens=32, topk=16, shard_size=4, out=str(root / "data")), target=target)
        train(TrainConfig(target=TARGET, data=str(root / "data"), out=str(root / "sn"), space="tiny", steps=80,
                          lr=3e-3, warmup=5, unroll=2, n_random=1, ckpt_every=80, reorder_at=20, val_sequences=0,
                          device="cpu", dtype="float32", answer_only=False, loss="full",
                          # fp32: 80 bf16 steps leave this tiny draft without a 2-token path to compare
                          autocast="off"))  # accepts 2+ tokens
    data = FeatureData(root / "data", target)
    model = DraftSupernet(SearchSpace.load("tiny"), TargetDims.of(target), data.entropy_layer,
                          data.hot_tokens(128)).attach(target).float().eval()
    ckpt.load_weights(root / "sn" / "checkpoint", model)
    cfg = DataConfig(target=TARGET, space="tiny", mode="regenerate", max_len=80, topk=8, max_new_tokens=40,
                     entropy_layer=data.entropy_layer)
    seqs = [features_on_the_fly(target, item, cfg) for item in ITEMS]  # fp32 features, the target's own answers
    return target, model, seqs


def test_simulated_tau_equals_real_speculative_decoding(trained):
    target, model, seqs = trained
    rng = random.Random(0)
    archs = [model.space.largest(model.entropy_layer), model.space.smallest(model.entropy_layer)]
    archs += [model.sample(rng) for _ in range(5)]
    accepted_any = False
    for arch in archs:
        policy = TreePolicy(spec=arch.tree)
        sim = estimate_tau(NeuralDraft(model.set_active(arch)), seqs, target.num_layers, policy)
        sub = model.extract(arch, target)
        emitted = cycles = 0
        hist: dict[int, int] = {}
        for item, seq in zip(ITEMS, seqs):
            p = int(seq["prompt_len"])
            prompt = target.build_prompt(item.text, item.image)
            real = speculative_generate(target, NeuralDraft(sub), prompt, seq["input_ids"].numel() - p, policy=policy)
            assert real.tokens == seq["input_ids"][p:].tolist()  # the stored answer is the target's greedy text
            emitted += real.new_tokens - 1
            cycles += real.cycles
            for k, v in real.accept_hist.items():
                hist[k] = hist.get(k, 0) + v
        assert sim.cycles == cycles and sim.hist == hist, (arch, sim, hist)
        assert sim.tau == pytest.approx(emitted / cycles, abs=1e-12)
        accepted_any |= sim.tau > 1.0
    assert accepted_any  # the comparison covered accepted tokens, not only rejections


def test_tree_sweep_equals_replay_for_every_tree(trained):
    """One sweep per (subnet, top_k) scores every (depth, total_tokens) exactly as a replay of that tree."""
    from decode.arch import TreeSpec
    from nas.treesweep import TreeSweep

    target, model, seqs = trained
    rng = random.Random(1)
    archs = [model.space.largest(model.entropy_layer)] + [model.sample(rng) for _ in range(2)]
    compared = longer = 0
    for arch in archs:
        draft = NeuralDraft(model.set_active(arch))
        for k in (1, 2, 4):
            sweep = TreeSweep.run(draft, seqs, target.num_layers, top_k=k, max_depth=4)
            for depth in (1, 2, 4):
                for total in (1, 3, 8, 40):
                    spec = TreeSpec(tree_depth=depth, top_k=k, total_tokens=total)
                    want = estimate_tau(draft, seqs, target.num_layers, TreePolicy(spec=spec))
                    got = sweep.acceptance(depth, total)
                    assert (got.cycles, got.emitted, got.hist) == (want.cycles, want.emitted, want.hist), (arch, spec)
                    compared += 1
                    longer += max(want.hist) >= 2
            # a capped number of new tokens goes through the same truncation as the replay
            spec = TreeSpec(tree_depth=4, top_k=k, total_tokens=8)
            want = estimate_tau(draft, seqs, target.num_layers, TreePolicy(spec=spec), max_new_tokens=7)
            got = sweep.acceptance(4, 8, max_new_tokens=7)
            assert (got.cycles, got.emitted, got.hist) == (want.cycles, want.emitted, want.hist)
    assert compared == 3 * 3 * 3 * 4 and longer > 0  # some trees accepted paths of 2+ tokens


def test_sweeps_are_stored_and_reused(trained, tmp_path):
    from nas.objective import SweepTau

    target, model, seqs = trained
    arch = model.space.largest(model.entropy_layer)
    first = SweepTau(model, seqs, target.num_layers, max_depth=3, store=tmp_path, store_key="k1")
    taus = {(d, n): first(replace(arch, tree_depth=d, total_tokens=n)) for d in (1, 2, 3) for n in (2, 8)}
    assert len(list(tmp_path.glob("sweep-*.safetensors"))) == 1 and first.loaded == 0
    again = SweepTau(model, seqs, target.num_layers, max_depth=3, store=tmp_path, store_key="k1")
    again.supernet = None  # a stored sweep needs no draft forward at all
    assert {(d, n): again(replace(arch, tree_depth=d, total_tokens=n)) for d, n in taus} == taus
    assert again.loaded == 1
    other = SweepTau(model, seqs, target.num_layers, max_depth=3, store=tmp_path, store_key="k2")  # other inputs
    assert other(replace(arch, tree_depth=2, total_tokens=8)) == taus[(2, 8)] and other.loaded == 0
    (next(tmp_path.glob("sweep-*.safetensors"))).write_bytes(b"garbage")  # a damaged file is recomputed
    fixed = SweepTau(model, seqs, target.num_layers, max_depth=3, store=tmp_path, store_key="k1")
    assert fixed(replace(arch, tree_depth=3, total_tokens=2)) == taus[(3, 2)]


def _real_decoding(target, seqs, new_draft, policy):
    """Real speculative decoding of every ITEMS prompt with a fresh draft (new_draft()) -> (cycles, accepted-length
    histogram, tree sizes), each output checked equal to the stored continuation."""
    from collections import Counter

    cycles, hist, sizes = 0, Counter(), Counter()
    for item, seq in zip(ITEMS, seqs):
        p = int(seq["prompt_len"])
        real = speculative_generate(target, new_draft(), target.build_prompt(item.text, item.image),
                                    seq["input_ids"].numel() - p, policy=policy)
        assert real.tokens == seq["input_ids"][p:].tolist()
        cycles += real.cycles
        hist.update(real.accept_hist)
        sizes.update(real.tree_sizes)
    return cycles, hist, sizes


def test_lookup_and_merged_replays_equal_real_decoding(trained):
    """Prompt lookup alone and merged with a neural subnet: the replay (nas.kinds) gives the cycles, tokens,
    accepted-length histogram and verified tree sizes of real speculative decoding."""

    from decode.drafts import LookupSpec, MergedDraft, PromptLookupDraft
    from nas.kinds import KindScorer
    from nas.treesweep import TreeSweep

    target, model, seqs = trained
    scorer = KindScorer(seqs, latency=None)
    largest = model.space.largest(model.entropy_layer)
    lookup_hits, sweeps = 0, {}
    # a 2x2/4 tree, and a one-token draft (1x1/1) with the lookup branch the demo search exported with it
    for arch, spec in [(replace(largest, tree_depth=2, top_k=2, total_tokens=4), s) for s in (
                           LookupSpec(max_ngram=2, tree_depth=3, top_k=1, total_tokens=3),
                           LookupSpec(max_ngram=3, tree_depth=4, top_k=2, total_tokens=6),
                           LookupSpec(max_ngram=3, tree_depth=4, top_k=1, total_tokens=4, weak_depth=1))] + [
                       (replace(largest, tree_depth=1, top_k=1, total_tokens=1),
                        LookupSpec(max_ngram=3, tree_depth=4, top_k=1, total_tokens=4, weak_depth=1))]:
        if arch not in sweeps:
            sweeps[arch] = (TreeSweep.run(NeuralDraft(model.set_active(arch)), seqs, target.num_layers,
                                          top_k=arch.top_k, max_depth=3), model.extract(arch, target))
        sweep, sub = sweeps[arch]
        for merged in (False, "union", "switch"):
            rep = scorer.replay_neural(arch, sweep, spec, rule=merged) if merged else scorer.replay_lookup(spec)
            cycles, hist, sizes = _real_decoding(
                target, seqs, lambda: MergedDraft(NeuralDraft(sub), spec, merged) if merged else
                PromptLookupDraft(spec=spec), TreePolicy(spec=arch.tree if merged else spec.tree))
            assert (rep.acceptance.cycles, dict(rep.hist), rep.sizes) == (cycles, dict(hist), sizes), (spec, merged)
            lookup_hits += sum(v for k, v in hist.items() if k > 0) if not merged else 0
        # the merged tree holds both trees whole: it never accepts less than either source alone
        merged_tau = scorer.replay_neural(arch, sweep, spec).acceptance.tau
        assert merged_tau >= max(scorer.replay_lookup(spec).acceptance.tau,
                                 scorer.replay_neural(arch, sweep).acceptance.tau) - 1e-9
    assert lookup_hits > 0  # lookup accepted tokens somewhere: the comparison is not all-rejections


def test_layerskip_replay_equals_real_decoding(trained, tmp_path):
    """The layer-skip self-draft replayed from stored features (nas.kinds) gives the cycles, accepted-length
    histogram and verified sizes of real speculative decoding with LayerSkipDraft, for every stored K and
    chain depth; the exported checkpoint loads as that draft."""
    from collections import Counter

    from decode.arch import TreeSpec
    from decode.drafts import LayerSkipDraft
    from decode.drafts.kinds import load_draft_dir, save_training_free
    from nas.kinds import EarlyExit, KindScorer

    target, _, seqs = trained
    scorer = KindScorer(seqs, latency=None, early_exit=EarlyExit.of(target))
    layers = scorer.layerskip_layers()
    assert layers and all(1 <= k < target.num_layers for k in layers)
    accepted = 0
    for k in layers:
        for depth in (1, 2, 3):
            rep = scorer.replay_layerskip(k, depth)
            cycles, hist, sizes = 0, Counter(), Counter()
            tree = TreeSpec(tree_depth=depth, top_k=1, total_tokens=depth)
            for item, seq in zip(ITEMS, seqs):
                p = int(seq["prompt_len"])
                real = speculative_generate(target, LayerSkipDraft(k, tree), target.build_prompt(item.text, item.image),
                                            seq["input_ids"].numel() - p)
                assert real.tokens == seq["input_ids"][p:].tolist()
                cycles += real.cycles
                hist.update(real.accept_hist)
                sizes.update(real.tree_sizes)
            assert (rep.acceptance.cycles, dict(rep.hist), rep.sizes) == (cycles, dict(hist), sizes), (k, depth)
            accepted += sum(v for m, v in hist.items() if m > 0)
    assert accepted > 0  # the early exit agreed somewhere: not an all-rejections comparison
    draft = load_draft_dir(save_training_free(tmp_path / "ls", "layerskip", target, None, layerskip=(layers[0], 2)),
                           target)
    assert isinstance(draft, LayerSkipDraft) and draft.k == layers[0]
    assert draft.default_tree == TreeSpec(tree_depth=2, top_k=1, total_tokens=2)


def test_bootstrap_interval_brackets_tau_and_narrows_with_more_sequences():
    from nas.kinds import Replay

    few = Replay([(10, 8), (30, 10), (5, 5), (22, 12)])
    many = Replay(few.per_seq * 25)
    lo, hi = few.tau_interval()
    assert lo <= few.acceptance.tau <= hi and hi > lo
    lo2, hi2 = many.tau_interval()
    assert lo2 <= many.acceptance.tau <= hi2 and (hi2 - lo2) < (hi - lo) / 3
    assert Replay([(4, 4)]).tau_interval() == (1.0, 1.0)


def test_bootstrap_resamples_a_conversations_sequences_together():
    """groups: sequences of one conversation are one resampled unit. 100 copies of four sequences labelled as four
    conversations give the four-sequence interval, as independent sequences a far narrower one; a KindScorer labels
    its sequences with their "group" (nas.loading.heldout_sequences sets it) and its rows' intervals use them."""
    import torch

    from nas.kinds import KindScorer, Replay

    few = Replay([(10, 8), (30, 10), (5, 5), (22, 12)])
    copies = Replay(few.per_seq * 100)
    labels = [i % 4 for i in range(400)]
    assert copies.tau_interval(groups=labels) == few.tau_interval()
    lo, hi = copies.tau_interval()
    assert hi - lo < (few.tau_interval()[1] - few.tau_interval()[0]) / 5
    assert Replay([(4, 4), (6, 3)]).tau_interval(groups=["a", "a"]) == (10 / 7, 10 / 7)  # one unit: no interval
    ids = torch.tensor([1, 2, 3, 1, 2, 3, 1, 2])
    seq = {"input_ids": ids, "prompt_len": torch.tensor(3), "topk_ids": torch.cat([ids[1:], ids[:1]])[:, None]}
    scorer = KindScorer([{**seq, "group": "c1"}, seq], None)
    assert scorer.groups == ["c1", "#1"]


def test_heldout_sequences_are_labelled_with_their_conversation(monkeypatch):
    """nas.loading.heldout_sequences gives each held-out sequence its conversation (chat turns and first messages
    of one ShareGPT conversation alike, photo questions by photo), which the tau intervals resample whole."""
    from types import SimpleNamespace

    import torch

    from decode.datasets import conversation_of
    from decode.space import SearchSpace
    from nas import loading

    assert conversation_of("sharegpt:QWJhYvA_0") == conversation_of("chat:QWJhYvA_7:2") == "QWJhYvA"
    assert conversation_of("image:coffee:3") == conversation_of("image:coffee:5") != conversation_of("image:rocket:3")
    ids = ["sharegpt:abc_0", "chat:abc_1:2", "image:coffee:1", "sharegpt:xyz_0"]

    class Data:
        def __init__(self, directory, target=None):
            self.dir, self.ids, self.manifest = directory, ids, {"config": {"split": "heldout"}}

        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": torch.arange(6), "prompt_len": torch.tensor(3)}

        def layer_index(self, layer):
            return 0

    monkeypatch.setattr(loading, "FeatureData", Data)
    held = loading.heldout_sequences(None, SimpleNamespace(entropy_layer=1), {}, "held", 4, SearchSpace.load("tiny"))
    assert [s["group"] for s in held.sequences] == ["abc", "abc", "image:coffee", "xyz"]


def test_every_lookup_of_the_grid_gets_corpus_branches():
    """with_corpus: all CORPUS_BRANCHES beside the narrow lookups (one branch, full matches, <= 4 tokens), the widest
    beside the rest (two branches, 8 tokens, weak matches: what a GPU pairs with wide neural trees)."""
    from decode.drafts.prompt_lookup import LookupSpec
    from nas.kinds import CORPUS_BRANCHES, LOOKUP_GRID, WIDE_CORPUS, with_corpus

    grid = with_corpus(LOOKUP_GRID)
    for spec in LOOKUP_GRID:
        variants = {(s.corpus_depth, s.corpus_second) for s in grid
                    if replace(s, corpus_depth=0, corpus_second=0) == spec}
        narrow = spec.top_k == 1 and not spec.weak_depth and spec.tree_depth <= 4
        assert variants == set(CORPUS_BRANCHES if narrow else WIDE_CORPUS), spec
    assert LookupSpec(max_ngram=2, tree_depth=8, top_k=2, total_tokens=16, corpus_depth=4, corpus_second=2) in grid
    assert all(s.corpus_depth for s in grid) and len(set(grid)) == len(grid)


def test_corpus_lookup_replay_equals_real_decoding(trained):
    """Lookup with corpus branches (decode/drafts/corpus.py; one, and two with the runner-up), alone and merged with a
    neural subnet: the replay gives real decoding's cycles, tokens, accepted-length histogram and tree sizes, and the
    corpus branches accept tokens."""

    from decode.drafts import LookupSpec, MergedDraft, PromptLookupDraft
    from decode.drafts.corpus import NgramCorpus
    from nas.kinds import KindScorer
    from nas.treesweep import TreeSweep

    target, model, seqs = trained
    # a corpus that knows half of every answer (a test needs hits) among random token sequences
    rng = random.Random(0)
    answers = [s["input_ids"][int(s["prompt_len"]):].tolist() for s in seqs]
    corpus = NgramCorpus.build([a[: len(a) // 2] for a in answers] +
                               [[rng.randrange(target.vocab_size) for _ in range(40)] for _ in range(20)],
                               target.vocab_size)
    scorer = KindScorer(seqs, latency=None, corpus=corpus)
    arch = replace(model.space.largest(model.entropy_layer), tree_depth=1, top_k=1, total_tokens=1)
    sweep = TreeSweep.run(NeuralDraft(model.set_active(arch)), seqs, target.num_layers, top_k=1, max_depth=1)
    sub = model.extract(arch, target)
    corpus_hits = 0
    for spec in (LookupSpec(max_ngram=2, tree_depth=2, top_k=1, total_tokens=2, corpus_depth=4),
                 LookupSpec(max_ngram=3, tree_depth=4, top_k=1, total_tokens=4, corpus_depth=2),
                 LookupSpec(max_ngram=2, tree_depth=2, top_k=1, total_tokens=2, corpus_depth=4, corpus_second=2),
                 LookupSpec(max_ngram=2, tree_depth=4, top_k=2, total_tokens=8, corpus_depth=4, corpus_second=2)):
        plain = replace(spec, corpus_depth=0, corpus_second=0)
        for merged in (False, "union", "switch"):
            rep = scorer.replay_neural(arch, sweep, spec, rule=merged) if merged else scorer.replay_lookup(spec)
            cycles, hist, sizes = _real_decoding(
                target, seqs, lambda: MergedDraft(NeuralDraft(sub), spec, merged, corpus=corpus) if merged else
                PromptLookupDraft(spec=spec, corpus=corpus), TreePolicy(spec=arch.tree if merged else spec.tree))
            assert (rep.acceptance.cycles, dict(rep.hist), rep.sizes) == (cycles, dict(hist), sizes), (spec, merged)
        with_corpus, without = scorer.replay_lookup(spec).acceptance.tau, scorer.replay_lookup(plain).acceptance.tau
        assert with_corpus >= without - 1e-9  # the corpus branch only adds nodes
        corpus_hits += with_corpus > without
    assert corpus_hits > 0  # the corpus branch accepted tokens lookup alone did not


def test_leaf_chain_replay_equals_real_decoding_and_the_search_prices_it(trained):
    """Corpus chains under the neural tree's best leaves (decode/drafts/merged.py), union and switch, on a 2x2/4 and a
    one-level 1x3/3 tree: the replay gives real decoding's cycles, accepted-length histogram and tree sizes; the
    chains accept tokens; on a profile where verifying is free the search's merged row takes them, on one where
    every verified token costs a step it does not."""
    from decode.drafts import LookupSpec, MergedDraft
    from decode.drafts.corpus import NgramCorpus
    from nas.kinds import LEAF_CHAINS, KindScorer
    from nas.treesweep import TreeSweep

    target, model, seqs = trained
    rng = random.Random(1)
    answers = [s["input_ids"][int(s["prompt_len"]):].tolist() for s in seqs]
    corpus = NgramCorpus.build([a[: len(a) // 2] for a in answers] +
                               [[rng.randrange(target.vocab_size) for _ in range(40)] for _ in range(20)],
                               target.vocab_size)
    scorer = KindScorer(seqs, latency=None, corpus=corpus)
    largest = model.space.largest(model.entropy_layer)
    gained = 0
    for arch in (replace(largest, tree_depth=2, top_k=2, total_tokens=4),
                 replace(largest, tree_depth=1, top_k=3, total_tokens=3)):
        sweep = TreeSweep.run(NeuralDraft(model.set_active(arch)), seqs, target.num_layers, top_k=arch.top_k,
                              max_depth=arch.tree_depth)
        sub = model.extract(arch, target)
        for spec in (LookupSpec(max_ngram=2, tree_depth=2, top_k=1, total_tokens=2, leaf_depth=3, leaf_count=2),
                     LookupSpec(max_ngram=3, tree_depth=3, top_k=1, total_tokens=3, corpus_depth=2, corpus_second=1,
                                leaf_depth=2, leaf_count=4)):
            for rule in ("union", "switch"):
                rep = scorer.replay_neural(arch, sweep, spec, rule=rule)
                cycles, hist, sizes = _real_decoding(target, seqs, lambda: MergedDraft(NeuralDraft(sub), spec, rule,
                                                                                       corpus=corpus),
                                                     TreePolicy(spec=arch.tree))
                assert (rep.acceptance.cycles, dict(rep.hist), rep.sizes) == (cycles, dict(hist), sizes), (arch,
                                                                                                          spec, rule)
            plain = replace(spec, leaf_depth=0, leaf_count=0)
            with_chains = scorer.replay_neural(arch, sweep, spec).acceptance.tau
            assert with_chains >= scorer.replay_neural(arch, sweep, plain).acceptance.tau - 1e-9  # chains only add
            gained += with_chains > scorer.replay_neural(arch, sweep, plain).acceptance.tau
    assert gained > 0  # the chains accepted tokens the tree and lookup did not

    class Flat:  # a device that verifies any tree for the price of one step (drafting free), or one that pays a
        def __init__(self, per_token):  # step per verified token
            self.per_token = per_token

        def target_step_ms(self, context=None):
            return 10.0

        def verify_ms(self, n, context=None):
            return 10.0 + self.per_token * (n - 1)

        def breakdown(self, arch, accepted=1.0, context=None):
            return {"verify": 0.0, "total": 0.0}

    arch = replace(largest, tree_depth=1, top_k=3, total_tokens=3)
    sweep = TreeSweep.run(NeuralDraft(model.set_active(arch)), seqs, target.num_layers, top_k=3, max_depth=1)
    for per_token, chains in ((0.0, True), (10.0, False)):
        priced = KindScorer(seqs, Flat(per_token), lookup_ms=0.0, corpus=corpus, corpus_ms=0.0)
        row = priced.best_merged(arch, sweep, [1], [3], grid=(LookupSpec(max_ngram=2, tree_depth=2, top_k=1,
                                                                          total_tokens=2),))
        leaf = (row["lookup"]["leaf_depth"], row["lookup"]["leaf_count"])
        assert (leaf in LEAF_CHAINS) == chains and (leaf == (0, 0)) == (not chains), (per_token, row["lookup"])


def test_a_merged_design_whose_network_never_drafts_is_not_the_merged_row(trained):
    """Beside a corpus branch the lookup trie is never empty, so the switch rule never runs the network: that design
    is the lookup row's, with weights it does not use. The merged row records the share of cycles its network
    drafts and best_merged passes over designs below MIN_NEURAL_SHARE, even when one of them prices best (here:
    verifying costs a step per token, so the smaller switch trees win on price)."""
    from decode.drafts import LookupSpec
    from decode.drafts.corpus import NgramCorpus
    from nas.kinds import MIN_NEURAL_SHARE, KindScorer
    from nas.treesweep import TreeSweep

    target, model, seqs = trained
    answers = [s["input_ids"][int(s["prompt_len"]):].tolist() for s in seqs]
    every = list(range(target.vocab_size)) + [0]  # every token has a next one: a corpus branch at every root
    corpus = NgramCorpus.build([a[: len(a) // 2] for a in answers] + [every], target.vocab_size)

    class PerToken:  # every verified token costs a step; drafting is free
        def target_step_ms(self, context=None):
            return 10.0

        def verify_ms(self, n, context=None):
            return 10.0 * n

        def breakdown(self, arch, accepted=1.0, context=None):
            return {"verify": 0.0, "total": 0.0}

    arch = replace(model.space.largest(model.entropy_layer), tree_depth=2, top_k=2, total_tokens=4)
    sweep = TreeSweep.run(NeuralDraft(model.set_active(arch)), seqs, target.num_layers, top_k=2, max_depth=2)
    scorer = KindScorer(seqs, PerToken(), lookup_ms=0.0, corpus=corpus, corpus_ms=0.0)
    spec = LookupSpec(max_ngram=2, tree_depth=2, top_k=1, total_tokens=2, corpus_depth=2, corpus_second=1)
    switch = scorer.neural(arch, sweep, spec, rule="switch")
    union = scorer.neural(arch, sweep, spec, rule="union")
    assert switch["neural_share"] == 0.0 and union["neural_share"] == 1.0
    alone = scorer.lookup(spec)
    assert (switch["tau"], switch["verify_tokens"]) == (alone["tau"], alone["verify_tokens"])  # the lookup design
    assert switch["speedup"] > union["speedup"]  # it would win on price
    row = scorer.best_merged(arch, sweep, [1, 2], [2, 4], grid=(spec,))
    assert row["neural_share"] >= MIN_NEURAL_SHARE and row["merge"] == "union"
