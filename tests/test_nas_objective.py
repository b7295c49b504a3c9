"""The speed-up objective on SYNTHETIC latency profiles with fixed taus (no supernet, no timing).

Two hand-built profiles of the tiny space's shapes (hidden 64, vocab 276):
    cpu-like   drafting is expensive (layers, LM head rows) and verify cost grows with the tree
    gpu-like   verify is nearly free up to 64 tokens (launch-bound), draft components cost little
The objective must prefer the cheap draft on the first and the bigger, deeper tree on the second.
"""

from __future__ import annotations

import itertools
import random

import optuna
import pytest

from decode.arch import DraftArch, max_tree_nodes
from decode.drafts.model import TargetDims
from decode.space import SearchSpace
from hwprofile.latency import LatencyModel, tree_tokens
from hwprofile.schema import Profile
from hwprofile.tables import Table
from nas.cost import draft_params, extra_memory
from nas.objective import ObjectiveConfig, SpeedupObjective, TauCache, constraints_func
from nas.suggest import arch_to_params, params_to_arch, starting_archs

DIMS = TargetDims(hidden_size=64, head_dim=16, vocab_size=276, num_layers=2)
SPACE = SearchSpace.load("tiny")
ENTROPY = 1


def _table(axes: tuple[str, ...], grid: dict[str, list[int]], fn) -> Table:
    t = Table(axes)
    for point in itertools.product(*(grid[a] for a in axes)):
        t.put(point, float(fn(**dict(zip(axes, point)))))
    return t


def synthetic_profile(step: float, verify, layer, head, overhead: float) -> LatencyModel:
    """A complete profile whose tables follow the given formulas (ms)."""
    g = {"ctx": [32, 256], "n": [1, 2, 4, 8, 16, 32, 64], "heads": [1, 4], "ffn": [32, 128], "cross": [0, 1],
         "f": [1, 2], "concat": [0, 1], "vocab": [64, 276], "tree_depth": [1, 3], "top_k": [1, 3]}
    tables = {
        "target_prefill": _table(("ctx",), g, lambda ctx: step * 4),
        "target_step": _table(("ctx",), g, lambda ctx: step),
        "verify": _table(("n", "ctx"), g, lambda n, ctx: verify(n)),
        "draft_layer": _table(("heads", "ffn", "cross", "n", "ctx"), g, layer),
        "feat_fc": _table(("f", "n"), g, lambda f, n: 0.05 * f),
        "draft_input": _table(("concat", "n"), g, lambda concat, n: 0.05 * (1 + concat)),
        "lm_head": _table(("vocab", "n"), g, head),
        "memory_append": _table(("heads", "ctx"), g, lambda heads, ctx: 0.02),
        "overhead": _table(("tree_depth", "top_k"), g, lambda tree_depth, top_k: overhead * tree_depth),
    }
    prof = Profile(hardware="synthetic", predicted=True, device={}, versions={}, dtype="float32", runtime="eager",
                   date="", command="", target={"name": "tiny-llava", "vocab_size": 276, "fingerprint": {}},
                   space=SPACE.to_dict(), config={}, grids={"default_context": 128}, tables=tables)
    return LatencyModel(prof)


# drafting expensive: each layer costs ~ a third of a target step, the LM head scales with rows x vocab,
# and every verified token adds 12% of a step
CPU = synthetic_profile(step=10.0, verify=lambda n: 10.0 + 1.2 * (n - 1),
                        layer=lambda heads, ffn, cross, n, ctx: (1 + heads / 2 + ffn / 64) * (1 + n / 3) * (1 + cross),
                        head=lambda vocab, n: 0.01 * vocab * n / 8, overhead=0.5)
# verification nearly free: 64 tokens cost 2% more than one; the draft is small next to a target step
GPU = synthetic_profile(step=24.0, verify=lambda n: 24.0 + 0.01 * n,
                        layer=lambda heads, ffn, cross, n, ctx: 0.4 + 0.1 * cross,
                        head=lambda vocab, n: 0.1, overhead=0.1)

CHEAP = DraftArch(fusion="concat", feature_layers=(-1,), depth=1, heads=(1,), ffn=(32,), draft_vocab=64,
                  tree_depth=1, top_k=2, total_tokens=2)
BIG_TREE = DraftArch(fusion="concat", feature_layers=(-1,), depth=2, heads=(4, 4), ffn=(128, 128), draft_vocab=None,
                     tree_depth=3, top_k=3, total_tokens=8)


