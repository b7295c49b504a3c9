"""The per-cycle overhead: what a real propose + accept spends outside the tabled components.

What the component tables do not see is Python and small-tensor bookkeeping: build_tree's selections
(top-k, sorts, gathers), TentativeSlots' ancestor rows, the per-level masks, positions and parent-feature stacks,
DraftKV commit/drop, accept's pending bookkeeping. It grows with the number of tree levels and the
frontier width, so it is measured per (tree_depth, top_k) of the search space, on a real
NeuralDraft of the cheapest arch of the space (started on a prefilled target at the default
context), by subtracting the components *as they run inside that very cycle*:

    overhead = time(propose + accept)
               - time inside DraftModel.forward / .logits / .project_features (timed in place)
               - scorer(n) per level (log_softmax + top-k; from the scorer table)

Timing the components in place, instead of subtracting the tables, keeps the overhead free of
cache effects: the tables are measured cold (hwprofile.timing), while a small probe draft runs
warm in its own cycle. The verify side (forward_tree, verify, keep) is in the `verify` table.
"""

from __future__ import annotations

import functools
import logging
import random
from itertools import product

import torch

from decode.arch import DraftArch, max_tree_nodes
from decode.drafts.model import DraftModel, TargetDims
from decode.drafts.neural import NeuralDraft
from decode.drafts.pack import pack_for_decoding
from decode.loop.tree import TreePolicy
from decode.space import SearchSpace
from decode.targets.target import TargetModel
from hwprofile.config import Grids
from hwprofile.cycle import GREEDY, synthetic_prompt
from hwprofile.tables import Table
from hwprofile.timing import Stat, Timer

logger = logging.getLogger(__name__)


def probe_arch(space: SearchSpace, tree_depth: int, top_k: int) -> DraftArch:
    vocabs = [v for v in space.draft_vocab if v is not None]
    return DraftArch(fusion="concat", feature_layers=(-1,), depth=1, heads=(min(space.heads),), ffn=(min(space.ffn),),
                     draft_vocab=min(vocabs) if vocabs else None, tree_depth=tree_depth, top_k=top_k,
                     total_tokens=min(max(space.total_tokens), max_tree_nodes(tree_depth, top_k)))


class _Probe:
    """A started NeuralDraft of a probe arch whose model's component calls time themselves."""

    def __init__(self, target: TargetModel, arch: DraftArch, prompt, pre, timer: Timer, scorer: Table):
        torch.manual_seed(0)
        self.model = DraftModel(arch, TargetDims.of(target)).attach(target, init_head=True).eval()
        pack_for_decoding(self.model)  # as a draft loaded for decoding is
        self.timer, self.inside_ms = timer, 0.0
        for name in ("forward", "logits", "project_features"):  # instance attributes shadow the methods
            setattr(self.model, name, self._timed(getattr(self.model, name)))
        self.draft = NeuralDraft(self.model, name="overhead-probe")
        # eager levels on every runtime: the component tables are measured eagerly, and the timing wrappers cannot
        # run inside a compiled level graph (dynamo broke the graph at each and recompiled `wrapper` for every
        # probe until its limit: 4.5-8.8 ms of "overhead" per cycle on the compiled runtime against 0.2 eager)
        self.draft.compile_levels = False
        self.draft.start(target, prompt, pre)
        self.policy = TreePolicy(spec=arch.tree)
        self.root = int(pre.logits[-1].argmax())
        self.root_feat = {layer: pre.hidden[layer][-1:] for layer in arch.feature_layers}  # (1, H) per layer
        # scorer rows per cycle: the root, then top_k frontier nodes per further level
        self.scorer_ms = scorer.lookup(n=1) + (arch.tree_depth - 1) * scorer.lookup(n=arch.top_k)
        self.cycle()  # the first proposal feeds the whole prompt to the draft: not a steady-state cycle

    def _timed(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            out = {}
            self.inside_ms += self.timer.time_ms(lambda: out.setdefault("v", fn(*args, **kwargs)))
            return out["v"]

        return wrapper

    def cycle(self) -> None:
        tree = self.draft.propose(self.root, self.policy, GREEDY, None)
        bonus = int(tree.tokens[min(1, tree.size - 1)])  # an untrained draft's tree is rejected at the root
        self.draft.accept([self.root], self.root_feat, bonus)

    def overhead_ms(self) -> float:
        """Time one cycle; -> its time outside the components."""
        self.inside_ms = 0.0
        total = self.timer.time_ms(self.cycle)
        return total - self.inside_ms - self.scorer_ms


@torch.no_grad()
def measure_overhead(target: TargetModel, space: SearchSpace, grids: Grids, timer: Timer, scorer: Table,
                     progress: bool = True, seed: int = 0) -> tuple[Table, list[str]]:
    """overhead table over (tree_depth, top_k) and notes (e.g. residuals clamped at zero)."""
    from tqdm import tqdm

    prompt = synthetic_prompt(target, grids.default_context)
    pre = target.prefill(prompt, feature_layers=(-1,))
    probes = {(d, k): _Probe(target, probe_arch(space, d, k), prompt, pre, timer, scorer)
              for d, k in product(space.tree_depth, space.top_k)}
    cfg, rng, order = grids.components, random.Random(seed), list(probes)
    samples: dict[tuple[int, int], list[float]] = {key: [] for key in probes}
    with tqdm(total=len(probes) * (cfg.warmup + cfg.repeats), desc="cycle overhead", disable=not progress,
              leave=False) as bar:
        for r in range(cfg.warmup + cfg.repeats):
            rng.shuffle(order)  # round-robin in a fresh order, as hwprofile.timing.run_cases
            for key in order:
                ms = probes[key].overhead_ms()
                if r >= cfg.warmup:
                    samples[key].append(ms)
                bar.update()
    table, notes = Table(("tree_depth", "top_k")), []
    for key, values in samples.items():
        stat = Stat.of(values, cfg.trim)
        if stat.ms < 0:
            notes.append(f"overhead(tree_depth={key[0]}, top_k={key[1]}) came out {stat.ms:.3f} ms; clamped to 0")
        table.put(key, Stat(max(0.0, stat.ms), stat.iqr_ms, stat.n))
    target.cache = None
    return table, notes
