"""decode/targets/compat.py: the KV-cache keyword of every forward we call. transformers 5.17 (the GPU image's)
names it `past_key_values`, 5.25 `cache`; a wrong name is swallowed by the models' **kwargs and decoding then runs
without its cache (seen on an H200: "The---------------" for the France prompt). CI has one release: the old
signature is simulated."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_prompt, tiny_target

from decode.loop.vanilla import vanilla_generate
from decode.targets.compat import cache_arg, cache_kwargs, check_fingerprint


class _Old(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
        return past_key_values


class _New(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
        return cache


class _Neither(torch.nn.Module):
    def forward(self, input_ids=None, **kwargs):
        return None


def test_the_name_follows_the_forward_signature():
    marker = object()
    assert cache_arg(_Old()) == "past_key_values" and _Old()(**cache_kwargs(_Old(), marker)) is marker
    assert cache_arg(_New()) == "cache" and _New()(**cache_kwargs(_New(), marker)) is marker
    with pytest.raises(TypeError, match="neither"):
        cache_arg(_Neither())


def test_vanilla_decoding_uses_its_cache_like_hf_generate():
    """A cache passed under the wrong name would be ignored: greedy tokens would then differ from HF generate."""
    target = tiny_target("tiny-llama")
    prompt = tiny_prompt(target)
    inputs = {k: v.to(target.device) if torch.is_tensor(v) else v for k, v in prompt.model_inputs.items()}
    ref = target.model.generate(**inputs, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    ours = vanilla_generate(target, prompt, 12).tokens
    assert ours == ref[0, prompt.length:].tolist()[: len(ours)] and len(ours) >= 6


def test_a_fingerprint_differing_only_in_its_config_hash_passes_with_a_warning(caplog):
    here = {"family": "llama", "hidden_size": 64, "num_layers": 2, "vocab_size": 100, "config_hash": "a" * 16,
            "weights_digest": "b" * 16}
    assert check_fingerprint(dict(here), here, "draft d") is None and not caplog.text
    with caplog.at_level("WARNING"):
        assert check_fingerprint({**here, "config_hash": "c" * 16}, here, "draft d") is None
    assert "draft d" in caplog.text and "serialises differently" in caplog.text
    for key, value in (("weights_digest", "d" * 16), ("num_layers", 3), ("family", "qwen2")):
        diff = check_fingerprint({**here, key: value, "config_hash": "c" * 16}, here, "draft d")
        assert diff is not None and key in diff and "config_hash" in diff
    assert check_fingerprint({}, here, "data x") is not None  # an artifact with no fingerprint fits nothing
