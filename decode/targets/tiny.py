"""Tiny, randomly initialised HF models with working processors, built from config objects only.

The models are RANDOM: they produce gibberish and exist for tests and fast CLI runs (no hub access,
no files on disk, every forward well under a second on CPU). Each family keeps its real HF model
class, processor class, special tokens, chat-template style and the architecture features that
matter for decoding code (GQA, Gemma 3 sliding-window layers, Qwen2.5-VL 3D mrope, Pixtral image
breaks, LLaVA-NeXT anyres tiles ...), scaled down to hidden 64 / head_dim 16 and vision towers of
hidden 32 on 32-64 px images.

    model, processor = build_tiny("llava")      # family key, see TINY_PRESETS for preset names
    model.set_attn_implementation("eager")       # models are built with the default (sdpa)

Text-only families return a tokenizer instead of a processor. Prompt with
`processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` and
`processor(images=[img], text=prompt, return_tensors="pt")`. PaliGemma has no chat template in HF;
its tiny template just concatenates the user content (images as `<image>`) and the
PaliGemmaProcessor adds `<bos>` after the image tokens and the trailing newline itself.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import torch
import transformers as tf

from decode.errors import UserError
from decode.targets.tiny_tokenizer import build_tokenizer, chat_template

TINY_PRESETS: dict[str, str] = {
    "tiny-llama": "llama",
    "tiny-qwen2": "qwen2",
    "tiny-gemma3-text": "gemma3_text",
    "tiny-llava": "llava",
    "tiny-llava-next": "llava_next",
    "tiny-smolvlm": "idefics3",
    "tiny-gemma3": "gemma3",
    "tiny-qwen2.5-vl": "qwen2_5_vl",
    "tiny-mistral3": "mistral3",
    "tiny-paligemma": "paligemma",
}

# Random init std, slightly above HF's 0.02: with 0.02 some families' greedy output collapses to
# one repeated token for some prompts; 0.05 gives prompt-dependent, varied continuations everywhere.
_INIT_STD = 0.05

# Shared decoder shape: 4 query heads sharing 2 KV heads (GQA), head_dim 16. Input and output
# embeddings are untied in every family (real Gemma / PaliGemma / Mistral 3 tie them): at random
# init a tied head mostly scores the current token highest, so greedy decoding repeats it forever.
_TEXT_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, initializer_range=_INIT_STD,
    tie_word_embeddings=False,
)
# Shared vision-tower shape.
_VISION_SHAPE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    initializer_range=_INIT_STD,
)

# A builder returns (model class, config factory, processor or tokenizer). The config is made from
# the final tokenizer, since some processors add tokens to it (PaliGemma adds 1152 <locXXXX>/<segXXX>).
_Built = tuple[type, Callable[[], object], object]


def build_tiny(family: str, seed: int = 0) -> tuple[tf.PreTrainedModel, object]:
    """(model in eval mode, fp32, on CPU; processor for VLMs or tokenizer for text-only families).

    Same `seed` -> identical weights. Switch attention with `model.set_attn_implementation("eager")`.
    """
    builder = _BUILDERS.get(family)
    if builder is None:
        raise UserError(f"unknown tiny model family {family!r}; known families: {', '.join(_BUILDERS)}")
    model_cls, make_config, processor = builder()
    with torch.random.fork_rng(devices=[]):  # seed the init without disturbing the caller's RNG stream
        torch.manual_seed(seed)
        model = model_cls(make_config())
    return model.to(device="cpu", dtype=torch.float32).eval(), processor


def _tok_ids(tok) -> dict:
    """Text-config entries tied to the tokenizer: vocab size and bos/eos/pad ids."""
    return dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)


def _tid(tok, token: str) -> int:
    return tok.convert_tokens_to_ids(token)


# --------------------------------------------------------------------------------------------
# Text-only families
# --------------------------------------------------------------------------------------------

_LLAMA3_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
_CHATML_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_GEMMA_TOKENS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]


def _llama() -> _Built:
    tok = build_tokenizer(_LLAMA3_TOKENS, bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|end_of_text|>",
                          chat_template=chat_template("llama3"))
    return tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**_TEXT_SHAPE, **_tok_ids(tok)), tok


def _qwen2() -> _Built:
    tok = build_tokenizer(_CHATML_TOKENS, bos=None, eos="<|im_end|>", pad="<|endoftext|>",
                          chat_template=chat_template("chatml"))
    return tf.Qwen2ForCausalLM, lambda: tf.Qwen2Config(**_TEXT_SHAPE, **_tok_ids(tok)), tok


def _gemma3_text_config(tok) -> tf.Gemma3TextConfig:
    # 4 layers alternating sliding/full with a window of 8 tokens, so any real prompt is longer than
    # the window and both the sliding and the global attention paths (and their caches) are used.
    # query_pre_attn_scalar = head_dim, as in the real checkpoints.
    shape = {**_TEXT_SHAPE, "num_hidden_layers": 4}
    return tf.Gemma3TextConfig(
        **shape, **_tok_ids(tok), query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )


def _gemma3_text() -> _Built:
    tok = build_tokenizer(_GEMMA_TOKENS, bos="<bos>", eos="<end_of_turn>", pad="<pad>",
                          chat_template=chat_template("gemma"))
    return tf.Gemma3ForCausalLM, lambda: _gemma3_text_config(tok), tok


# --------------------------------------------------------------------------------------------
# Vision-language families
# --------------------------------------------------------------------------------------------

def _clip_vision(image_size: int, patch_size: int) -> tf.CLIPVisionConfig:
    return tf.CLIPVisionConfig(**_VISION_SHAPE, image_size=image_size, patch_size=patch_size, projection_dim=32)


def _siglip_vision(image_size: int, patch_size: int) -> tf.SiglipVisionConfig:
    return tf.SiglipVisionConfig(**_VISION_SHAPE, image_size=image_size, patch_size=patch_size,
                                 vision_use_head=False)


def _llava_tokenizer(style: str, extra: tuple[str, ...] = ()):
    return build_tokenizer(["<s>", "</s>", "<pad>", "<image>", *extra], bos="<s>", eos="</s>", pad="<pad>",
                           named_tokens={"image_token": "<image>"}, chat_template=chat_template(style, "<image>\n"))


def _llava() -> _Built:
    # CLIP 32 px / patch 8: 16 patches + CLS; strategy "default" drops the CLS -> 16 image tokens.
    # vision_feature_layer=-1 takes the last of the 2 vision layers (HF's default -2 would skip it).
    tok = _llava_tokenizer("llava")
    image_proc = tf.LlavaImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    proc = tf.LlavaProcessor(image_processor=image_proc, tokenizer=tok, patch_size=8,
                             vision_feature_select_strategy="default", num_additional_image_tokens=1,
                             chat_template=tok.chat_template)
    return tf.LlavaForConditionalGeneration, lambda: tf.LlavaConfig(
        vision_config=_clip_vision(32, 8), text_config=tf.LlamaConfig(**_TEXT_SHAPE, **_tok_ids(tok)),
        image_token_index=_tid(tok, "<image>"), image_seq_length=16, vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    ), proc


def _llava_next() -> _Built:
    # anyres: a 32 px base view plus 32 px tiles on the best-fitting grid pinpoint. CLIP patch 16 ->
    # 2x2 features per view; a square image gets 1 tile: 4 base + 4 tile + 2 row newlines = 10 tokens.
    # Wide/tall images pick the 32x64 / 64x32 pinpoint (2 tiles).
    pinpoints = [[32, 32], [32, 64], [64, 32]]
    tok = _llava_tokenizer("mistral", ["[INST]", "[/INST]"])
    image_proc = tf.LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                               image_grid_pinpoints=pinpoints)
    proc = tf.LlavaNextProcessor(image_processor=image_proc, tokenizer=tok, patch_size=16,
                                 vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                 chat_template=tok.chat_template)
    return tf.LlavaNextForConditionalGeneration, lambda: tf.LlavaNextConfig(
        vision_config=_clip_vision(32, 16),
        text_config=tf.MistralConfig(**_TEXT_SHAPE, **_tok_ids(tok), sliding_window=None),
        image_token_index=_tid(tok, "<image>"), image_grid_pinpoints=pinpoints, vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    ), proc


def _idefics3() -> _Built:
    # No image splitting: every image is resized to one 64 px square; 8x8 patches, pixel-shuffled by
    # scale_factor 2 -> 16 <image> tokens, wrapped as <fake_token_around_image><global-img>...<fake...>.
    # The row/col tokens are only used with splitting but the processor looks their ids up.
    row_col = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    specials = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                "<global-img>", *row_col]
    tok = build_tokenizer(specials, bos="<|im_start|>", eos="<end_of_utterance>", pad="<|endoftext|>",
                          chat_template=chat_template("idefics3", "<image>"))
    image_proc = tf.Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 64},
                                              max_image_size={"longest_edge": 64})
    proc = tf.Idefics3Processor(image_processor=image_proc, tokenizer=tok, image_seq_len=16,
                                chat_template=tok.chat_template)
    return tf.Idefics3ForConditionalGeneration, lambda: tf.Idefics3Config(
        vision_config=tf.Idefics3VisionConfig(**_VISION_SHAPE, image_size=64, patch_size=8),
        text_config=tf.LlamaConfig(**_TEXT_SHAPE, **_tok_ids(tok)), image_token_id=_tid(tok, "<image>"),
        scale_factor=2, pad_token_id=tok.pad_token_id,
    ), proc


def _gemma3() -> _Built:
    # SigLIP 64 px / patch 8 = 8x8 patches, average-pooled by the projector to mm_tokens_per_image=16.
    # The prompt's <start_of_image> expands to "\n\n<start_of_image>" + 16 x <image_soft_token> +
    # "<end_of_image>\n\n"; image tokens attend bidirectionally, text layers use the window of 8.
    specials = [*_GEMMA_TOKENS, "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok = build_tokenizer(specials, bos="<bos>", eos="<end_of_turn>", pad="<pad>", named_tokens=named,
                          chat_template=chat_template("gemma", "<start_of_image>"))
    image_proc = tf.Gemma3ImageProcessorPil(size={"height": 64, "width": 64}, do_pan_and_scan=False)
    proc = tf.Gemma3Processor(image_processor=image_proc, tokenizer=tok, image_seq_length=16,
                              chat_template=tok.chat_template)
    return tf.Gemma3ForConditionalGeneration, lambda: tf.Gemma3Config(
        vision_config=_siglip_vision(64, 8), text_config=_gemma3_text_config(tok), mm_tokens_per_image=16,
        boi_token_index=_tid(tok, "<start_of_image>"), eoi_token_index=_tid(tok, "<end_of_image>"),
        image_token_index=_tid(tok, "<image_soft_token>"), initializer_range=_INIT_STD,
        tie_word_embeddings=False,
    ), proc


class _Qwen2_5_VLImageOnlyProcessor(tf.Qwen2_5_VLProcessor):
    """`Qwen2_5_VLProcessor` without its video processor (images and text only).

    In transformers 5.24 the video processor cannot be left out: `ProcessorMixin.__init__` type-checks
    every sub-processor named in `__init__`'s signature, `None` included, and without torchvision
    that check itself crashes (`VIDEO_PROCESSOR_MAPPING` is a dummy). The video processor needs
    torchvision, so drop it from the signature; `ProcessorMixin` then only registers the image
    processor and tokenizer, and everything else is the unchanged HF class.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def _qwen2_5_vl() -> _Built:
    # min_pixels = max_pixels = 64*64: a square image becomes 64x64 (other shapes keep their aspect
    # ratio within that budget, in multiples of 16 px): patch 8 -> 8x8 patches, merged 2x2 -> 16
    # <|image_pad|> tokens. window_size 32 px = 2x2 merged units, so vision layer 0 uses window
    # attention and layer 1 (fullatt_block_indexes) full attention, like the real 32-layer tower.
    specials = [*_CHATML_TOKENS, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    named = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    tok = build_tokenizer(specials, bos=None, eos="<|im_end|>", pad="<|endoftext|>", named_tokens=named,
                          chat_template=chat_template("chatml", "<|vision_start|><|image_pad|><|vision_end|>"))
    image_proc = tf.Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                             min_pixels=64 * 64, max_pixels=64 * 64)
    proc = _Qwen2_5_VLImageOnlyProcessor(image_processor=image_proc, tokenizer=tok, chat_template=tok.chat_template)
    # 3D mrope: head_dim 16 -> 8 rotary frequencies split (temporal, height, width) = 2 + 3 + 3.
    text_shape = {k: v for k, v in _TEXT_SHAPE.items() if k != "head_dim"}  # derived: 64 / 4 = 16
    text = dict(**text_shape, **_tok_ids(tok),
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=32, fullatt_block_indexes=[1], out_hidden_size=64,
                  initializer_range=_INIT_STD)
    return tf.Qwen2_5_VLForConditionalGeneration, lambda: tf.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=_tid(tok, "<|image_pad|>"),
        video_token_id=_tid(tok, "<|video_pad|>"), vision_start_token_id=_tid(tok, "<|vision_start|>"),
        vision_end_token_id=_tid(tok, "<|vision_end|>"),
    ), proc


