"""Prefill: captured layers equal HF hidden states, image positions, attention statistics, fingerprints."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ALL_PRESETS, VLM_PRESETS, photo, tiny_prompt, tiny_target

from decode.targets.capture import normalize_layer


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_prefill_captures_requested_layers_only(name):
    target = tiny_target(name)
    prompt = tiny_prompt(target)
    layers = (0, 1, -2, -1)
    pre = target.prefill(prompt, feature_layers=layers, all_logits=True)
    assert set(pre.hidden) == set(layers)
    inputs = dict(prompt.model_inputs)
    with torch.no_grad():
        ref = target.model(**inputs, output_hidden_states=True)
    hs = ref.hidden_states
    for k in layers:
        idx = normalize_layer(k, target.num_layers)
        torch.testing.assert_close(pre.hidden[k], hs[idx][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(pre.logits, ref.logits[0].float(), atol=1e-5, rtol=0)
    assert pre.hidden[-1].shape == (prompt.length, target.hidden_size)


@pytest.mark.parametrize("name", VLM_PRESETS)
def test_image_positions(name):
    target = tiny_target(name)
    prompt = tiny_prompt(target)
    pre = target.prefill(prompt)
    assert pre.image_positions.numel() > 0
    assert bool((prompt.input_ids[0, pre.image_positions] == target.image_token_id).all())
    text_only = target.prefill(tiny_prompt(target, with_image=False))
    assert text_only.image_positions.numel() == 0


def test_attention_statistics_match_manual_entropy():
    target = tiny_target("tiny-llava")
    prompt = tiny_prompt(target)
    pre = target.prefill(prompt, attention_stats=True)
    assert target.model.config._attn_implementation != "eager"  # switched back after prefill
    t = prompt.length
    assert pre.attn_entropy.shape == (target.num_layers, t)
    assert pre.attn_received.shape == (t,)
    previous = target.model.config._attn_implementation
    target.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            att = target.model(**prompt.model_inputs, output_attentions=True).attentions
    finally:
        target.model.set_attn_implementation(previous)
    p = att[0][0, 0, -1].double()  # layer 0, head 0, last query
    p = p[p > 0]
    manual_head0 = float(-(p * p.log()).sum())
    heads = att[0][0, :, -1].double()
    manual = float(torch.stack([-(h[h > 0] * h[h > 0].log()).sum() for h in heads]).mean())
    assert math.isclose(float(pre.attn_entropy[0, -1]), manual, rel_tol=1e-4)
    assert 0 <= manual_head0 <= math.log(t) + 1e-6
    assert float(pre.attn_entropy[0, 0]) == pytest.approx(0.0, abs=1e-6)  # first query sees one key
    assert bool((pre.attn_entropy >= 0).all())


def test_fingerprint_identity():
    a = tiny_target("tiny-llama").fingerprint()
    b = tiny_target("tiny-qwen2").fingerprint()
    assert a != b
    assert a == tiny_target("tiny-llama").fingerprint()
    assert a.family == "llama" and a.num_layers == tiny_target("tiny-llama").num_layers


def test_fingerprint_survives_save_and_dtype(tmp_path):
    from decode.targets.loader import load_target

    target = tiny_target("tiny-smolvlm")
    target.model.save_pretrained(tmp_path)
    target.processor.save_pretrained(tmp_path)
    again = load_target(str(tmp_path), device="cpu", dtype="bfloat16")
    assert again.fingerprint() == target.fingerprint()
    assert again.spec.family == "idefics3" and again.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-smolvlm", "tiny-qwen2.5-vl", "tiny-paligemma"])
def test_a_prompt_after_history_holds_the_earlier_exchange_first(name):
    """build_prompt(text, image, history): the earlier (user, assistant) exchange comes before the message, in
    order, in the family's template (plain lines without one), and the prompt ends as the one without history."""
    target = tiny_target(name)
    history = (("Name a colour of the sea.", "Blue, mostly."),)
    alone = target.build_prompt("And of the sky?")
    after = target.build_prompt("And of the sky?", None, history)
    assert after.text.index("Name a colour of the sea.") < after.text.index("Blue, mostly.") < after.text.rindex(
        "And of the sky?")
    assert after.length > alone.length
    assert after.input_ids[0, -3:].tolist() == alone.input_ids[0, -3:].tolist()  # the same message and its opening
    with_image = target.build_prompt("And of the sky?", photo() if target.is_vlm else None, history)
    assert with_image.has_image == target.is_vlm
