"""What differs between model families, in one table.

Everything family-specific that the target adapter needs lives here, keyed by the top-level
config's `model_type`; the adapter itself is written once. Text-only causal LMs that are not
listed still work when they follow the usual `model.model.layers / model.model.norm` layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from decode.errors import UserError


@dataclass(frozen=True)
class FamilySpec:
    """How to drive one HF model family.

    decoder_path: attributes from the top-level model to the decoder stack (the module that
        owns `layers`, `norm` and `embed_tokens` and takes `input_ids/attention_mask/position_ids/cache`).
    position_offset: added to the cache index to get the rotary position (PaliGemma counts from 1).
    mrope: positions are 3-D (temporal, height, width) and shifted by the `rope_deltas` the model
        computes at prefill (Qwen2-VL / Qwen2.5-VL).
    chat_template: prompts go through the processor's chat template (PaliGemma has none: its
        processor prepends the image tokens and BOS itself).
    softcap_logits: the top-level head applies `final_logit_softcapping` (Gemma 2/3 text models).
    """

    family: str
    is_vlm: bool
    decoder_path: tuple[str, ...]
    position_offset: int = 0
    mrope: bool = False
    chat_template: bool = True
    softcap_logits: bool = False


_TEXT = ("model",)
_VLM = ("model", "language_model")

FAMILIES: dict[str, FamilySpec] = {
    # text-only causal LMs
    "llama": FamilySpec("llama", False, _TEXT),
    "qwen2": FamilySpec("qwen2", False, _TEXT),
    "qwen3": FamilySpec("qwen3", False, _TEXT),
    "mistral": FamilySpec("mistral", False, _TEXT),
    "gemma": FamilySpec("gemma", False, _TEXT),
    "gemma2": FamilySpec("gemma2", False, _TEXT, softcap_logits=True),
    "gemma3_text": FamilySpec("gemma3_text", False, _TEXT, softcap_logits=True),
    # vision-language models
    "llava": FamilySpec("llava", True, _VLM),
    "llava_next": FamilySpec("llava_next", True, _VLM),
    "idefics3": FamilySpec("idefics3", True, ("model", "text_model")),
    "smolvlm": FamilySpec("smolvlm", True, ("model", "text_model")),
    "gemma3": FamilySpec("gemma3", True, _VLM),
    "qwen2_vl": FamilySpec("qwen2_vl", True, _VLM, mrope=True),
    "qwen2_5_vl": FamilySpec("qwen2_5_vl", True, _VLM, mrope=True),
    "mistral3": FamilySpec("mistral3", True, _VLM),
    "paligemma": FamilySpec("paligemma", True, _VLM, position_offset=1, chat_template=False),
}

VLM_FAMILIES = tuple(k for k, v in FAMILIES.items() if v.is_vlm)


def family_spec(model_type: str, has_vision: bool) -> FamilySpec:
    """The spec for `model_type`; unknown text-only types fall back to the Llama layout."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if has_vision:
        raise UserError(
            f"unsupported vision-language model type '{model_type}'; supported: {', '.join(VLM_FAMILIES)}"
        )
    return FamilySpec(model_type, False, _TEXT)
