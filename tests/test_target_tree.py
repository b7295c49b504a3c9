"""TargetModel.forward_tree / keep for every family: trees equal paths, keep equals recomputation."""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_PRESETS, tiny_prompt, tiny_target

# a branching tree of 8 nodes: two children of the root, grandchildren, one depth-3 leaf
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 5, 3])


def _leaf_paths(parents: torch.Tensor) -> list[list[int]]:
    n = parents.numel()
    has_child = {int(p) for p in parents.tolist() if p >= 0}
    paths = []
    for leaf in range(n):
        if leaf in has_child:
            continue
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = int(parents[node])
        paths.append(path[::-1])
    return paths


def _tree_tokens(target, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, target.vocab_size - 1, (n,), generator=g)


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_tree_equals_paths_and_keep_equals_scratch(name):
    target = tiny_target(name)
    prompt = tiny_prompt(target)
    tokens = _tree_tokens(target, PARENTS.numel())

    target.prefill(prompt)
    tree = target.forward_tree(tokens, PARENTS, feature_layers=(-1, 1))
    target.keep([0])

    for path in _leaf_paths(PARENTS):
        target.prefill(prompt)
        chain = torch.tensor([-1] + list(range(len(path) - 1)))
        ref = target.forward_tree(tokens[path], chain, feature_layers=(-1, 1))
        target.keep(list(range(len(path))))
        torch.testing.assert_close(tree.logits[path], ref.logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(tree.hidden[-1][path], ref.hidden[-1], atol=1e-4, rtol=0)
        torch.testing.assert_close(tree.hidden[1][path], ref.hidden[1], atol=1e-4, rtol=0)

    # keep a deep path, then keep decoding: must equal decoding the same tokens one by one from scratch
    path = [0, 2, 5, 6]
    extra = [11, 12, 13]
    target.prefill(prompt)
    target.forward_tree(tokens, PARENTS)
    target.keep(path)
    assert target.seq_len == prompt.length + len(path)
    kept = [(layer.keys.clone(), layer.values.clone()) for layer in target.cache.layers]
    after = [target.step(t).logits[0] for t in extra]

    target.prefill(prompt)
    for t in tokens[path].tolist():
        target.step(t)
    # the committed cache after keep (tentative rows moved in place) is the cache of decoding the path
    for (keys, values), layer in zip(kept, target.cache.layers, strict=True):
        assert keys.shape == layer.keys.shape and values.shape == layer.values.shape
        torch.testing.assert_close(keys, layer.keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(values, layer.values, atol=1e-4, rtol=0)
    scratch = [target.step(t).logits[0] for t in extra]
    for a, b in zip(after, scratch):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3-text"])
def test_tree_matches_full_forward_text(name):
    """Independent reference for text targets: the HF model over prompt + path, no cache."""
    target = tiny_target(name)
    prompt = tiny_prompt(target, "a prompt long enough to pass the sliding window of the tiny gemma")
    tokens = _tree_tokens(target, PARENTS.numel())
    target.prefill(prompt)
    tree = target.forward_tree(tokens, PARENTS)
    target.keep([0])
    for path in _leaf_paths(PARENTS):
        ids = torch.cat([prompt.input_ids[0], tokens[path]])[None]
        with torch.no_grad():
            ref = target.model(input_ids=ids).logits[0, prompt.length:]
        torch.testing.assert_close(tree.logits[path], ref, atol=1e-4, rtol=0)


def test_keep_rejects_non_paths():
    target = tiny_target("tiny-llama")
    target.prefill(tiny_prompt(target))
    target.forward_tree(_tree_tokens(target, PARENTS.numel()), PARENTS)
    with pytest.raises(ValueError):
        target.keep([0, 3])  # 3 is a grandchild of 0, not a child
    with pytest.raises(ValueError):
        target.keep([1])  # does not start at depth 0
    target.keep([0, 1, 3])
    with pytest.raises(RuntimeError):
        target.keep([0])  # no pending tree
