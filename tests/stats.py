"""Small statistics helpers for distribution tests (no scipy dependency)."""

from __future__ import annotations

import math

import torch


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper quantile of chi-square(df) by the Wilson-Hilferty approximation (z=3.09: p = 0.001)."""
    k = float(df)
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 8.0) -> tuple[float, int]:
    """Pearson chi-square of observed counts (V,) against probabilities (V,).

    Tokens whose expected count is below min_expected are pooled into one bucket so the
    chi-square approximation holds. Returns (statistic, degrees of freedom).
    """
    n = float(counts.sum())
    expected = probs.double() * n
    big = expected >= min_expected
    obs = [counts.double()[big], counts.double()[~big].sum().reshape(1)]
    exp = [expected[big], expected[~big].sum().reshape(1)]
    o, e = torch.cat(obs), torch.cat(exp)
    keep = e > 0
    o, e = o[keep], e[keep]
    stat = float(((o - e) ** 2 / e).sum())
    return stat, max(int(keep.sum()) - 1, 1)