def _pixtral_processor_class() -> type:
    """`PixtralProcessor` even without torchvision.

    In transformers 5.24 `processing_pixtral` imports `get_resize_output_image_size` from the
    torchvision image processor module, so the import fails without torchvision although the
    processor works with `PixtralImageProcessorPil`. The PIL module defines the same function; it
    stands in for the torchvision module during this one import and is removed again afterwards.
    """
    name = "transformers.models.pixtral.processing_pixtral"
    try:
        return importlib.import_module(name).PixtralProcessor
    except ModuleNotFoundError as err:
        if err.name != "torchvision":
            raise
    tv_name = "transformers.models.pixtral.image_processing_pixtral"
    sys.modules[tv_name] = importlib.import_module("transformers.models.pixtral.image_processing_pil_pixtral")
    try:
        return importlib.import_module(name).PixtralProcessor
    finally:
        del sys.modules[tv_name]


def _mistral3() -> _Built:
    # Pixtral 64 px / patch 8 = 8x8 patches, merged 2x2 by the projector -> 4x4 [IMG] tokens; the
    # processor adds [IMG_BREAK] after each row and [IMG_END] in place of the last break:
    # 16 [IMG] + 3 [IMG_BREAK] + 1 [IMG_END] = 20 tokens for a square image (fewer rows/cols otherwise).
    specials = ["<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    tok = build_tokenizer(specials, bos="<s>", eos="</s>", pad="<pad>", named_tokens={"image_token": "[IMG]"},
                          chat_template=chat_template("mistral", "[IMG]"))
    image_proc = tf.PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size={"height": 16, "width": 16})
    proc = _pixtral_processor_class()(image_processor=image_proc, tokenizer=tok, patch_size=8,
                                      spatial_merge_size=2, chat_template=tok.chat_template)
    vision = tf.PixtralVisionConfig(**_VISION_SHAPE, head_dim=8, image_size=64, patch_size=8)
    return tf.Mistral3ForConditionalGeneration, lambda: tf.Mistral3Config(
        vision_config=vision, text_config=tf.MistralConfig(**_TEXT_SHAPE, **_tok_ids(tok), sliding_window=None),
        image_token_index=_tid(tok, "[IMG]"), spatial_merge_size=2, vision_feature_layer=-1,
        tie_word_embeddings=False,
    ), proc


