"""One host read per speculative cycle: trees are built, verified and kept on the device.

On a GPU every read of a tensor's value (.tolist(), .item(), int(t), bool(t), nonzero ...) waits for the queued
work; the loop may read once per cycle (the accepted path and bonus). These tests count such reads through a
TorchFunctionMode on CPU, where they are free but visible, so a per-node or per-level read added anywhere in
draft -> build_tree -> forward_tree -> verify -> keep -> accept fails here.
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from conftest import single_thread, tiny_prompt, tiny_target
from torch.overrides import TorchFunctionMode

from decode.arch import TreeSpec
from decode.drafts import LayerSkipDraft, make_draft
from decode.loop.speculative import speculative_generate
from decode.loop.tree import DraftTree, TreePolicy, build_tree
from decode.loop.vanilla import vanilla_generate
from decode.loop.verify import _greedy_on_device, verify_greedy

READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "masked_select", "unique",
         "numpy", "argwhere"}
TEXT = "Tell me a story about a cat and a dog. The cat and the dog"
N = 24


class HostReads(TorchFunctionMode):
    """Counts tensor-to-host reads made inside the block, by call site."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            frame = traceback.extract_stack(limit=2)[0]
            self.sites[f"{func.__name__} {frame.filename}:{frame.lineno}"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def _count(target, draft, policy):
    prompt = tiny_prompt(target, TEXT)
    speculative_generate(target, draft, prompt, N, policy=policy)  # warm (compiled runtime: graphs built)
    with HostReads() as reads:
        res = speculative_generate(target, draft, prompt, N, policy=policy)
    return res, reads


# (draft, tree): neural drafts of every fusion over every tree kind, and the layer-skip self-draft
CASES = [("random:concat", "dynamic"), ("random:cross", "chain"), ("random:hybrid", "static:3,2,1"),
         ("layerskip:1", "dynamic")]


@pytest.mark.parametrize("name,tree", CASES)
def test_greedy_cycles_read_the_host_once(name, tree):
    target = tiny_target("tiny-llama")
    draft = LayerSkipDraft(1) if name.startswith("layerskip") else make_draft(name, target)
    spec = TreeSpec(tree_depth=4, top_k=3, total_tokens=10)
    policy = TreePolicy.parse(tree, spec)
    res, reads = _count(target, draft, policy)
    assert res.tokens == vanilla_generate(target, tiny_prompt(target, TEXT), N).tokens
    # one read per cycle; the last cycles of a generation may truncate their tree (one read each, at most one per
    # tree level); the prefill's first token, the draft's start and the mask setup are once per generation
    budget = res.cycles + len(policy.levels or range(spec.tree_depth)) + 3
    assert res.cycles >= 4 and reads.total <= budget, (res.cycles, reads.sites.most_common(8))


def test_compiled_runtime_cycles_read_the_host_once():
    target = tiny_target("tiny-llama")
    draft = make_draft("random:concat", target)
    policy = TreePolicy(spec=TreeSpec(tree_depth=2, top_k=2, total_tokens=4))
    with single_thread():
        try:
            target.use_runtime("compiled")
            res, reads = _count(target, draft, policy)
        finally:
            target.use_runtime("eager")
    assert res.cycles >= 4 and reads.total <= res.cycles + 2 + 3, (res.cycles, reads.sites.most_common(8))


class TensorScorer:
    """A draft stand-in whose log-probs depend on (parent token, depth) and that never reads a value itself."""

    def __init__(self, vocab: int = 13):
        g = torch.Generator().manual_seed(1)
        self.table = torch.log_softmax(torch.randn(vocab, 9, vocab, generator=g) * 2, dim=-1)
        self.depth = torch.zeros(200, dtype=torch.long)

    def score(self, nodes, tokens, parents):
        depth = torch.where(parents >= 0, self.depth[parents.clamp(min=0)] + 1, 0)
        self.depth[nodes] = depth
        return self.table[tokens, depth]


@pytest.mark.parametrize("tree", ["dynamic", "chain", "static:3,2,1"])
def test_tree_builders_read_nothing_back(tree):
    policy = TreePolicy.parse(tree, TreeSpec(tree_depth=5, top_k=4, total_tokens=20))
    with HostReads() as reads:
        built = build_tree(TensorScorer(), 3, policy)
        built.mask  # the ancestor mask the target's forward and the verification use
    assert reads.total == 0, reads.sites
    assert built.size <= policy.created_nodes()
    built.validate()  # and the tree it made is a valid one


def _walk(tree, logits):
    """The greedy rule by hand: from the root, the first child (by index) whose token is the target's argmax."""
    pred, tokens, parents = logits.argmax(-1).tolist(), tree.tokens.tolist(), tree.parents.tolist()
    path = [0]
    while True:
        kids = [c for c in range(len(tokens)) if parents[c] == path[-1] and tokens[c] == pred[path[-1]]]
        if not kids:
            return path, pred[path[-1]]
        path.append(kids[0])


@pytest.mark.parametrize("seed", range(30))
def test_device_greedy_verification_equals_the_walk(seed):
    """Random trees with repeated sibling tokens (merged trees can hold them) and logits that often agree."""
    g = torch.Generator().manual_seed(seed)
    n, vocab = int(torch.randint(1, 14, (1,), generator=g)), 4
    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
    tree = DraftTree(torch.randint(0, vocab, (n,), generator=g), parents).validate()
    logits = torch.randn(n, vocab, generator=g)
    path, bonus = _walk(tree, logits)
    for verdict in (verify_greedy(tree, logits), _greedy_on_device(tree, logits)):  # the CPU walk, the tensor rule
        assert (verdict.path, verdict.bonus) == (path, bonus)
        assert verdict.tokens == tree.tokens[path].tolist()


def test_vanilla_steps_read_the_host_once():
    """The baseline must not carry reads the speculative loop shed: one per token (the greedy choice)."""
    target = tiny_target("tiny-llama")
    prompt = tiny_prompt(target, TEXT)
    vanilla_generate(target, prompt, 4)
    with HostReads() as reads:
        res = vanilla_generate(target, prompt, N)
    assert reads.total <= len(res.tokens) + 2, reads.sites.most_common(8)
