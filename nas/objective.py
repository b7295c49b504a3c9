"""The search objective: predicted speed-up of a draft on one device, with optional budgets and a 2nd objective.

    speedup = tau * T_target_step(ctx) / (T_draft_cycle(arch, tau) + T_verify(tree tokens, ctx) + overhead)

tau comes from a TauSource (default: greedy replay of the supernet's active subnet on held-out data,
nas.acceptance), the times from a hwprofile LatencyModel (measured or predicted profile). tau is
cached per arch (keyed by the arch JSON, tree included), so a repeated arch costs nothing; the cache
can be seeded from the finished trials of a resumed study.

Budgets (ObjectiveConfig.max_params, max_memory_mb) go to Optuna as constraints (`constraints_func`
reads the trial's "constraints" user attribute: values <= 0 are feasible). An arch over budget is not
replayed at all (its tau is unknown, its objective value is the speed-up at tau = 1, a lower bound)
since the samplers rank infeasible trials below every feasible one anyway.

With `pareto`, a second objective (draft parameters, minimised) makes it a multi-objective study.

Trees (ObjectiveConfig.tree): with "best" (the default) the sampler picks the draft and top_k, and the
tree depth and total_tokens are then chosen *for this device*: every (depth, total_tokens) pair of the
space is scored from one sweep (nas/treesweep.py, exact) and the pair with the best predicted speed-up
is kept. Verification that is almost free (a launch-bound GPU) then gets deep, wide trees; a device
where every verified token costs gets small ones. With "sampled" the sampler picks the tree too. The
enqueued starting archs (EAGLE-like default, largest, smallest) keep their own trees as references.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import optuna
from safetensors import SafetensorError

from decode.arch import DraftArch, max_tree_nodes
from decode.drafts.model import TargetDims
from decode.drafts.neural import NeuralDraft
from decode.loop.tree import TreePolicy
from decode.space import SearchSpace
from hwprofile.latency import LatencyModel, tree_tokens
from nas.acceptance import estimate_tau
from nas.cost import draft_params, extra_memory
from nas.suggest import suggest_arch
from nas.treesweep import TreeSweep

logger = logging.getLogger(__name__)

CONSTRAINTS_ATTR = "constraints"
TREE_MODES = ("best", "sampled")


@dataclass(frozen=True)
class ObjectiveConfig:
    context: int | None = None  # committed tokens the speed-up is predicted at (None: the profile's default)
    image_tokens: int = 0  # image tokens in that context (visual_keep < 1 drops some from the draft's view)
    max_params: int | None = None  # draft parameter budget (constraint)
    max_memory_mb: float | None = None  # extra-memory budget: draft weights + KV cache + cross memory (constraint)
    pareto: bool = False  # second objective: draft parameters (minimised)
    bytes_per_value: int = 4  # dtype size for the memory estimate (fp32 on CPU, 2 for bf16/fp16)
    tree: str = "best"  # best: depth/total_tokens chosen per arch for the device; sampled: by the sampler

    def __post_init__(self) -> None:
        if self.tree not in TREE_MODES:
            raise ValueError(f"tree must be one of {TREE_MODES}, got {self.tree!r}")

    @property
    def directions(self) -> list[str]:
        return ["maximize", "minimize"] if self.pareto else ["maximize"]

    @property
    def constrained(self) -> bool:
        return self.max_params is not None or self.max_memory_mb is not None


@dataclass(frozen=True)
class Evaluation:
    """Everything the objective knows about one arch; stored as trial user attributes."""

    arch: str  # DraftArch JSON
    tau: float | None  # None: over budget, not replayed
    speedup: float
    cycle_ms: float
    draft_ms: float
    verify_ms: float
    target_step_ms: float
    tree_tokens: int
    params: int
    memory_mb: float
    feasible: bool
    constraints: tuple[float, ...]  # <= 0 feasible, one per budget


TauSource = Callable[[DraftArch], float]


class SupernetTau:
    """tau of the supernet's subnet `arch`, replayed greedily on held-out FeatureData items."""

    def __init__(self, supernet, sequences: Sequence[dict], num_layers: int):
        self.supernet, self.sequences, self.num_layers = supernet, list(sequences), num_layers

    def __call__(self, arch: DraftArch) -> float:
        draft = NeuralDraft(self.supernet.set_active(arch), name="subnet")
        return estimate_tau(draft, self.sequences, self.num_layers, TreePolicy(spec=arch.tree)).tau


