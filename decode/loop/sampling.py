"""Sampling settings and the logits -> probabilities transform shared by target and drafts.

Lossless speculative sampling needs the target and the draft distributions to be transformed
identically (temperature, then top-p), so this is the single place that does it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decode.errors import UserError


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy (argmax); otherwise softmax(logits / T) restricted to the top-p nucleus."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < float("inf"):
            raise UserError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """(..., V) logits -> (..., V) fp32 probabilities after temperature and top-p.

    top-p keeps the smallest set of most likely tokens whose mass reaches top_p (the token that
    crosses the threshold is kept), then renormalises. Greedy gives a one-hot on the argmax.
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / cfg.temperature, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= cfg.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """One token id from (V,) logits: argmax when greedy, else a draw from probs_from_logits."""
    if cfg.greedy:
        return int(logits.argmax(-1))
    probs = probs_from_logits(logits, cfg)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(cfg: SamplingConfig, device: torch.device) -> torch.Generator | None:
    if cfg.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(cfg.seed if cfg.seed is not None else torch.seed())
    return gen
