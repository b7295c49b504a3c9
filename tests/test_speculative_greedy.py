"""Greedy speculative decoding is token-for-token identical to vanilla greedy decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_prompt, tiny_target

from decode.arch import TreeSpec
from decode.drafts import LayerSkipDraft, NeuralDraft, PromptLookupDraft, make_draft, random_arch
from decode.drafts.model import DraftModel, TargetDims
from decode.loop.speculative import speculative_generate
from decode.loop.tree import TreePolicy
from decode.loop.vanilla import vanilla_generate

FAMILIES = ("tiny-llama", "tiny-gemma3-text", "tiny-llava", "tiny-qwen2.5-vl")
PROMPTS = ("Tell me a story about a cat and a dog. The cat and the dog", "List three colours:")
TREES = ("chain", "static:3,2,1", "dynamic")
N = 24


def _policy(tree: str, draft) -> TreePolicy:
    return TreePolicy.parse(tree, TreeSpec(tree_depth=4, top_k=3, total_tokens=10))


def _check_lossless(target, draft, tree: str):
    for text in PROMPTS:
        prompt = tiny_prompt(target, text)
        want = vanilla_generate(target, prompt, N).tokens
        got = speculative_generate(target, draft, prompt, N, policy=_policy(tree, draft))
        assert got.tokens == want, (draft.name, tree, text)
        assert got.cycles >= 1 and sum(got.accept_hist.values()) == got.cycles


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fusion", ["concat", "cross", "hybrid"])
def test_random_neural_drafts_lossless(family, fusion):
    target = tiny_target(family)
    draft = make_draft(f"random:{fusion}", target)
    for tree in TREES:
        _check_lossless(target, draft, tree)


@pytest.mark.parametrize("family", FAMILIES + ("tiny-gemma3", "tiny-paligemma", "tiny-mistral3"))
def test_prompt_lookup_and_layerskip_lossless(family):
    target = tiny_target(family)
    for draft in (PromptLookupDraft(), LayerSkipDraft(1)):
        for tree in TREES:
            _check_lossless(target, draft, tree)


class OracleDraft(NeuralDraft):
    """A neural draft nudged toward the known greedy continuation at `every`-th position, so that
    long accepted paths (and the draft's bookkeeping of accepted tokens) are exercised."""

    def __init__(self, model, continuation: list[int], prompt_len: int, every: int = 1):
        super().__init__(model)
        self.cont, self.t0, self.every = continuation, prompt_len, every

    def _node_logits(self, nodes, tokens, parents):
        logits = super()._node_logits(nodes, tokens, parents).clone()
        for row, node in enumerate(torch.as_tensor(nodes).tolist()):
            depth = 0 if node == 0 else int(self.slots.depth_of[node])
            i = self.root_pos + depth + 1 - self.t0  # index into the continuation of the predicted token
            if 0 <= i < len(self.cont) and i % self.every != self.every - 1:
                logits[row, self.cont[i]] += 1000.0
        return logits


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-llava"])
@pytest.mark.parametrize("fusion", ["concat", "cross", "hybrid"])
def test_accepting_draft_is_lossless_and_its_cache_matches_a_fresh_feed(family, fusion):
    target = tiny_target(family)
    prompt = tiny_prompt(target, PROMPTS[0])
    want = vanilla_generate(target, prompt, N).tokens
    torch.manual_seed(0)
    model = DraftModel(random_arch(target, fusion), TargetDims.of(target)).attach(target, init_head=True).eval()
    for every in (1000, 4):  # always right; wrong at every 4th position (partial accepts)
        draft = OracleDraft(model, want, prompt.length, every)
        got = speculative_generate(target, draft, prompt, N, policy=TreePolicy.parse("chain", TreeSpec(5, 1, 5)))
        assert got.tokens == want
        assert got.tau > 1.5, got.accept_hist
    # the draft's committed cache equals feeding the whole accepted sequence from scratch
    committed = draft.cache.committed
    full = torch.cat([prompt.input_ids[0], torch.tensor(want[: committed - prompt.length])])
    fresh_prompt = type(prompt)(input_ids=full[None], model_inputs={**prompt.model_inputs, "input_ids": full[None],
                                "attention_mask": torch.ones_like(full)[None]})
    pre = target.prefill(fresh_prompt, feature_layers=draft.feature_layers)
    fresh = NeuralDraft(model)
    fresh.start(target, fresh_prompt, pre)
    fresh._begin(0, 1, fresh._device())
    fresh._node_logits(torch.tensor([0]), torch.tensor([want[committed - prompt.length]]), torch.tensor([-1]))
    for a, b in zip(draft.cache.kv, fresh.cache.kv):
        torch.testing.assert_close(a[0][:, :committed], b[0][:, :committed], atol=1e-4, rtol=0)
        torch.testing.assert_close(a[1][:, :committed], b[1][:, :committed], atol=1e-4, rtol=0)


def test_visual_keep_below_one_is_lossless_and_drops_image_tokens():
    target = tiny_target("tiny-llava")
    torch.manual_seed(0)
    arch = random_arch(target, "hybrid", visual_keep=0.25)
    draft = NeuralDraft(DraftModel(arch, TargetDims.of(target)).attach(target, init_head=True).eval())
    prompt = tiny_prompt(target, PROMPTS[0])
    want = vanilla_generate(target, prompt, N).tokens
    got = speculative_generate(target, draft, prompt, N)
    assert got.tokens == want
    # after start(), the draft sees all text tokens and ceil(25%) of the image tokens, the most attended ones
    image_pos = (prompt.input_ids[0] == target.image_token_id).nonzero().flatten()
    pre = target.prefill(prompt, feature_layers=(-1,), attention_stats=True)
    draft.start(target, prompt, pre)
    n_keep = -(-image_pos.numel() // 4)
    assert draft.pending_pos.numel() == prompt.length - image_pos.numel() + n_keep
    assert draft.cache.mem_pos.tolist() == draft.pending_pos.tolist()
    kept = sorted(set(draft.pending_pos.tolist()) & set(image_pos.tolist()))
    best = pre.attn_received[image_pos].topk(n_keep).indices
    assert kept == sorted(image_pos[best].tolist())


def test_limits_and_eos():
    target = tiny_target("tiny-llama")
    prompt = tiny_prompt(target, PROMPTS[0])
    want = vanilla_generate(target, prompt, 7).tokens
    for n in (1, 2, 7):
        got = speculative_generate(target, PromptLookupDraft(), prompt, n)
        assert got.tokens == want[:n] and len(got.tokens) <= n
    # make the 3rd greedy token an EOS: generation must stop right there, like vanilla
    eos = want[2]
    target.tokenizer.eos_token_id, old = eos, target.tokenizer.eos_token_id
    try:
        v = vanilla_generate(target, prompt, 20).tokens
        s = speculative_generate(target, LayerSkipDraft(1), prompt, 20).tokens
    finally:
        target.tokenizer.eos_token_id = old
    assert v == s == want[:3]


def test_attention_statistics_only_for_prompts_with_an_image(monkeypatch):
    """A draft that keeps part of the image tokens ranks them by the attention they receive, which needs an
    eager-attention prefill; a text prompt has no image tokens, so it must take the normal prefill (on the
    compiled runtime the statistics took 2.1 s of a 0.4 s prefill). Output stays vanilla's either way."""
    target = tiny_target("tiny-llava")
    model = DraftModel(random_arch(target, visual_keep=0.5), TargetDims.of(target))
    torch.manual_seed(0)
    draft = NeuralDraft(model.attach(target, init_head=True).eval())
    assert draft.attention_stats
    asked = []
    real = target.prefill
    monkeypatch.setattr(target, "prefill", lambda *a, **k: asked.append(k.get("attention_stats")) or real(*a, **k))
    for with_image in (False, True):
        prompt = tiny_prompt(target, with_image=with_image)
        want = vanilla_generate(target, prompt, 8).tokens
        assert speculative_generate(target, draft, prompt, 8).tokens == want
    assert asked == [None, False, None, True]  # vanilla's prefill (no statistics asked), then the draft's