class SweepTau:
    """Like SupernetTau, but one sweep per (subnet, top_k) serves every tree depth and total_tokens.

    The sweeps are kept in memory and, with `store` (a folder), on disk: sweeps do not depend on the
    hardware, so searches for other devices, resumed searches and other workers on the same supernet
    and held-out data reuse them. `store_key` must name those two inputs (a different key, other files).
    """

    def __init__(self, supernet, sequences: Sequence[dict], num_layers: int, max_depth: int,
                 store: str | Path | None = None, store_key: str = ""):
        self.supernet, self.sequences, self.num_layers = supernet, list(sequences), num_layers
        self.max_depth = max_depth
        self.store, self.store_key = (Path(store) if store is not None else None), store_key
        self.sweeps: dict[str, TreeSweep] = {}
        self.loaded = 0

    def _file(self, key: str) -> Path | None:
        if self.store is None:
            return None
        digest = hashlib.sha256(f"{self.store_key}\n{key}".encode()).hexdigest()[:24]
        return self.store / f"sweep-{digest}.safetensors"

    def sweep(self, arch: DraftArch) -> TreeSweep:
        depth = max(self.max_depth, arch.tree_depth)
        key = replace(arch, tree_depth=depth, total_tokens=1).to_json()  # the draft, top_k and depth, not N
        if key not in self.sweeps:
            file = self._file(key)
            sw = self._load(file) if file is not None and file.is_file() else None
            if sw is None:
                draft = NeuralDraft(self.supernet.set_active(arch), name="subnet")
                sw = TreeSweep.run(draft, self.sequences, self.num_layers, arch.top_k, depth)
                if file is not None:
                    sw.save(file)
            self.sweeps[key] = sw
        return self.sweeps[key]

    def _load(self, file: Path) -> TreeSweep | None:
        try:
            sw = TreeSweep.load(file)
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:  # damaged: recompute it
            logger.warning("ignoring sweep file %s (%s)", file, err)
            return None
        self.loaded += 1
        return sw

    def __call__(self, arch: DraftArch) -> float:
        return self.sweep(arch).acceptance(arch.tree_depth, arch.total_tokens).tau


class TauCache:
    """tau per arch JSON; `hits` counts the evaluations saved."""

    def __init__(self, source: TauSource):
        self.source = source
        self.values: dict[str, float] = {}
        self.hits = 0

    def __call__(self, arch: DraftArch) -> float:
        key = arch.to_json()
        if key in self.values:
            self.hits += 1
        else:
            self.values[key] = float(self.source(arch))
        return self.values[key]

    def seed_from(self, study: optuna.Study) -> int:
        """Take the taus of the study's finished trials (a resumed study, another worker); -> how many."""
        n = 0
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            arch, tau = t.user_attrs.get("arch"), t.user_attrs.get("tau")
            if arch is not None and tau is not None and arch not in self.values:
                self.values[arch] = float(tau)
                n += 1
        return n