def synthetic_tau(arch: DraftArch) -> float:
    """More tree and a bigger draft accept more, with diminishing returns (what trained drafts show)."""
    size = sum(h * f for h, f in zip(arch.heads, arch.ffn)) / (4 * 128)  # 0 .. 2
    per_level = 0.45 + 0.1 * min(size, 1.0) + 0.05 * (arch.top_k - 1)
    return 1.0 + sum(per_level**d for d in range(1, arch.tree_depth + 1)) * min(1.0, tree_tokens(arch) / 6)


def _objective(latency, tau=synthetic_tau, **cfg) -> SpeedupObjective:
    return SpeedupObjective(SPACE, ENTROPY, DIMS, latency, tau, ObjectiveConfig(**cfg))


def test_cheap_draft_wins_when_drafting_is_expensive():
    obj = _objective(CPU)
    cheap, big = obj.evaluate(CHEAP), obj.evaluate(BIG_TREE)
    assert big.tau > cheap.tau  # the big draft does accept more ...
    assert cheap.speedup > big.speedup  # ... but costs more than it saves
    assert cheap.speedup == pytest.approx(cheap.tau * 10.0 / cheap.cycle_ms)


def test_deep_tree_wins_when_verification_is_free():
    obj = _objective(GPU)
    cheap, big = obj.evaluate(CHEAP), obj.evaluate(BIG_TREE)
    assert big.speedup > cheap.speedup
    assert big.verify_ms == pytest.approx(24.0 + 0.01 * tree_tokens(BIG_TREE))


def _best(latency, n: int = 60) -> DraftArch:
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(_objective(latency), n_trials=n)
    return DraftArch.from_json(study.best_trial.user_attrs["arch"])


def test_search_picks_different_drafts_per_device():
    on_cpu, on_gpu = _best(CPU), _best(GPU)
    assert tree_tokens(on_gpu) > tree_tokens(on_cpu)
    assert on_gpu.tree_depth > on_cpu.tree_depth
    assert draft_params(on_cpu, DIMS) < draft_params(on_gpu, DIMS)


def test_tau_is_cached_per_arch():
    calls = []
    obj = _objective(GPU, tau=lambda a: calls.append(a) or 2.0)
    for _ in range(3):
        obj.evaluate(CHEAP)
    obj.evaluate(BIG_TREE)
    assert len(calls) == 2 and obj.tau.hits == 2 and isinstance(obj.tau, TauCache)


def test_budgets_become_constraints_and_skip_the_replay():
    calls = []
    limit = draft_params(CHEAP, DIMS) + 1
    obj = _objective(CPU, tau=lambda a: calls.append(a) or 2.0, max_params=limit, max_memory_mb=1000.0)
    ok, over = obj.evaluate(CHEAP), obj.evaluate(BIG_TREE)
    assert ok.feasible and ok.constraints[0] == -1 and ok.constraints[1] < 0
    assert not over.feasible and over.constraints[0] > 0 and over.tau is None and len(calls) == 1
    study = optuna.create_study(directions=["maximize", "minimize"],
                                sampler=optuna.samplers.NSGAIISampler(seed=0, constraints_func=constraints_func))
    study.optimize(_objective(CPU, max_params=limit, pareto=True), n_trials=8)
    assert len(study.directions) == 2
    for t in study.trials:
        assert list(t.user_attrs["constraints"]) == list(constraints_func(t))
        assert t.values[1] == t.user_attrs["params"]


def test_extra_memory_counts_weights_kv_and_cross_memory():
    m = extra_memory(BIG_TREE, DIMS, context=100, bytes_per_value=4)
    assert m.weights_mb == pytest.approx(draft_params(BIG_TREE, DIMS) * 4e-6)
    assert m.kv_mb == pytest.approx(2 * 2 * 4 * 16 * 100 * 4e-6) and m.cross_memory_mb == 0
    cross = extra_memory(DraftArch(fusion="cross", heads=(4,), ffn=(32,)), DIMS, context=100)
    assert cross.cross_memory_mb == cross.kv_mb > 0


def test_space_params_round_trip():
    rng = random.Random(0)
    archs = [a for _, a in starting_archs(SPACE, ENTROPY)] + [SPACE.sample(rng, ENTROPY) for _ in range(30)]
    for arch in archs:
        assert params_to_arch(arch_to_params(arch, SPACE, ENTROPY), SPACE, ENTROPY) == arch
    eagle = SPACE.eagle_like(ENTROPY)
    assert (eagle.fusion, eagle.feature_layers, eagle.depth, eagle.draft_vocab, eagle.visual_keep) == \
        ("concat", (-1,), 1, None, 1.0)
    assert eagle.heads == (max(SPACE.heads),) and eagle.ffn == (max(SPACE.ffn),)
    assert [label for label, _ in starting_archs(SPACE, ENTROPY)] == ["eagle-like", "largest", "smallest"]


