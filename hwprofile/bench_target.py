"""Target tables: prefill, one decode step and tree verification, over context lengths.

Each context gets its own prefilled KV cache (a synthetic prompt of exactly ctx tokens); the cases
swap the target's cache in before each call (untimed) and crop back what the call appended
(untimed), so every repeat of every case runs at exactly its context, and all (n, ctx) cases can
be timed round-robin. What is timed is the real decode code:

    target_prefill  target.prefill(prompt of ctx tokens, feature_layers=(-1,))
    target_step     target.step(token) + argmax: one vanilla decode step (the speed-up's baseline)
    verify          the loop's verify half (hwprofile.cycle.verify_tree): forward_tree of n tree tokens
                    (root included), greedy verification, keep(path), path bookkeeping; the draft's
                    random tree is rejected at the root, as an untrained draft's would be
"""

from __future__ import annotations

import logging

import torch
from transformers import DynamicCache

from decode.targets.target import TargetModel
from hwprofile import census
from hwprofile.config import Grids
from hwprofile.cycle import filler_tokens, synthetic_prompt, verify_shape_tree, verify_tree
from hwprofile.tables import Table
from hwprofile.timing import Case, Timer, run_cases

logger = logging.getLogger(__name__)
FEATURES = (-1,)  # the loop always captures at least the draft's last-layer feature


class _ContextCaches:
    """One committed KV cache per context length, swapped into the target on demand. On the compiled runtime
    the target has one static cache: prefilled once at the longest context, each case sets its committed
    length (what follows is masked out, as in decoding)."""

    def __init__(self, target: TargetModel, contexts: tuple[int, ...]):
        self.target = target
        self.caches: dict[int, DynamicCache] = {}
        self.static = target.runtime == "compiled"
        if self.static:
            target.prefill(synthetic_prompt(target, max(contexts)), feature_layers=FEATURES)
            return
        for ctx in contexts:
            target.prefill(synthetic_prompt(target, ctx), feature_layers=FEATURES)
            self.caches[ctx] = target.cache

    def use(self, ctx: int) -> None:
        if self.static:
            self.target.static.set_length(ctx)
            return
        self.target.cache = self.caches[ctx]

    def crop_to(self, ctx: int) -> None:
        """Drop whatever the timed call committed after the ctx prompt tokens."""
        if self.static:
            self.target.static.set_length(ctx)
            return
        extra = self.target.cache.get_seq_length() - ctx
        if extra > 0:
            self.target.cache.crop(-extra)


def _step_case(target: TargetModel, caches: _ContextCaches, ctx: int) -> Case:
    token = int(filler_tokens(target, 1, offset=7)[0])
    return Case(("step", ctx), fn=lambda: int(target.step(token).logits[-1].argmax()),
                setup=lambda: caches.use(ctx), reset=lambda: caches.crop_to(ctx))


def _verify_case(target: TargetModel, caches: _ContextCaches, n: int, ctx: int) -> Case:
    tree = verify_shape_tree(target, n)
    return Case(("verify", n, ctx), fn=lambda: verify_tree(target, tree, FEATURES),
                setup=lambda: caches.use(ctx), reset=lambda: caches.crop_to(ctx))


SMALL_VERIFY = 8  # step and verifies of up to this many tokens are timed among themselves


def size_groups(cases: list[Case]) -> list[list[Case]]:
    """The step/verify cases split into round-robin groups by size: the step with the small verifies (n <= SMALL_VERIFY),
    the large verifies apart. Timed in one round-robin with 32-64 token verifies between them, the step and the
    2-5 token verifies of the default target ran 15-30% slower on a 2-core AMD EPYC, and unevenly (step 55.6,
    verify 1/2/3 63.5/62.9/72.1 ms, against 48.0, 47.2/48.5/61.9 among themselves), so a profile priced a 2-token
    verify below a step. In decoding a small verify follows a draft forward and a small verify, not a large one."""
    is_small = [c.key[0] == "step" or c.key[1] <= SMALL_VERIFY for c in cases]
    small = [c for c, s in zip(cases, is_small) if s]
    large = [c for c, s in zip(cases, is_small) if not s]
    return [g for g in (small, large) if g]


def _prefill_case(target: TargetModel, ctx: int) -> Case:
    prompt = synthetic_prompt(target, ctx)
    return Case(("prefill", ctx), fn=lambda: target.prefill(prompt, feature_layers=FEATURES))


@torch.no_grad()
def measure_target(target: TargetModel, grids: Grids, timer: Timer, progress: bool = True,
                   with_census: bool = True) -> dict[str, Table]:
    """target_prefill, target_step and verify tables on this device."""
    prefill = Table(("ctx",))
    cases = [_prefill_case(target, ctx) for ctx in grids.contexts]
    for case, (key, stat) in zip(cases, run_cases(cases, timer, grids.prefill, "prefill", progress).items()):
        prefill.put((key[1],), stat, census.count(case.fn) if with_census else None)

    caches = _ContextCaches(target, grids.contexts)
    cases = [_step_case(target, caches, ctx) for ctx in grids.contexts]
    cases += [_verify_case(target, caches, n, ctx) for ctx in grids.contexts for n in grids.verify_tokens]
    stats = {}
    for group in size_groups(cases):
        stats.update(run_cases(group, timer, grids.target, "target step/verify", progress))
    step, verify_t = Table(("ctx",)), Table(("n", "ctx"))
    for case in cases:
        c = census.count(case.fn, case.setup, case.reset) if with_census else None
        if case.key[0] == "step":
            step.put((case.key[1],), stats[case.key], c)
        else:
            verify_t.put(case.key[1:], stats[case.key], c)
    target.cache = None  # the per-context caches are for profiling only
    logger.info("target: step %.2f ms at ctx %d", step.ms[(grids.contexts[0],)], grids.contexts[0])
    return {"target_prefill": prefill, "target_step": step, "verify": verify_t}


@torch.no_grad()
def census_target(target: TargetModel, contexts: tuple[int, ...], verify_tokens: tuple[int, ...]) -> dict[str, dict]:
    """Census only (no timing) of the target entries of another grid: for predicted profiles."""
    out: dict[str, dict] = {"target_prefill": {}, "target_step": {}, "verify": {}}
    for ctx in contexts:
        out["target_prefill"][(ctx,)] = census.count(_prefill_case(target, ctx).fn)
    caches = _ContextCaches(target, contexts)
    for ctx in contexts:
        c = _step_case(target, caches, ctx)
        out["target_step"][(ctx,)] = census.count(c.fn, c.setup, c.reset)
        for n in verify_tokens:
            c = _verify_case(target, caches, n, ctx)
            out["verify"][(n, ctx)] = census.count(c.fn, c.setup, c.reset)
    target.cache = None
    return out
