"""SearchSpace and DraftSupernet: validation, set_active == extract, extracted drafts decode losslessly."""

from __future__ import annotations

import random

import pytest
import torch
import yaml
from conftest import tiny_prompt, tiny_target

from decode.drafts import NeuralDraft
from decode.drafts.model import TargetDims
from decode.errors import UserError
from decode.loop.speculative import speculative_generate
from decode.loop.vanilla import vanilla_generate
from decode.space import SearchSpace
from supernet.elastic import DraftSupernet

ENTROPY = 1


@pytest.fixture(scope="module")
def supernet():
    target = tiny_target("tiny-llava")
    torch.manual_seed(0)
    model = DraftSupernet(SearchSpace.load("tiny"), TargetDims.of(target), ENTROPY,
                          hot_tokens=torch.randperm(target.vocab_size)).attach(target, init_head=True)
    return target, model.eval()


def _run(model, target, prompt, pre, arch):
    """Logits of a draft over the prompt as NeuralDraft feeds it (committed tokens)."""
    feats = torch.cat([pre.hidden[x] for x in arch.feature_layers], -1)
    prev = torch.cat([feats.new_zeros(1, feats.shape[1]), feats[:-1]])
    t = prompt.length
    pos = torch.arange(t)
    cache = model.new_cache()
    model.add_memory(cache, model.project_features(feats), pos)
    h = model(prompt.input_ids[0], model.project_features(prev), pos, torch.ones(t, t, dtype=torch.bool).tril(), cache)
    return model.logits(h)


def test_space_files_and_verbs():
    space = SearchSpace.load()
    assert space.size() > 1000
    largest, smallest = space.largest(12), space.smallest(12)
    assert largest.depth == max(space.depth) and smallest.depth == min(space.depth)
    rng = random.Random(0)
    for _ in range(50):
        space.validate(space.sample(rng, 12), 12)
    with pytest.raises(UserError, match="not in search space"):
        space.validate(largest.__class__(fusion="concat", heads=(5,), ffn=(384,)), 12)


def test_bad_space_files(tmp_path):
    from configs import config_dir

    raw = yaml.safe_load((config_dir("space") / "tiny.yaml").read_text())
    for key, bad, msg in (("heads", [0, 2], ">= 1"), ("fusion", ["sum"], "unknown fusion"), ("depth", [], "no choices"),
                          ("visual_keep", [1.5], "visual_keep")):
        f = tmp_path / f"{key}.yaml"
        f.write_text(yaml.safe_dump({**raw, key: bad}))
        with pytest.raises(UserError, match=msg):
            SearchSpace.load(f)
    f = tmp_path / "layers.yaml"
    f.write_text(yaml.safe_dump({**raw, "feature_layers": [[-1], [40]]}))
    target = tiny_target("tiny-llava")
    with pytest.raises(UserError, match="out of range"):
        DraftSupernet(SearchSpace.load(f), TargetDims.of(target), ENTROPY)
    with pytest.raises(UserError, match="not found"):
        SearchSpace.load("no-such-space")


def test_extract_equals_active_subnet_for_many_archs(supernet):
    target, model = supernet
    prompt = tiny_prompt(target)
    pre = target.prefill(prompt, feature_layers=(0, 1, 2, -1))
    rng = random.Random(0)
    archs = [model.space.largest(ENTROPY), model.space.smallest(ENTROPY)] + [model.sample(rng) for _ in range(25)]
    for arch in archs:
        sub = model.extract(arch, target).eval()
        a = _run(model.set_active(arch), target, prompt, pre, arch)
        b = _run(sub, target, prompt, pre, arch)
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))
        torch.testing.assert_close(a[torch.isfinite(a)], b[torch.isfinite(b)], atol=1e-5, rtol=0)
        n_params = sum(p.numel() for p in sub.parameters())
        assert n_params < sum(p.numel() for p in model.parameters())


def test_extracted_drafts_decode_losslessly(supernet, tmp_path):
    target, model = supernet
    prompt = tiny_prompt(target)
    want = vanilla_generate(target, prompt, 16).tokens
    rng = random.Random(1)
    for arch in [model.space.largest(ENTROPY), model.space.smallest(ENTROPY), model.sample(rng)]:
        sub = model.extract(arch, target)
        sub.save_pretrained(tmp_path / "d", target)
        from decode.drafts import make_draft

        got = speculative_generate(target, make_draft(str(tmp_path / "d"), target), prompt, 16)
        assert got.tokens == want
        assert speculative_generate(target, NeuralDraft(sub), prompt, 16).tokens == want


def test_importance_reordering_keeps_the_largest_function(supernet):
    target, model = supernet
    prompt = tiny_prompt(target)
    pre = target.prefill(prompt, feature_layers=(0, 1, 2, -1))
    arch = model.space.largest(ENTROPY)
    with torch.no_grad():
        for layer in model.layers:  # make the head/channel norms distinct so the order changes
            layer.mlp.down_proj.weight.mul_(torch.linspace(0.5, 2.0, layer.mlp.down_proj.weight.shape[1]))
    before = _run(model.set_active(arch), target, prompt, pre, arch)
    model.reorder_by_importance()
    after = _run(model.set_active(arch), target, prompt, pre, arch)
    torch.testing.assert_close(before, after, atol=1e-5, rtol=0)
    norms = model.layers[0].mlp.down_proj.weight.norm(dim=0)
    assert bool((norms[:-1] >= norms[1:]).all())


def test_any_tree_runs_on_the_supernet_but_not_a_network_outside_its_space(supernet):
    """The tree (depth, top_k, total_tokens) is how a draft runs, not part of its weights: a supernet activates and
    extracts an arch with a tree its space never listed, and the space's weights_dict ignores the tree choices;
    a network field outside the space still fails with a one-line error."""
    from dataclasses import replace

    target, model = supernet
    space = model.space
    arch = replace(space.smallest(ENTROPY), tree_depth=max(space.tree_depth) + 2, top_k=1, total_tokens=1)
    with pytest.raises(UserError, match="tree_depth"):
        space.validate(arch, ENTROPY)
    space.validate(arch, ENTROPY, trees=False)
    assert model.set_active(arch).active == arch and model.extract(arch, target).arch == arch
    with pytest.raises(UserError, match="heads"):
        model.set_active(replace(arch, heads=(max(space.heads) + 1,) * arch.depth))
    widened = replace(space, tree_depth=(*space.tree_depth, 9), total_tokens=(7,))
    assert widened.weights_dict() == space.weights_dict() and widened.to_dict() != space.to_dict()