def test_best_tree_is_chosen_per_device_for_the_same_draft():
    draft = DraftArch(fusion="concat", feature_layers=(-1,), depth=1, heads=(4,), ffn=(128,), draft_vocab=None,
                      tree_depth=1, top_k=3, total_tokens=2)
    picks = {}
    for name, latency in (("cpu", CPU), ("gpu", GPU)):
        obj = _objective(latency)
        best = obj.best_tree(draft)
        every = [obj.evaluate(v) for v in obj.tree_variants(draft)]
        assert best.speedup == max(e.speedup for e in every)  # exhaustive over the space's trees
        assert len(every) == len({e.arch for e in every}) > 4
        picks[name] = DraftArch.from_json(best.arch)
    assert picks["gpu"].tree_depth > picks["cpu"].tree_depth
    assert tree_tokens(picks["gpu"]) > tree_tokens(picks["cpu"])
    assert {a.heads for a in picks.values()} == {(4,)}  # only the tree changed


def test_tree_mode_best_leaves_the_tree_out_of_the_sampler_but_not_for_enqueued_archs():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    study.enqueue_trial(arch_to_params(BIG_TREE, SPACE, ENTROPY), user_attrs={"start": "reference"})
    study.optimize(_objective(GPU), n_trials=4)
    first, rest = study.trials[0], study.trials[1:]
    assert DraftArch.from_json(first.user_attrs["arch"]) == BIG_TREE and not first.user_attrs["tree_chosen"]
    for t in rest:
        assert "tree_depth" not in t.params and "total_tokens" not in t.params and "top_k" in t.params
        assert t.user_attrs["tree_chosen"]
    sampled = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    sampled.optimize(_objective(GPU, tree="sampled"), n_trials=2)
    assert all("tree_depth" in t.params for t in sampled.trials)
    with pytest.raises(ValueError, match="tree must be one of"):
        ObjectiveConfig(tree="exhaustive")


def test_repeated_proposals_are_scored_from_cache_and_not_counted():
    """--trials N scores N distinct archs: a re-proposed arch (common on small categorical spaces) is answered
    from the tau cache, marked `repeat`, and does not count; a resumed objective knows earlier proposals."""
    from nas.search import run_trials

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    calls = []
    obj = _objective(GPU, tau=lambda a: calls.append(a) or synthetic_tau(a))
    # a sampler that proposes from a tiny pool: repeats are certain
    pool = [SPACE.sample(random.Random(i), ENTROPY) for i in range(4)]
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    for arch in [a for a in pool for _ in range(3)]:  # a0 a0 a0 a1 a1 a1 ...
        study.enqueue_trial({k: v for k, v in arch_to_params(arch, SPACE, ENTROPY).items()
                             if k not in ("tree_depth", "total_tokens")})
    ran = run_trials(study, obj, n_trials=4, label="t", max_factor=3)
    done = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    repeats = [t.user_attrs["repeat"] for t in done]
    assert sum(not r for r in repeats) == 4 and sum(repeats) == 6 and ran == len(done) == 10
    assert len({t.user_attrs["proposal"] for t in done}) == 4
    assert len({a.to_json() for a in calls}) == len(calls)  # a repeat never replays
    # a resumed objective seeded from the study counts the same archs as repeats
    again = _objective(GPU)
    again.seed_proposals(study)
    assert again.proposals == {t.user_attrs["proposal"] for t in done}


def test_best_table_lists_each_arch_once():
    import pandas as pd

    from nas.report import best_table

    a, b = CHEAP.to_json(), BIG_TREE.to_json()
    df = pd.DataFrame([
        {"number": n, "state": "COMPLETE", "feasible": True, "speedup": sp, "tau": 1.2, "cycle_ms": 1.0,
         "draft_ms": 0.5, "verify_ms": 0.5, "params": 10, "arch": arch}
        for n, sp, arch in [(0, 0.9, a), (1, 0.9, a), (2, 0.8, b), (3, 0.9, a)]])
    table = best_table(df)
    assert table["number"].tolist() == [0, 2] and table["tree"].tolist() == ["1x2/2", "3x3/8"]


def test_every_arch_enumerates_what_the_sampler_can_propose():
    from dataclasses import replace

    from nas.suggest import every_arch, suggest_arch

    small = replace(SPACE, fusion=("concat", "cross"), depth=(1, 2), heads=(2,), ffn=(32, 64), draft_vocab=(None,),
                    visual_keep=(1.0,), feature_layers=((-1,),), top_k=(2,))
    # per depth d: 2 fusions x 2^d FFN choices (heads fixed) -> 2 x (2 + 4) = 12 archs without the tree
    every = every_arch(small, ENTROPY, tree=False, limit=100)
    assert len(every) == 12
    archs = {suggest_arch(optuna.trial.FixedTrial(p), small, ENTROPY, tree=False).to_json() for p in every}
    assert len(archs) == 12  # each dict is a distinct proposal
    assert every_arch(small, ENTROPY, tree=False, limit=11) is None
    # with the tree: totals clamp to what (depth, top_k) holds, so equal trees are not counted twice
    trees = {(td, min(t, max_tree_nodes(td, 2))) for td in small.tree_depth for t in small.total_tokens}
    assert len(every_arch(small, ENTROPY, tree=True, limit=10_000)) == 12 * len(trees)


