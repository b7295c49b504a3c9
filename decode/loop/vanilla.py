"""Plain autoregressive decoding through the TargetModel adapter (the speed-up baseline)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from decode.errors import UserError
from decode.loop.sampling import SamplingConfig, make_generator, sample_token
from decode.prompt import Prompt
from decode.targets.target import TargetModel


@dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens (EOS included when it ended the text)
    text: str
    prefill_s: float
    decode_s: float  # wall time after prefill
    target_forwards: int  # prefill excluded

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of the whole generation, prefill included (what a user waits)."""
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(new_tokens=self.new_tokens, tokens_per_s=self.tokens_per_s)
        return d


def check_max_new_tokens(n: int, target=None, prompt=None) -> None:
    """n >= 1 and, given a target and prompt, prompt + n within the target's context (max_position_embeddings)."""
    if n < 1:
        raise UserError(f"max-new-tokens must be at least 1, got {n}")
    if target is None or prompt is None:
        return
    limit = getattr(target.text_config, "max_position_embeddings", None)
    if isinstance(limit, int) and prompt.length + n > limit:
        raise UserError(f"the prompt ({prompt.length} tokens) + max-new-tokens ({n}) exceed {target.name}'s context of "
                        f"{limit} positions; use --max-new-tokens {max(1, limit - prompt.length)} or less")


def sync_device(device: torch.device) -> None:
    """Wait for queued GPU work (wall-clock timing of CUDA code needs it); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def vanilla_generate(
    target: TargetModel, prompt: Prompt, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig()
) -> GenerationResult:
    """Decode token by token with the KV cache until EOS or max_new_tokens."""
    check_max_new_tokens(max_new_tokens, target, prompt)
    gen = make_generator(sampling, target.device)
    eos = target.eos_token_ids
    sync_device(target.device)  # GPU work queued before this call must not be timed as this prefill
    t0 = time.perf_counter()
    logits = target.prefill(prompt, reserve=max_new_tokens).logits[-1]  # (V,)
    token = sample_token(logits, sampling, gen)
    sync_device(target.device)
    t1 = time.perf_counter()
    tokens = [token]
    forwards = 0
    while len(tokens) < max_new_tokens and token not in eos:
        logits = target.step(token).logits[-1]
        forwards += 1
        token = sample_token(logits, sampling, gen)
        tokens.append(token)
    sync_device(target.device)
    t2 = time.perf_counter()
    text = target.tokenizer.decode(tokens, skip_special_tokens=True)
    return GenerationResult(tokens=tokens, text=text, prefill_s=t1 - t0, decode_s=t2 - t1, target_forwards=forwards)
