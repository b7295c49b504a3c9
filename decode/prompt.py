"""Build a model-ready prompt from (user text, optional image) with the family's chat template."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from decode.errors import UserError
from decode.images import load_image

if TYPE_CHECKING:
    from decode.targets.target import TargetModel

logger = logging.getLogger(__name__)

_TRAINING_ONLY = {"labels"}
# the (1, T) model inputs that carry one entry per token; the rest (pixel values, image sizes ...) are per prompt
PER_TOKEN = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


@dataclass
class Prompt:
    """What prefill needs: the token ids and every other tensor the model's forward takes."""

    input_ids: torch.Tensor  # (1, T) long
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # input_ids, attention_mask, pixel_values, ...
    text: str = ""  # the templated prompt text
    has_image: bool = False

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    def tail(self, n: int) -> "Prompt":
        """The last n tokens (itself when not longer), every per-token model input cut alike: a text prompt too long
        for a budget loses its head and keeps the part the answer follows."""
        if self.length <= n:
            return self
        inputs = {k: (v[:, -n:] if k in PER_TOKEN else v) for k, v in self.model_inputs.items()}
        return replace(self, input_ids=inputs["input_ids"], model_inputs=inputs)


def _messages(text: str, with_image: bool, is_vlm: bool, history: tuple[tuple[str, str], ...] = ()) -> list[dict]:
    def content(t: str, image: bool = False):
        return t if not is_vlm else ([{"type": "image"}] if image else []) + [{"type": "text", "text": t}]

    earlier = [{"role": role, "content": content(t)} for user, reply in history
               for role, t in (("user", user), ("assistant", reply))]
    return earlier + [{"role": "user", "content": content(text, with_image)}]


def _plain(text: str, history: tuple[tuple[str, str], ...]) -> str:
    """The message after its earlier exchanges as plain lines (a family or tokenizer without a chat template)."""
    return "\n".join([t for pair in history for t in pair] + [text])


def build_prompt(target: "TargetModel", text: str, image: object = None,
                 history: tuple[tuple[str, str], ...] = ()) -> Prompt:
    """The prompt for one user message (and image) after the (user, assistant) exchanges in `history`."""
    if not isinstance(text, str) or not text.strip():
        raise UserError("the prompt is empty; pass some text with --prompt")
    if image is not None and not target.is_vlm:
        raise UserError(f"target '{target.name}' is text-only and cannot take an image; drop --image or use a VLM target")
    pil = load_image(image) if image is not None else None
    tok = target.tokenizer
    proc = target.processor
    if not target.spec.chat_template:
        # PaliGemma: the processor adds image tokens + BOS; the prompt ends with a newline. No chat template: earlier
        # exchanges go before the message as plain lines
        text = _plain(text, history)
        if pil is not None:
            enc = proc(images=[pil], text=text, return_tensors="pt")
        else:
            enc = tok((tok.bos_token or "") + text + "\n", return_tensors="pt", add_special_tokens=False)
        templated = text
    else:
        if getattr(tok, "chat_template", None) is None and getattr(proc, "chat_template", None) is None:
            logger.warning("target %s has no chat template; using the raw prompt text", target.name)
            templated = _plain(text, history)
        else:
            msgs = _messages(text, pil is not None, target.is_vlm, history)
            templated = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        if pil is not None:
            enc = proc(images=[pil], text=templated, return_tensors="pt", add_special_tokens=False)
        else:
            # the template already holds any BOS it needs
            enc = tok(templated, return_tensors="pt", add_special_tokens=False)
    # processors may add training-only fields (PaliGemma returns `labels`): keep what a forward needs
    inputs = {k: v for k, v in dict(enc).items() if torch.is_tensor(v) and k not in _TRAINING_ONLY}
    return Prompt(input_ids=inputs["input_ids"], model_inputs=inputs, text=templated, has_image=pil is not None)