class SpeedupObjective:
    """Callable for study.optimize: suggest an arch, predict its speed-up, record the details."""

    def __init__(self, space: SearchSpace, entropy_layer: int | None, dims: TargetDims, latency: LatencyModel,
                 tau: TauSource, config: ObjectiveConfig = ObjectiveConfig()):
        self.space, self.entropy_layer, self.dims = space, entropy_layer, dims
        self.latency, self.config = latency, config
        self.tau = tau if isinstance(tau, TauCache) else TauCache(tau)
        self.proposals: set[str] = set()  # archs the sampler proposed (before any tree choice)

    def seed_proposals(self, study: optuna.Study) -> None:
        """Remember the proposals of the study's finished trials (a resumed study, other workers)."""
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            if "proposal" in t.user_attrs:
                self.proposals.add(t.user_attrs["proposal"])

    @property
    def context(self) -> float:
        return float(self.config.context if self.config.context is not None else self.latency.default_context)

    def budgets(self, arch: DraftArch) -> tuple[int, float, tuple[float, ...]]:
        """(params, extra memory MB, constraint values: budget use minus budget, <= 0 is within)."""
        c = self.config
        params = draft_params(arch, self.dims)
        mem = extra_memory(arch, self.dims, self.context, c.bytes_per_value, c.image_tokens).total_mb
        cons = []
        if c.max_params is not None:
            cons.append(float(params - c.max_params))
        if c.max_memory_mb is not None:
            cons.append(float(mem - c.max_memory_mb))
        return params, mem, tuple(cons)

    def evaluate(self, arch: DraftArch) -> Evaluation:
        params, mem, cons = self.budgets(arch)
        feasible = all(v <= 0 for v in cons)
        tau = self.tau(arch) if feasible else None
        ctx, img = self.context, self.config.image_tokens
        lat = self.latency
        t = 1.0 if tau is None else tau  # an over-budget arch gets the tau = 1 lower bound
        parts = lat.breakdown(arch, accepted=t, context=ctx, image_tokens=img)  # ms per component
        step = lat.target_step_ms(ctx)
        return Evaluation(
            arch=arch.to_json(), tau=tau, speedup=t * step / parts["total"], cycle_ms=parts["total"],
            draft_ms=parts["total"] - parts["verify"], verify_ms=parts["verify"], target_step_ms=step,
            tree_tokens=tree_tokens(arch), params=params, memory_mb=mem, feasible=feasible, constraints=cons,
        )

    def tree_variants(self, arch: DraftArch) -> list[DraftArch]:
        """arch with every (tree depth, total_tokens) of the space at its top_k (duplicates dropped)."""
        out: list[DraftArch] = []
        for depth in self.space.tree_depth:
            for total in self.space.total_tokens:
                v = replace(arch, tree_depth=depth, total_tokens=min(total, max_tree_nodes(depth, arch.top_k)))
                if v not in out:
                    out.append(v)
        return out

    def best_tree(self, arch: DraftArch) -> Evaluation:
        """The evaluation of the tree variant of `arch` with the best predicted speed-up (ties: fewer tree
        tokens, then shallower); an over-budget arch is returned as is (it is not replayed)."""
        evals = [self.evaluate(v) for v in self.tree_variants(arch)]
        feasible = [e for e in evals if e.feasible]
        if not feasible:
            return self.evaluate(arch)
        return max(feasible, key=lambda e: (e.speedup, -e.tree_tokens, -DraftArch.from_json(e.arch).tree_depth))

    def __call__(self, trial: optuna.Trial):
        choose_tree = self.config.tree == "best" and "start" not in trial.user_attrs  # enqueued archs keep theirs
        arch = suggest_arch(trial, self.space, self.entropy_layer, tree=not choose_tree)
        proposal = arch.to_json()
        trial.set_user_attr("proposal", proposal)  # at once: workers sharing the study see it while it runs
        done = None if proposal in self.proposals else scored_elsewhere(trial, proposal)
        if done is not None:  # another worker scored this arch: its result, counted as a repeat (not scored twice)
            self.proposals.add(proposal)
            for key, value in done.user_attrs.items():
                trial.set_user_attr(key, value)
            trial.set_user_attr("repeat", True)
            return tuple(done.values) if self.config.pareto else done.values[0]
        repeat = proposal in self.proposals  # samplers re-propose archs on small categorical spaces
        self.proposals.add(proposal)
        ev = self.best_tree(arch) if choose_tree else self.evaluate(arch)
        for key, value in asdict(ev).items():
            trial.set_user_attr(key, list(value) if isinstance(value, tuple) else value)
        trial.set_user_attr("tree_chosen", choose_tree)
        trial.set_user_attr("proposal", proposal)
        trial.set_user_attr("repeat", repeat)
        if ev.tau is not None:
            logger.debug("trial %d: tau %.3f, cycle %.2f ms, speed-up %.3f", trial.number, ev.tau, ev.cycle_ms,
                         ev.speedup)
        return (ev.speedup, float(ev.params)) if self.config.pareto else ev.speedup


def scored_elsewhere(trial: optuna.Trial, proposal: str, wait_s: float = 120.0, suggest_s: float = 30.0,
                     poll_s: float = 0.2) -> optuna.trial.FrozenTrial | None:
    """A finished trial of another worker with the same proposal, or None (then this trial scores it).

    Earlier-numbered trials decide first: this one waits while an earlier trial is still suggesting (it has
    no proposal yet; one started over `suggest_s` ago without one is a dead worker's) or is scoring the same
    proposal (up to `wait_s`: a dead worker's trial never finishes). So two workers never replay one arch.
    """
    state = optuna.trial.TrialState
    deadline = time.monotonic() + wait_s
    while True:
        now = datetime.datetime.now()
        same, undecided = [], False
        for t in trial.study.get_trials(deepcopy=False, states=(state.COMPLETE, state.RUNNING)):
            if t.number == trial.number:
                continue
            if t.user_attrs.get("proposal") == proposal:
                same.append(t)
            elif (t.state == state.RUNNING and t.number < trial.number and "proposal" not in t.user_attrs
                  and t.datetime_start is not None and (now - t.datetime_start).total_seconds() < suggest_s):
                undecided = True
        done = [t for t in same if t.state == state.COMPLETE and t.values]
        if done:
            return min(done, key=lambda t: t.number)
        earlier = any(t.number < trial.number for t in same)
        if not (earlier or undecided) or time.monotonic() > deadline:
            return None
        time.sleep(poll_s)


def constraints_func(trial: optuna.trial.FrozenTrial) -> Sequence[float]:
    """Optuna's constraints hook: the values the objective stored (empty = unconstrained)."""
    return trial.user_attrs.get(CONSTRAINTS_ATTR, [])