def test_a_small_space_is_searched_without_repeats():
    from dataclasses import replace

    from nas.study import enqueue_small_space

    small = replace(SPACE, fusion=("concat", "cross", "hybrid"), depth=(1,), heads=(2,), ffn=(32, 64),
                    draft_vocab=(None,), visual_keep=(1.0,), feature_layers=((-1,),), top_k=(2,))
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0))
    assert enqueue_small_space(study, small, ENTROPY, False, 16, seed=0) == 6
    obj = SpeedupObjective(small, ENTROPY, DIMS, CPU, synthetic_tau)
    study.optimize(obj, n_trials=6)
    assert len({t.user_attrs["proposal"] for t in study.trials}) == 6  # all six, none twice


def test_an_arch_another_worker_scored_is_taken_from_the_study_not_scored_again():
    calls = []
    obj = SpeedupObjective(SPACE, ENTROPY, DIMS, CPU, lambda a: calls.append(a) or 2.0, ObjectiveConfig(tree="sampled"))
    arch = SPACE.eagle_like(ENTROPY)
    params = arch_to_params(arch, SPACE, ENTROPY)
    study = optuna.create_study(direction="maximize")
    # what another worker left in the shared study: its trial of this arch, finished
    study.add_trial(optuna.trial.create_trial(
        params=params, distributions={k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()},
        value=1.234, user_attrs={"proposal": arch.to_json(), "tau": 2.5, "speedup": 1.234}))
    study.enqueue_trial(params)
    study.optimize(obj, n_trials=1)
    mine = study.trials[-1]
    assert mine.value == 1.234 and mine.user_attrs["repeat"] is True and mine.user_attrs["tau"] == 2.5
    assert calls == []  # no replay


def test_run_trials_starts_no_new_trial_after_the_deadline_once_the_minimum_is_scored(monkeypatch):
    """Under a pipeline deadline (nas.pipeline.Deadline.trials_end) no trial starts that would end after `until` at
    the pace so far, but the trials never stop before `min_new` archs are scored (the EAGLE-like default and the
    space's corners the table needs)."""
    import time

    from nas import pipeline
    from nas.search import run_trials

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def slow(objective):  # each trial takes 10 s of the fake clock
        def run(trial):
            clock[0] += 10.0
            return objective(trial)
        return run

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    # the deadline already passed: exactly the minimum is scored
    assert run_trials(study, slow(_objective(GPU)), n_trials=8, label="t", until=50.0, min_new=3) == 3
    # 25 s left at 10 s per arch: trials at 100 and 110; one starting at 120 would end at 130, after the deadline
    clock[0] = 100.0
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    assert run_trials(study, slow(_objective(GPU)), n_trials=8, label="t", until=125.0, min_new=1) == 2
    # no deadline: every trial asked for
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    assert run_trials(study, slow(_objective(GPU)), n_trials=5, label="t") == 5
    # the pipeline's deadline: trials end confirm_s before it; none without a deadline
    assert pipeline.Deadline(total_s=1200, start=7.0).trials_end(150.0) == 1057.0
    assert pipeline.Deadline().trials_end(150.0) is None


def test_run_trials_goes_on_when_another_worker_finished_its_queued_trial(monkeypatch):
    from nas.search import run_trials

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    real, raised = study.optimize, []

    def optimize(*a, **k):
        if not raised:  # what Optuna raises when both workers popped one WAITING trial and the other told first
            raised.append(1)
            raise ValueError("Cannot tell a COMPLETE trial.")
        return real(*a, **k)

    monkeypatch.setattr(study, "optimize", optimize)
    run_trials(study, SpeedupObjective(SPACE, ENTROPY, DIMS, CPU, synthetic_tau), 3, "t")
    assert raised and len([t for t in study.trials if not t.user_attrs.get("repeat")]) == 3
    monkeypatch.setattr(study, "optimize", lambda *a, **k: (_ for _ in ()).throw(ValueError("other")))
    with pytest.raises(ValueError, match="other"):
        run_trials(study, SpeedupObjective(SPACE, ENTROPY, DIMS, CPU, synthetic_tau), 3, "t")
