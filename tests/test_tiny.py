"""decode.targets.tiny: every tiny random family builds, templates, tokenizes, runs forward and generate."""

from __future__ import annotations

import functools

import PIL.Image
import pytest
import skimage.data
import torch

from decode.errors import UserError
from decode.targets.tiny import TINY_PRESETS, build_tiny

TEXT_FAMILIES = ("llama", "qwen2", "gemma3_text")
# family -> image tokens (model.config.image_token_id) for one square image (the astronaut)
VLM_IMAGE_TOKENS = {"llava": 16, "llava_next": 10, "idefics3": 16, "gemma3": 16, "qwen2_5_vl": 16, "mistral3": 16,
                    "paligemma": 16}
ALL_FAMILIES = TEXT_FAMILIES + tuple(VLM_IMAGE_TOKENS)


@functools.lru_cache(maxsize=None)
def _built(family: str):
    return build_tiny(family)


@functools.lru_cache(maxsize=None)
def _image() -> PIL.Image.Image:
    return PIL.Image.fromarray(skimage.data.astronaut())


def _tokenizer(processor):
    return getattr(processor, "tokenizer", processor)


def _encode_text(family: str, processor, text: str) -> dict:
    # PaliGemmaProcessor refuses text without images, so text-only prompts go through its tokenizer
    if family in TEXT_FAMILIES or family == "paligemma":
        return dict(_tokenizer(processor)(text, return_tensors="pt"))
    return dict(processor(text=text, return_tensors="pt"))


def _image_inputs(family: str) -> dict:
    model, processor = _built(family)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this image?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(processor(images=[_image()], text=text, return_tensors="pt"))


def test_presets_map_to_families():
    assert set(TINY_PRESETS.values()) == set(ALL_FAMILIES)
    assert TINY_PRESETS["tiny-smolvlm"] == "idefics3" and TINY_PRESETS["tiny-qwen2.5-vl"] == "qwen2_5_vl"


def test_unknown_family_raises_user_error():
    with pytest.raises(UserError, match="known families: .*llama.*paligemma"):
        build_tiny("not-a-family")


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_model_is_tiny_fp32_eval_and_matches_tokenizer(family):
    model, processor = _built(family)
    tok = _tokenizer(processor)
    text_config = model.config.get_text_config()
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert sum(p.numel() for p in model.parameters()) < 500_000
    assert text_config.hidden_size == 64 and text_config.num_key_value_heads == 2
    assert text_config.vocab_size == len(tok) == model.get_input_embeddings().weight.shape[0]
    # PaliGemmaProcessor adds 1024 <locXXXX> + 128 <segXXX> tokens to every tokenizer it is given
    assert len(tok) < (1500 if family == "paligemma" else 512)
    if family == "gemma3":
        # Gemma3Processor.image_token(_id) is the <start_of_image> prompt placeholder; the expanded
        # per-feature token is the tokenizer's image_token
        assert processor.image_token_id == model.config.boi_token_index
        assert model.config.image_token_id == tok.image_token_id
    elif family in VLM_IMAGE_TOKENS:
        assert model.config.image_token_id == processor.image_token_id


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_text_prompt_forward(family):
    model, processor = _built(family)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "hello" in text
    inputs = _encode_text(family, processor, text)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(_tokenizer(processor)))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_chat_template_string_content_and_turns(family):
    _, processor = _built(family)
    messages = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "an answer"},
                {"role": "user", "content": "second question"}]
    with_prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    without = processor.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert "first question" in with_prompt and "second question" in with_prompt
    assert with_prompt.startswith(without)
    # Mistral-style templates have an implicit generation prompt; PaliGemma's processor adds its own
    if family not in ("llava_next", "mistral3", "paligemma"):
        assert len(with_prompt) > len(without)
        assert "an answer" in with_prompt


def test_tokenizer_round_trips_bytes_and_keeps_special_tokens_whole():
    _, processor = _built("qwen2_5_vl")
    tok = processor.tokenizer
    text = "héllo wörld 世界 <b>\n\ttabs"
    assert tok.decode(tok(text)["input_ids"]) == text
    ids = tok("<|vision_start|><|image_pad|><|vision_end|>", add_special_tokens=False)["input_ids"]
    assert ids == tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    assert len(tok("the")["input_ids"]) == 2  # "t" + "he" via the built-in merges


@pytest.mark.parametrize("family", tuple(VLM_IMAGE_TOKENS))
def test_image_prompt_forward_and_generate(family):
    model, processor = _built(family)
    inputs = _image_inputs(family)
    ids = inputs["input_ids"]
    assert int((ids == model.config.image_token_id).sum()) == VLM_IMAGE_TOKENS[family]
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, ids.shape[1], model.config.get_text_config().vocab_size)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 8
    assert torch.equal(out[:, : ids.shape[1]], ids)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_same_seed_same_weights(family):
    a, _ = build_tiny(family, seed=3)
    b, _ = build_tiny(family, seed=3)
    c, _ = build_tiny(family, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_greedy_decoding_is_not_degenerate(family):
    model, processor = _built(family)
    text = processor.apply_chat_template([{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True,
                                         tokenize=False)
    inputs = _encode_text(family, processor, text)
    out = model.generate(**inputs, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert len(set(out[0, inputs["input_ids"].shape[1]:].tolist())) >= 3


@pytest.mark.parametrize("family", tuple(VLM_IMAGE_TOKENS))
def test_eager_attention_matches_sdpa(family):
    model, _ = build_tiny(family)
    inputs = _image_inputs(family)
    with torch.no_grad():
        sdpa = model(**inputs).logits
        model.set_attn_implementation("eager")
        eager = model(**inputs).logits
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(eager, sdpa, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["gemma3_text", "gemma3"])
def test_gemma3_sliding_window_is_exercised(family):
    model, processor = build_tiny(family)
    text_config = model.config.get_text_config()
    assert text_config.sliding_window == 8
    assert {"sliding_attention", "full_attention"} <= set(text_config.layer_types)
    text = processor.apply_chat_template([{"role": "user", "content": "a prompt longer than the window"}],
                                         add_generation_prompt=True, tokenize=False)
    inputs = _encode_text(family, processor, text)
    assert inputs["input_ids"].shape[1] > 8
    with torch.no_grad():
        windowed = model(**inputs).logits
        text_config.sliding_window = 4096
        full = model(**inputs).logits
    # identical inside the window, different once the window cuts off earlier tokens
    torch.testing.assert_close(windowed[:, :8], full[:, :8])
    assert not torch.allclose(windowed[:, -1], full[:, -1])


def test_qwen2_5_vl_uses_3d_mrope():
    model, _ = _built("qwen2_5_vl")
    text_config = model.config.text_config
    head_dim = text_config.hidden_size // text_config.num_attention_heads
    assert sum(text_config.rope_parameters["mrope_section"]) == head_dim // 2
    inputs = _image_inputs("qwen2_5_vl")
    position_ids, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                 inputs["image_grid_thw"], attention_mask=inputs["attention_mask"])
    image = (inputs["input_ids"][0] == model.config.image_token_id)
    # image tokens: one temporal index, 4 distinct rows and 4 distinct columns (a 4x4 merged grid)
    assert position_ids.shape[0] == 3
    assert [len(set(position_ids[axis, 0, image].tolist())) for axis in range(3)] == [1, 4, 4]
