"""In-memory byte-level tokenizer and chat templates for the tiny random models in `decode.targets.tiny`.

`build_tokenizer` makes a `PreTrainedTokenizerFast` without any file or hub access: a byte-level BPE
whose base vocabulary is the 256 byte symbols (so every string round-trips), a handful of merges so
that encoding is not purely one-token-per-byte, and the family's special tokens appended after them.
Ids are deterministic: bytes 0-255, then merges, then special tokens in the order given.

The bos token is never added by the tokenizer itself (`add_bos_token=False`); the chat templates
emit `{{ bos_token }}` where the family's real template does, so `apply_chat_template(...,
tokenize=False)` followed by `processor(text=...)` yields exactly one bos.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# A few frequent English pairs. Each merge's parts must already be in the vocabulary when it is
# applied, so later merges may use the results of earlier ones ("Ġt" + "he"). "Ġ" is the byte-level
# symbol for a space.
_MERGES = [
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("e", "r"), ("Ġ", "a"), ("o", "n"), ("Ġt", "he"),
    ("r", "e"), ("a", "t"), ("e", "n"), ("o", "u"), ("Ġ", "s"), ("Ġ", "w"), ("i", "s"),
    ("Ġ", "i"), ("l", "l"),
]


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte value, indexed by byte (the ByteLevel alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def build_tokenizer(
    special_tokens: list[str],
    *,
    bos: str | None,
    eos: str,
    pad: str,
    chat_template: str,
    named_tokens: dict[str, str] | None = None,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with `special_tokens` appended (in order) after bytes and merges.

    `bos`/`eos`/`pad` must be among `special_tokens`. `named_tokens` become model-specific named
    special tokens, e.g. `{"image_token": "<image>"}` gives `tok.image_token` and `tok.image_token_id`
    (several HF processors read those attributes).
    """
    vocab = {symbol: i for i, symbol in enumerate(_bytes_to_unicode())}
    for left, right in _MERGES:
        vocab.setdefault(left + right, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(_MERGES)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    # normalized=False: match the special token text literally, never split it into bytes.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        extra_special_tokens=dict(named_tokens or {}),
        add_bos_token=False,
        add_eos_token=False,
        chat_template=chat_template,
        model_max_length=4096,
    )


# ---------------------------------------------------------------------------------------------
# Chat templates. `_RENDER` is a jinja macro shared by all templates: message content is either a
# string or a list of {"type": "text", "text": ...} / {"type": "image"} items; an image item
# becomes the family's placeholder text (which the HF processor later expands to image tokens).
# Templates are single-line jinja without whitespace control: HF compiles them with trim_blocks and
# lstrip_blocks, and no literal newline here directly follows a block tag, so every "\n" is kept.
# ---------------------------------------------------------------------------------------------

_RENDER = (
    "{% macro render(content) %}"
    "{% if content is string %}{{ content }}"
    "{% else %}{% for item in content %}"
    "{% if item['type'] == 'image' %}@IMAGE@"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{% endmacro %}"
)

# Bodies are written with '@IMAGE@' for the placeholder; `chat_template` substitutes it.
_BODIES = {
    # Llama 3: header-delimited turns, <|eot_id|> ends a turn.
    "llama3": (
        "{{ bos_token }}{% for m in messages %}"
        "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ render(m['content']) }}<|eot_id|>"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    # ChatML (Qwen2, Qwen2.5-VL): no bos.
    "chatml": (
        "{% for m in messages %}"
        "<|im_start|>{{ m['role'] }}\n{{ render(m['content']) }}<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # Gemma: the assistant role is called "model".
    "gemma": (
        "{{ bos_token }}{% for m in messages %}"
        "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
        "{{ render(m['content']) }}<end_of_turn>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    # llava-1.5-hf: "USER: <image>\nWhat is this? ASSISTANT:".
    "llava": (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'assistant' %}ASSISTANT: {{ render(m['content']) }}{{ eos_token }}"
        "{% else %}{{ m['role'] | upper }}: {{ render(m['content']) }} {% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    ),
    # Mistral [INST] style (llava-v1.6-mistral, Mistral 3). The generation prompt is implicit: the
    # assistant answer follows [/INST] directly, so add_generation_prompt adds nothing.
    "mistral": (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'user' %}[INST]{{ render(m['content']) }}[/INST]"
        "{% elif m['role'] == 'assistant' %}{{ render(m['content']) }}{{ eos_token }}"
        "{% else %}{{ render(m['content']) }}\n\n{% endif %}"
        "{% endfor %}"
    ),
    # SmolVLM / Idefics3: "<|im_start|>User:<image>What is this?<end_of_utterance>\nAssistant:".
    "idefics3": (
        "<|im_start|>{% for m in messages %}"
        "{{ m['role'] | capitalize }}:{{ render(m['content']) }}<end_of_utterance>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}Assistant:{% endif %}"
    ),
    # PaliGemma has no chat template in HF: the prompt is "<image>...<bos>prefix\n" and the
    # PaliGemmaProcessor inserts the <bos> and the trailing "\n" itself (and prepends <image> tokens
    # if the text has none). So this just concatenates the content of the user messages.
    "paligemma": "{% for m in messages %}{% if m['role'] == 'user' %}{{ render(m['content']) }}{% endif %}{% endfor %}",
}


def chat_template(style: str, image_placeholder: str = "") -> str:
    """The jinja chat template of `style` (a key of `_BODIES`) with `image_placeholder` for images."""
    return (_RENDER + _BODIES[style]).replace("@IMAGE@", image_placeholder)
