"""Grouped-query tree attention without repeat_kv (decode/targets/attention.py): the same values as
transformers' SDPA path, installed on every loaded target, and no KV copy when a tree is verified."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from conftest import ALL_PRESETS, tiny_prompt, tiny_target

from decode.targets.attention import PACKED_SDPA, packed_gqa_attention


class _Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("bool_mask", [False, True])
def test_packed_equals_transformers_sdpa(n, groups, batch, bool_mask):
    g = torch.Generator().manual_seed(n * 10 + groups)
    kvh, d, k_len = 2, 16, 11
    q = torch.randn(batch, kvh * groups, n, d, generator=g)
    k = torch.randn(batch, kvh, k_len, d, generator=g)
    v = torch.randn(batch, kvh, k_len, d, generator=g)
    allowed = torch.rand(batch, 1, n, k_len, generator=g) > 0.4
    allowed[..., 0] = True  # every query sees at least one key
    mask = allowed if bool_mask else torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = _Module(groups).eval()
    ours, _ = packed_gqa_attention(module, q, k, v, mask, scaling=d ** -0.5)
    ref, _ = hf_sdpa.sdpa_attention_forward(module, q, k, v, mask, scaling=d ** -0.5)
    assert ours.shape == ref.shape == (batch, n, kvh * groups, d)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_every_loaded_target_uses_it():
    for name in ALL_PRESETS:
        assert tiny_target(name).model.config._attn_implementation == PACKED_SDPA, name


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-qwen2.5-vl"])
def test_tree_verification_copies_no_kv(name, monkeypatch):
    """A 5-node tree on a grouped-KV target: the logits equal those of transformers' SDPA (which copies the
    cache with repeat_kv), and with our implementation repeat_kv is never called."""
    target = tiny_target(name)
    prompt = tiny_prompt(target)
    parents = torch.tensor([-1, 0, 0, 1, 2])
    tokens = torch.tensor([5, 7, 9, 11, 13])

    def tree_logits() -> torch.Tensor:
        target.prefill(prompt)
        out = target.forward_tree(tokens, parents)
        target.keep([0])
        return out.logits

    target.model.set_attn_implementation("sdpa")
    try:
        ref = tree_logits()
    finally:
        target.model.set_attn_implementation(PACKED_SDPA)

    def no_copy(*args, **kwargs):
        raise AssertionError("repeat_kv called during tree verification")

    monkeypatch.setattr(hf_sdpa, "repeat_kv", no_copy)
    torch.testing.assert_close(tree_logits(), ref, rtol=1e-5, atol=1e-5)
