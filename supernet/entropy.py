"""DREAM's feature-layer choice: the intermediate target layer whose attention is most focused.

TargetModel.prefill(attention_stats=True) gives the attention entropy of every decoder layer for
every query token, (L, T) fp32: -sum_k p log p over the keys, 0 log 0 = 0, averaged over heads.
A low entropy means the layer's queries attend to few keys; DREAM distils from the layer with the
lowest mean entropy.

Layer numbering (the mapping used everywhere in this project): entropy row i belongs to decoder
layer i (0-based); that layer's attention (and MLP) produce HF hidden state i + 1, so the choice
is returned as a hidden-state index h = i + 1 (0 = embeddings, L = after the final norm). The
first and last few hidden states are excluded: the embeddings and first layer carry little
context, the last ones are the target's own output (the EAGLE feature, stored anyway).
Candidates are h in [skip_first, L - skip_last] (defaults 2..L-3); when that range is empty (tiny
targets of 2-4 layers) every intermediate state 1..L-1 is a candidate.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

logger = logging.getLogger(__name__)

SKIP_FIRST = 2  # hidden states 0 (embeddings) and 1 are never chosen
SKIP_LAST = 3  # nor L-2, L-1 and L (after the final norm)


@dataclass(frozen=True)
class EntropyChoice:
    """The chosen hidden-state index and the statistics it came from (written into manifests)."""

    layer: int  # hidden-state index h (decoder layer h - 1's output)
    candidates: tuple[int, ...]  # hidden-state indices that were eligible
    mean_entropy: tuple[float, ...]  # (L,) per decoder layer, mean over the tokens seen
    tokens: int  # number of query tokens averaged
    per_token: dict[int, int]  # hidden-state index -> how many tokens have their lowest entropy there

    def to_dict(self) -> dict:
        d = asdict(self)
        d["per_token"] = {str(k): v for k, v in self.per_token.items()}
        d["mapping"] = "entropy row i (decoder layer i) -> hidden state i + 1"
        return d


def candidate_layers(num_layers: int, skip_first: int = SKIP_FIRST, skip_last: int = SKIP_LAST) -> tuple[int, ...]:
    """Hidden-state indices eligible as the entropy layer of an L-layer target."""
    if num_layers < 2:
        raise ValueError(f"an entropy layer needs a target with at least 2 layers, got {num_layers}")
    cands = tuple(range(skip_first, num_layers + 1 - skip_last))
    if not cands:  # tiny targets: every intermediate hidden state
        cands = tuple(range(1, num_layers))
    return cands


def _rows(num_layers: int, candidates: tuple[int, ...]) -> torch.Tensor:
    """Entropy rows (decoder layers) of the candidate hidden states: h -> h - 1."""
    return torch.tensor([h - 1 for h in candidates], dtype=torch.long)


def choose_layer(mean_entropy: torch.Tensor, candidates: tuple[int, ...] | None = None) -> int:
    """Per dataset: the candidate hidden state whose decoder layer has the lowest mean entropy.

    mean_entropy: (L,) one value per decoder layer. Ties go to the shallower layer (cheaper to
    reach for a layer-skip style draft, and deterministic).
    """
    num_layers = int(mean_entropy.numel())
    cands = candidates if candidates is not None else candidate_layers(num_layers)
    vals = mean_entropy.float()[_rows(num_layers, cands)]  # (C,)
    if not bool(torch.isfinite(vals).all()):
        raise ValueError(f"attention entropy is not finite: {vals.tolist()}")
    return cands[int(torch.argmin(vals))]  # argmin returns the first minimum


def per_token_layers(entropy: torch.Tensor, candidates: tuple[int, ...] | None = None) -> torch.Tensor:
    """Per token (for analysis): (T,) the candidate hidden state with the lowest entropy at each query.

    entropy: (L, T) as TargetModel.prefill returns it.
    """
    num_layers = int(entropy.shape[0])
    cands = candidates if candidates is not None else candidate_layers(num_layers)
    idx = torch.argmin(entropy.float()[_rows(num_layers, cands)], dim=0)  # (T,) index into cands
    return torch.tensor(cands, dtype=torch.long)[idx]


def calibrate(entropies: Iterable[torch.Tensor], candidates: tuple[int, ...] | None = None) -> EntropyChoice:
    """The dataset choice from per-sequence entropies [(L, T_i), ...]: token-weighted mean per layer.

    Query 0 sees only itself (entropy 0 in every layer); it is kept, as it shifts every layer
    equally and cannot change the argmin.
    """
    total: torch.Tensor | None = None
    tokens = 0
    hist: dict[int, int] = {}
    cands = candidates
    for ent in entropies:
        ent = ent.float()  # (L, T)
        if cands is None:
            cands = candidate_layers(int(ent.shape[0]))
        total = ent.sum(1) if total is None else total + ent.sum(1)  # (L,)
        tokens += int(ent.shape[1])
        for h, n in zip(*torch.unique(per_token_layers(ent, cands), return_counts=True)):
            hist[int(h)] = hist.get(int(h), 0) + int(n)
    if total is None or tokens == 0 or cands is None:
        raise ValueError("no attention entropies to choose a layer from")
    mean = total / tokens  # (L,)
    layer = choose_layer(mean, cands)
    logger.info("entropy layer: hidden state %d (decoder layer %d, mean entropy %.3f nats over %d tokens)",
                layer, layer - 1, float(mean[layer - 1]), tokens)
    return EntropyChoice(layer=layer, candidates=tuple(cands), mean_entropy=tuple(round(float(v), 5) for v in mean),
                         tokens=tokens, per_token=dict(sorted(hist.items())))
