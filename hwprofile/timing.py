"""Timing: CUDA events on GPU, perf_counter on CPU; warm-up, round-robin repeats, trimmed median + IQR.

Every measured quantity is a `Case`: a callable that runs the real decode code once, with optional
untimed `setup`/`reset` around it (e.g. crop the target's cache back after a verify). `run_cases`
warms every case up, then times the cases *round-robin* (repeat r of every case before repeat r+1
of any): on a shared, noisy machine a burst of load then spreads over all grid points instead of
bending one of them, which keeps tables smooth in n and context. Each round runs the cases in a
fresh random order (fixed seed): a case never runs right after its neighbour on the grid, whose
weights would still sit in the CPU caches (e.g. the same draft layer at another width) and make it
look faster than inside a real draft cycle, where other layers, the head and the target run between
two calls of a layer.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from tqdm import tqdm


@dataclass(frozen=True)
class TimingConfig:
    warmup: int = 2  # untimed calls per case before timing
    repeats: int = 10  # timed calls per case
    trim: float = 0.1  # fraction of samples dropped at each end before the median

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Stat:
    """Summary of one case: trimmed median and inter-quartile range (ms), number of samples."""

    ms: float
    iqr_ms: float
    n: int

    @classmethod
    def of(cls, samples_ms: Sequence[float], trim: float = 0.1) -> "Stat":
        x = np.sort(np.asarray(samples_ms, dtype=float))
        if x.size == 0:
            raise ValueError("no samples")
        k = int(trim * x.size)
        core = x[k: x.size - k] if x.size - 2 * k > 0 else x
        q1, q3 = np.percentile(x, [25, 75])
        return cls(ms=float(np.median(core)), iqr_ms=float(q3 - q1), n=int(x.size))


@dataclass
class Case:
    key: Hashable
    fn: Callable[[], object]  # the timed call
    setup: Callable[[], object] | None = None  # untimed, before each call
    reset: Callable[[], object] | None = None  # untimed, after each call (restore state)


class Timer:
    """Times one call in ms: CUDA events around it on a GPU (after a synchronise), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time_ms(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def _call(case: Case, timer: Timer, timed: bool) -> float:
    if case.setup is not None:
        case.setup()
    ms = timer.time_ms(case.fn) if timed else (case.fn(), 0.0)[1]
    if case.reset is not None:
        case.reset()
    return ms


@torch.no_grad()
def run_cases(cases: Sequence[Case], timer: Timer, cfg: TimingConfig, desc: str = "timing",
              progress: bool = True, seed: int = 0) -> dict[Hashable, Stat]:
    """Warm up every case, then time them round-robin in a shuffled order per round; key -> Stat."""
    rng = random.Random(seed)
    order = list(cases)
    samples: dict[Hashable, list[float]] = {c.key: [] for c in cases}
    total = len(cases) * (cfg.warmup + cfg.repeats)
    with tqdm(total=total, desc=desc, disable=not progress, leave=False) as bar:
        for case in cases:
            for _ in range(cfg.warmup):
                _call(case, timer, timed=False)
                bar.update()
        timer.sync()
        for _ in range(cfg.repeats):
            rng.shuffle(order)
            for case in order:
                samples[case.key].append(_call(case, timer, timed=True))
                bar.update()
    return {k: Stat.of(v, cfg.trim) for k, v in samples.items()}
