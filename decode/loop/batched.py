"""Batched greedy answers from the target itself (self-distilled training data, the corpus's own answers).

A draft is judged on what the TARGET says, so training on (and counting n-grams of) the target's own
greedy answers teaches exactly the continuations it will be asked to guess. One prompt at a time that
costs a full target step per token; left-padded batches share each step among B prompts, which on 2 CPU
cores makes thousands of answers affordable (supernet.data --mode regenerate, decode.answers).

Padding changes the floating-point summation order, so a batch may, rarely, flip a near-tied argmax.
That is harmless in training data. Held-out data, whose replayed tau must be exact, takes a batched
answer only when the sequence's own unbatched forward agrees with every answer token (supernet.data
refuses the others and generates them one prompt at a time).

Only prompts whose model inputs are `input_ids` + `attention_mask` (text prompts of every family
with a chat template) are batched; the rest are answered one at a time by the caller.
"""

from __future__ import annotations

import torch

from decode.prompt import Prompt
from decode.targets.target import TargetModel

BATCHABLE_KEYS = {"input_ids", "attention_mask"}


def batchable(prompt: Prompt) -> bool:
    return not prompt.has_image and set(prompt.model_inputs) <= BATCHABLE_KEYS


@torch.no_grad()
def batch_greedy(target: TargetModel, prompts: list[Prompt], max_new: list[int]) -> list[list[int]]:
    """Greedy answers of `prompts` (one left-padded batch; max_new[i] >= 1 new tokens at most for prompt i),
    each ending at the first end token (included), as decode.loop.vanilla.vanilla_generate returns them."""
    if not prompts:
        return []
    if not all(batchable(p) for p in prompts):
        raise ValueError("batch_greedy takes text prompts with input_ids/attention_mask only")
    eos = sorted(target.eos_token_ids)
    pad = target.tokenizer.pad_token_id
    pad = int(pad if pad is not None else (eos[0] if eos else 0))
    width = max(p.length for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # (B, W) left-padded
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, W) 1 on real tokens
    for i, p in enumerate(prompts):
        ids[i, width - p.length:] = p.input_ids[0]
        mask[i, width - p.length:] = 1
    out = target.model.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                                max_new_tokens=max(max_new), do_sample=False, num_beams=1, pad_token_id=pad,
                                eos_token_id=eos or None, temperature=None, top_p=None, top_k=None)
    answers = []
    for i, row in enumerate(out[:, width:].tolist()):  # (B, new) generated part
        row = row[: max_new[i]]
        end = next((j for j, t in enumerate(row) if t in target.eos_token_ids), None)
        answers.append(row if end is None else row[: end + 1])
    return answers