def _paligemma() -> _Built:
    # SigLIP 32 px / patch 8 -> 16 <image> tokens (PaliGemma uses every patch, no pooling). The
    # processor adds 1024 <locXXXX> + 128 <segXXX> tokens, so this vocabulary is ~1.4k, not < 512.
    tok = build_tokenizer(["<pad>", "<eos>", "<bos>", "<image>"], bos="<bos>", eos="<eos>", pad="<pad>",
                          named_tokens={"image_token": "<image>"}, chat_template=chat_template("paligemma", "<image>"))
    image_proc = tf.SiglipImageProcessorPil(size={"height": 32, "width": 32})
    image_proc.image_seq_length = 16  # PaliGemmaProcessor reads the token count from the image processor
    proc = tf.PaliGemmaProcessor(image_processor=image_proc, tokenizer=tok, chat_template=tok.chat_template)
    return tf.PaliGemmaForConditionalGeneration, lambda: tf.PaliGemmaConfig(
        vision_config=_siglip_vision(32, 8), text_config=tf.GemmaConfig(**_TEXT_SHAPE, **_tok_ids(tok)),
        image_token_index=_tid(tok, "<image>"), vocab_size=len(tok), projection_dim=64, hidden_size=64,
        tie_word_embeddings=False,
    ), proc


_BUILDERS: dict[str, Callable[[], _Built]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "gemma3_text": _gemma3_text,
    "llava": _llava,
    "llava_next": _llava_next,
    "idefics3": _idefics3,
    "gemma3": _gemma3,
    "qwen2_5_vl": _qwen2_5_vl,
    "mistral3": _mistral3,
    "paligemma": _paligemma,
}
