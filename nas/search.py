"""`python -m nas.search`: hardware-aware search of the draft with the best predicted speed-up, exported.

    python -m nas.search                                   # whole pipeline, demo scale, default target, this device
    python -m nas.search --hardware h200 --supernet out/supernet-smolvlm-135m-demo/checkpoint --trials 100
    python -m nas.search --target tiny-llava --scale smoke --trials 8 --out out/nas-smoke

Each trial picks a DraftArch from the search space (Optuna define-by-run), scores the supernet's
subnet on held-out sequences (greedy tau, replayed without the target: nas/acceptance.py), and
predicts its cycle time on the device from a latency profile: speed-up = tau * T_step / T_cycle
(nas/objective.py). A new study first tries an EAGLE-like default, the largest and the smallest
draft. Trials live in an Optuna storage (default OUT/study.db, SQLite): rerunning with the same
--study-name continues the study (--trials N more), and several processes may share one storage.

Without --supernet the held-out data, profile, data and supernet come from the pipeline's cache
folder, built first when missing (nas/pipeline.py); data and training come last of them and, at demo scale, share
what is left of the scale's 20-minute deadline (nas.pipeline.Deadline). With --supernet, tau comes from --heldout-data,
or else (approximately) from the last --heldout sequences of the supernet's training data. Without
--profile a stored profile of --hardware is used, else one is measured (this device) or predicted
(another device; roofline calibrated here).

Writes OUT/trials.csv, OUT/best.csv, OUT/trials.png, OUT/summary.json and the best draft OUT/draft.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from decode.cli import run_cli, setup_logging
from decode.errors import UserError
from decode.paths import writable_dir
from decode.runtime.compiled import RUNTIMES
from nas.objective import TREE_MODES
from nas.study import SAMPLERS

if TYPE_CHECKING:  # heavy imports stay inside the functions so that --help and bad flags answer at once
    import pandas as pd

    from decode.space import SearchSpace
    from decode.targets.target import TargetModel
    from nas.hardware import ProfileChoice
    from nas.loading import HeldOut
    from supernet.elastic import DraftSupernet

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "smolvlm-135m"
EXHAUSTIVE_ARCHS = 16  # a space with at most this many archs (or at most --trials) is enumerated, not sampled
EXAMPLE_PROMPT = "Write a short story about a robot who learns to paint."


@dataclass(frozen=True)
class SearchConfig:
    hardware: str | None = None  # canonical name; None: this device (or the --profile's)
    target: str | None = None  # None: the supernet's target, or the default target
    supernet: str | None = None  # None: the pipeline (cache folder, built when missing)
    profile: str | None = None
    runtime: str = "eager"  # decoding runtime the design is for: its profile prices the designs
    profile_dir: str = "profiles"  # where stored profiles are looked up (new ones go to the run's own profiles/)
    space: str | None = None  # None: the supernet's own space
    trials: int | None = None  # None: the scale's default (40 at demo scale)
    storage: str | None = None  # None: sqlite:///OUT/study.db
    study_name: str | None = None  # None: nas-<hardware>-<target>
    sampler: str | None = None  # None: tpe, or nsga2 with pareto
    out: str | None = None  # None: out/nas-<hardware>-<target>
    seed: int = 0
    heldout: int | None = None  # last training sequences used for tau (None: the checkpoint's val_sequences or 4)
    heldout_data: str | None = None
    max_params: int | None = None
    max_memory_mb: float | None = None
    pareto: bool = False
    tree: str = "best"  # best: tree depth/total_tokens chosen per arch for the device; sampled: by the sampler
    sweep_cache: str | None = None  # stored tree sweeps (None: tau-sweeps/ beside the supernet; "none": off)
    corpus: str | None = None  # corpus lookup's n-grams: a corpus file or a draft folder with one; None: the
    #                            pipeline's (ShareGPT train answers + own answers; none with --supernet); "none": off
    context: int | None = None
    scale: str = "demo"
    finetune_steps: int | None = None  # None: the scale's nas.finetune_steps (0: none)
    finetune_minutes: float | None = None  # fine-tuning stops after this much wall-clock (None: the scale's
    #                                        nas.finetune_time_budget_s; 0: no limit)
    finetune_data: str | None = None  # data folder read with the training data when fine-tuning (None: the pipeline's
    #                                   finetune-data/ where the scale has nas.finetune_data, else none)
    trial_sequences: int | None = None  # held-out sequences trials score on (None: the scale's; 0: all)
    export: bool = True
    device: str = "auto"
    dtype: str = "auto"
    cache_dir: str | None = None

    def check(self) -> None:
        if self.trials is not None and self.trials < 1:
            raise UserError(f"--trials must be at least 1, got {self.trials}")
        if self.tree not in TREE_MODES:
            raise UserError(f"unknown tree mode '{self.tree}'; use one of: {', '.join(TREE_MODES)}")
        if self.sampler is not None and self.sampler not in SAMPLERS:
            raise UserError(f"unknown sampler '{self.sampler}'; use one of: {', '.join(SAMPLERS)}")
        for name in ("heldout", "max_params", "context"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {v}")
        if self.max_memory_mb is not None and self.max_memory_mb <= 0:
            raise UserError(f"--max-memory-mb must be > 0, got {self.max_memory_mb}")
        if self.finetune_steps is not None and self.finetune_steps < 0:
            raise UserError(f"--finetune-steps must be >= 0, got {self.finetune_steps}")
        if self.finetune_minutes is not None and not 0 <= self.finetune_minutes < float("inf"):
            raise UserError(f"--finetune-minutes must be a number >= 0 (0: no limit), got {self.finetune_minutes}")
        if self.trial_sequences is not None and self.trial_sequences < 0:
            raise UserError(f"--trial-sequences must be >= 0 (0: all), got {self.trial_sequences}")
        if self.corpus not in (None, "none"):
            from decode.drafts.corpus import corpus_file

            if not corpus_file(self.corpus).is_file():
                raise UserError(f"--corpus {self.corpus}: no corpus file there; build one with python -m decode.corpus "
                                "or pass 'none'")


@dataclass
class SearchResult:
    out: Path
    study_name: str
    storage: str
    trials_run: int
    total_complete: int
    best: dict  # the best trial's user attrs + number
    draft: Path | None
    table: pd.DataFrame  # the best trials
    command: str | None
    chosen: dict | None = None  # the exported design's row of the kinds table (nas/choose.py)
    kinds_text: str = ""  # every kind side by side, as printed
    bench_command: str | None = None  # decode.bench of the export on held-out prompts the search never saw


def _json(obj) -> object:
    """Normalised as it comes back from Optuna's storage (tuples -> lists)."""
    return json.loads(json.dumps(obj))


@dataclass
class Inputs:
    """Everything a search reads, resolved and checked."""

    target: TargetModel
    checkpoint: str
    supernet: DraftSupernet
    state: dict  # the supernet checkpoint's state.json
    space: SearchSpace
    n_heldout: int | None  # None: tau on separate held-out data
    held: HeldOut
    profile: ProfileChoice
    defaults: dict  # the scale's nas defaults
    trial_seqs: list[dict] = field(default_factory=list)  # the held-out sequences trials score on
    tuned: tuple | None = None  # (supernet copy, info) after fine-tuning the best subnet alone (finetune_best)
    finetune_data: str | None = None  # extra fine-tuning data (the target's own answers), read with the training data
    corpus: object | None = None  # the NgramCorpus of corpus-lookup branches (decode/drafts/corpus.py), None: none
    corpus_path: str | None = None  # its file (exported with a design that uses it)
    pipeline: object | None = None  # the nas.pipeline.PipelineConfig whose stages built these inputs, else None
    trials_end: float | None = None  # time.perf_counter() after which no new trial starts (the deadline), None: none


def prepare_inputs(cfg: SearchConfig, started: float | None = None) -> Inputs:
    """Target, supernet (from the pipeline when not given), space, held-out sequences, latency profile. `started`
    (time.perf_counter()): when the run began, for the pipeline's deadline (None: now)."""
    from decode.drafts.corpus import NgramCorpus, corpus_file
    from decode.space import SearchSpace
    from decode.targets.loader import load_target
    from nas import pipeline
    from nas.hardware import check_hardware, local_hardware, resolve_profile, warn_extrapolation
    from nas.loading import check_subspace, heldout_sequences, load_supernet, read_supernet_state, trial_subset

    start = time.perf_counter() if started is None else started  # the pipeline's deadline counts from here
    # cheap checks first: bad names fail before any model is loaded
    if cfg.hardware is not None and cfg.profile is None:
        check_hardware(cfg.hardware, local_hardware(cfg.device))
    state = read_supernet_state(cfg.supernet) if cfg.supernet is not None else None
    target_name = cfg.target or (state["target_name"] if state else DEFAULT_TARGET)
    defaults = pipeline.nas_defaults(cfg.scale)
    target = load_target(target_name, device=cfg.device, dtype=cfg.dtype,
                         cache_dir=Path(cfg.cache_dir) if cfg.cache_dir else None)
    if cfg.finetune_data is not None:  # checked before any work: it must exist, fit the target, hold no held-out prompt
        from supernet.dataset import FeatureData

        if FeatureData(cfg.finetune_data, target).manifest.get("config", {}).get("split") == "heldout":
            raise UserError(f"--finetune-data {cfg.finetune_data} holds held-out prompts: fine-tuning on them would "
                            "make the held-out tau dishonest; build it with supernet.data --split train")
    pcfg = pipeline.PipelineConfig(target=target_name, scale=cfg.scale, space=cfg.space, device=cfg.device,
                                   dtype=cfg.dtype, cache_dir=cfg.cache_dir)
    ckpt, heldout_data = cfg.supernet, cfg.heldout_data
    # the scale's space as it is now in the pipeline (a cached supernet may predate new trees), --space where given,
    # else the given supernet's (after it loads)
    space = SearchSpace.load(pcfg.space_name) if cfg.supernet is None or cfg.space is not None else None
    choice = answers = trials_end = None
    if ckpt is None:  # the pipeline: cached (or freshly built) stages, data and training last (nas.pipeline.Deadline)
        deadline = pipeline.Deadline(float(defaults["deadline_s"]), float(defaults["after_training_s"]), start,
                                     data_share=float(defaults["data_share"]))
        pipeline.begin(pcfg)
        if heldout_data is None:  # fixed work: how long it takes here paces the time set aside after training
            before, began = pipeline.built_tokens(pcfg.run_dir / "heldout"), time.perf_counter()
            heldout_data = str(pipeline.heldout_stage(pcfg, target))
            built, took = pipeline.built_tokens(heldout_data) - before, time.perf_counter() - began
            reference = float(defaults["pace_tokens_per_s"])
            deadline = deadline.paced(built, took, reference)
            if deadline.pace < 1:
                logger.info("this machine built the held-out data at %.0f tokens/s (%.0f on the machine the deadline's "
                            "reserve was measured on): %.0f s set aside for the stages after training, not %.0f",
                            built / took, reference, deadline.reserved(), deadline.after_s)
        if cfg.corpus is None:  # the corpus's own answers (counted after training, with the rest: corpus_stage)
            answers = pipeline.answers_stage(pcfg, target)
        if cfg.profile is None:  # new profiles go to the run folder
            choice = pipeline.profile_stage(pcfg, target, cfg.hardware, bool(defaults["quick_profile"]),
                                            Path(cfg.profile_dir), cfg.runtime,
                                            search_space=space)
        data_dir = pipeline.data_stage(pcfg, target, deadline)
        ckpt = str(pipeline.supernet_stage(pcfg, data_dir, deadline))
        trials_end = deadline.trials_end(float(defaults["confirm_s"]))
    supernet, state = load_supernet(ckpt, target)
    space = space if space is not None else supernet.space
    space.check_target(target.num_layers, target.vocab_size)
    check_subspace(space, supernet)
    n_heldout = cfg.heldout or int(state.get("config", {}).get("val_sequences") or defaults["heldout"])
    held = heldout_sequences(target, supernet, state, heldout_data, n_heldout, space)
    if choice is None:  # a profile made now belongs to this search's output folder, never to the checkout's profiles/
        own = out_dir(cfg, cfg.hardware or local_hardware(cfg.device), target.name) / "profiles"
        choice = resolve_profile(target, cfg.hardware, cfg.profile, [Path(cfg.profile_dir), own], own,
                                 device=cfg.device, space=cfg.space or space.name,
                                 quick=bool(defaults["quick_profile"]), cache_dir=cfg.cache_dir, runtime=cfg.runtime,
                                 search_space=space)
    warn_extrapolation(choice.latency, space)
    n_trial = cfg.trial_sequences if cfg.trial_sequences is not None else defaults.get("trial_sequences")
    trial_seqs = trial_subset(held.sequences, n_trial or None)
    corpus_path = None
    if cfg.corpus not in (None, "none"):  # a corpus file, or a draft folder holding one
        corpus_path = corpus_file(cfg.corpus)
    elif cfg.corpus is None and cfg.supernet is None:  # the pipeline: ShareGPT train answers + the target's own
        # predictions over its training data and its own answers (and a --finetune-data folder given). Not the scale's
        # fine-tuning data: it is built only when fine-tuning runs (ensure_finetune_data), after the corpus
        own = [Path(cfg.finetune_data)] if cfg.finetune_data else []
        corpus_path = pipeline.corpus_stage(pcfg, target, [pcfg.run_dir / "data"] + own +
                                            ([answers] if answers is not None else []))
    corpus = NgramCorpus.load(corpus_path, vocab_size=target.vocab_size) if corpus_path is not None else None
    return Inputs(target, ckpt, supernet, state, space, None if heldout_data else n_heldout, held, choice, defaults,
                  trial_seqs, finetune_data=cfg.finetune_data, corpus=corpus,
                  corpus_path=str(corpus_path) if corpus_path is not None else None,
                  pipeline=pcfg if cfg.supernet is None else None, trials_end=trials_end)


def run_trials(study, objective, n_trials: int, label: str, max_factor: int = 3, until: float | None = None,
               min_new: int = 1) -> int:
    """study.optimize until `n_trials` *new* archs are scored, with a tqdm bar; -> trials run.

    A trial that re-proposes an arch already scored (samplers do, on small categorical spaces) costs
    next to nothing (cached tau) and is not counted, so --trials N scores N distinct archs; at most
    max_factor * N trials run in all, should the sampler keep repeating itself. `until` (time.perf_counter(), a
    deadline): once `min_new` new archs are scored, no trial starts that would end after it at the mean pace of
    this run's new archs so far.
    """
    import optuna
    from tqdm import tqdm

    new, ran = 0, 0
    began = time.perf_counter()
    timed_out = False  # stopped by the deadline (not by the sampler repeating itself)

    def out_of_time() -> bool:
        nonlocal timed_out
        now = time.perf_counter()
        timed_out = until is not None and new >= min_new and now + (now - began) / max(1, new) > until
        return timed_out

    with tqdm(total=n_trials, desc=label, unit="arch", disable=None) as bar:
        def tick(study_: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            nonlocal new, ran
            ran += 1
            if not trial.user_attrs.get("repeat", False):
                new += 1
                bar.update(1)
            if trial.user_attrs.get("speedup") is not None:
                bar.set_postfix(tau=trial.user_attrs.get("tau"), speedup=round(trial.user_attrs["speedup"], 3))
            if new >= n_trials:
                study_.stop()
            elif out_of_time():
                logger.warning("the deadline leaves no time for more trials: %d new archs scored of %d asked", new,
                               n_trials)
                study_.stop()

        for _ in range(max_factor * n_trials):
            try:
                study.optimize(objective, n_trials=max_factor * n_trials - ran, callbacks=[tick])
                break
            except ValueError as err:  # two workers popped one queued trial (Optuna's SQLite queue is not atomic)
                if "Cannot tell a" not in str(err):
                    raise
                ran += 1  # the other worker recorded the same arch's result; this worker goes on
                logger.warning("a queued trial was also run by another worker, which finished it first; continuing")
            if new >= n_trials or ran >= max_factor * n_trials or out_of_time():
                break
    if new < n_trials and not timed_out:
        logger.warning("the sampler kept re-proposing scored archs: %d new of %d asked in %d trials", new, n_trials,
                       ran)
    return ran


def export_best(cfg: SearchConfig, inp: Inputs, best: dict, meta: dict, out: Path) -> Path:
    """The chosen design -> out/draft, written atomically: a subnet (optionally fine-tuned first), alone or
    merged with lookup, or a weightless checkpoint of a training-free kind (nas/choose.py)."""
    from decode.arch import DraftArch
    from decode.drafts.kinds import TRAINING_FREE, save_training_free
    from decode.drafts.prompt_lookup import LookupSpec
    from nas.export import export_draft, replace_dir

    kind = best.get("kind", "neural")
    tmp = out / f".draft.tmp{os.getpid()}"
    lookup = LookupSpec(**best["lookup"]) if best.get("lookup") else None
    if kind in TRAINING_FREE:
        skip = (best["layerskip"]["layers"], best["layerskip"]["tree_depth"]) if best.get("layerskip") else None
        save_training_free(tmp, kind, inp.target, lookup, meta, layerskip=skip)
        _with_corpus(tmp, lookup, inp)
        replace_dir(tmp, out / "draft")
        return out / "draft"
    extra = {"kind": kind, **({"lookup": best["lookup"], "merge": best.get("merge", "union")}
                              if best.get("lookup") else {})}
    arch = DraftArch.from_json(best["arch"])
    net = inp.supernet
    if best.get("tuned"):
        net, meta["finetune"] = inp.tuned
    export_draft(net, arch, inp.target, tmp, meta, extra)
    _with_corpus(tmp, lookup, inp)
    replace_dir(tmp, out / "draft")
    return out / "draft"


def _with_corpus(folder: Path, lookup, inp: Inputs) -> None:
    """A design with a corpus branch carries its corpus (decode.drafts.kinds loads DIR/corpus.safetensors)."""
    import shutil

    from decode.drafts.corpus import CORPUS_NAME

    if lookup is not None and lookup.uses_corpus:
        shutil.copyfile(inp.corpus_path, folder / CORPUS_NAME)


def finetune_steps(cfg: SearchConfig, defaults: dict) -> int:
    """Fine-tuning's steps: --finetune-steps, else the scale's (0: none)."""
    return cfg.finetune_steps if cfg.finetune_steps is not None else int(defaults.get("finetune_steps", 0))


def finetune_budget_s(cfg: SearchConfig, defaults: dict) -> float:
    """Fine-tuning's wall-clock budget in seconds: --finetune-minutes, else the scale's (0: none)."""
    if cfg.finetune_minutes is not None:
        return cfg.finetune_minutes * 60.0
    return float(defaults.get("finetune_time_budget_s") or 0.0)


def ensure_finetune_data(inp: Inputs) -> str | None:
    """inp.finetune_data: --finetune-data, else (the pipeline) the scale's fine-tuning data, built now if it has some.

    Built only here, once fine-tuning is to run: the target's answers with their hidden states took 10.4 of the cpu
    scale's minutes, and on a CPU the fine-tuning gate skips the fine-tuning they are for (README)."""
    if inp.finetune_data is None and inp.pipeline is not None:
        from nas import pipeline

        built = pipeline.finetune_data_stage(inp.pipeline, inp.target)
        inp.finetune_data = str(built) if built is not None else None
    return inp.finetune_data


def finetune_best(inp: Inputs, arch, steps: int, ckpt_dir: Path | None = None, time_budget_s: float = 0.0):
    """The best subnet fine-tuned alone for `steps` sequences on a copy of the supernet (the study's other
    subnets keep their weights) -> (the copy, fine-tuning info). Weight sharing costs the subnets of a
    supernet acceptance (README, "weight sharing"); training the chosen one alone wins some of it back
    (cpu scale, 6000 steps: held-out tau 1.297 -> 1.376; with the target's own answers, inp.finetune_data, read
    besides the training data: 1.392). Checkpointed in ckpt_dir every 500
    steps: an interrupted search resumes its fine-tuning there, a finished one is reused. time_budget_s > 0: it also
    stops after that much wall-clock (nas/finetune.py)."""
    import copy
    import time

    from nas.finetune import FinetuneConfig, finetune_subnet
    from supernet.dataset import FeatureData, MixedData

    data = FeatureData(inp.state["data"], inp.target)
    ids = list(range(len(data) - (inp.n_heldout or 0)))  # never the held-out tail
    identity = {"supernet": sweep_key(inp, [])}
    if inp.finetune_data is not None:  # the target's own answers besides the training data (MixedData indices)
        extra = FeatureData(inp.finetune_data, inp.target)
        for layer in arch.feature_layers:
            extra.layer_index(layer)  # a one-line error when the folder lacks a layer the subnet reads
        ids += [len(data) + j for j in range(len(extra))]
        identity["finetune_data"] = {"dir": str(Path(inp.finetune_data).resolve()), "ids": extra.ids}
        data = MixedData([data, extra])
    net = copy.deepcopy(inp.supernet)
    t0 = time.perf_counter()
    logger.info("fine-tuning the best subnet alone for %d steps%s on %d sequences", steps,
                f" or {time_budget_s / 60:.0f} minutes" if time_budget_s > 0 else "", len(ids))
    info = finetune_subnet(net, arch, data, ids, FinetuneConfig.like_training(steps, inp.state,
                                                                              time_budget_s=time_budget_s),
                           ckpt_dir=ckpt_dir, identity=identity)
    net.eval()
    info = {**info, "sequences": len(ids), "seconds": round(time.perf_counter() - t0, 1)}
    if inp.finetune_data is not None:
        info["finetune_data"] = inp.finetune_data
    return net, info


def choose_kind(cfg: SearchConfig, inp: Inputs, done, source, latency, context: float, hardware: str):
    """Every kind priced on this profile (nas/choose.py) -> (rows, the chosen row, the printed table).

    Designs are picked on the trials' sequences, then confirmed on the whole held-out set when it is larger."""
    from decode.arch import DraftArch
    from nas.choose import (
        FINETUNE_GAIN,
        choose,
        confirm_rows,
        finetune_may_pay,
        format_table,
        kinds_rows,
        lookup_grids,
        tuned_rows,
    )
    from nas.kinds import EarlyExit, KindScorer
    from nas.objective import SweepTau

    depth = max(inp.space.tree_depth)
    if not isinstance(source, SweepTau):  # --tree sampled: the merged rows still need sweeps
        source = SweepTau(inp.supernet, inp.trial_seqs, inp.target.num_layers, depth, store=sweep_store(cfg, inp),
                          store_key=sweep_key(inp, inp.trial_seqs))
    early_exit = EarlyExit.of(inp.target)
    scorer = KindScorer(inp.trial_seqs, latency, context, early_exit=early_exit, corpus=inp.corpus)
    grid, corpus_grid = scorer.grids()
    rows = kinds_rows(scorer, done, source.sweep, inp.space.tree_depth, inp.space.total_tokens,
                      inp.space.eagle_like(inp.supernet.entropy_layer), top=int(inp.defaults.get("kinds_top", 3)),
                      grid=grid, corpus_grid=corpus_grid)
    every = inp.held.sequences
    whole = whole_scorer = None
    if len(every) > len(inp.trial_seqs):
        logger.info("confirming %d designs on all %d held-out sequences (picked on %d)", len(rows), len(every),
                    len(inp.trial_seqs))
        whole = SweepTau(inp.supernet, every, inp.target.num_layers, 1, store=sweep_store(cfg, inp),
                         store_key=sweep_key(inp, every))  # depth 1: each sweep as deep as its rows' trees
        whole_scorer = KindScorer(every, latency, context, lookup_ms=scorer.lookup_ms, early_exit=early_exit,
                                  corpus=inp.corpus, corpus_ms=scorer.corpus_ms)
        rows = confirm_rows(rows, whole_scorer, whole.sweep, grids=lookup_grids(corpus_grid))
    steps = finetune_steps(cfg, inp.defaults)
    asked = cfg.finetune_steps is not None or cfg.finetune_minutes is not None  # asked for by flag: always run
    if steps and not done.empty and not asked and not finetune_may_pay(rows):  # on the confirmed rows
        logger.warning("fine-tuning skipped: the best neural design, even %.0f%% faster (%.0f%% merged with lookup), "
                       "would trail the best training-free one on %s (--finetune-steps N runs it anyway)",
                       100 * FINETUNE_GAIN["neural"], 100 * FINETUNE_GAIN["neural+lookup"], hardware)
    elif steps and not done.empty:
        best = DraftArch.from_json(done.iloc[0]["arch"])
        ensure_finetune_data(inp)
        tuned_net, info = finetune_best(inp, best, steps, ckpt_dir=out_dir(cfg, hardware, inp.target.name) / "finetune",
                                        time_budget_s=finetune_budget_s(cfg, inp.defaults))
        inp.tuned = (tuned_net, info)
        tuned = tuned_rows(scorer, best, SweepTau(tuned_net, inp.trial_seqs, inp.target.num_layers, depth).sweep(best),
                           inp.space.tree_depth, inp.space.total_tokens, grid)
        if whole_scorer is not None:  # both share one sweep of the fine-tuned subnet: confirmed together
            tuned = confirm_rows(tuned, whole_scorer, whole.sweep,
                                 SweepTau(tuned_net, every, inp.target.num_layers, 1).sweep)
        rows += tuned
    chosen = choose(rows)
    text = format_table(rows, chosen, hardware)
    logger.log(logging.WARNING if chosen["kind"] == "none" else logging.INFO, "%s", text)
    return rows, chosen, text


def sweep_key(inp: Inputs, sequences: list[dict]) -> str:
    """What the stored sweeps depend on: the supernet's weights and the held-out sequences, not the hardware."""
    from nas.loading import supernet_digest

    return supernet_digest(inp.state, inp.checkpoint, sequences)


def sweep_store(cfg: SearchConfig, inp: Inputs) -> Path | None:
    """--sweep-cache, else tau-sweeps/ beside the supernet checkpoint; None (memory only) when not writable."""
    if cfg.sweep_cache == "none":
        return None
    store = Path(cfg.sweep_cache) if cfg.sweep_cache else Path(inp.checkpoint).resolve().parent / "tau-sweeps"
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        logger.warning("cannot write tree sweeps to %s (%s); keeping them in memory only", store, err)
        return None
    return store


def out_dir(cfg: SearchConfig, hardware: str, target_name: str) -> Path:
    """--out, else out/nas-<hardware>-<target>."""
    return Path(cfg.out or f"out/nas-{hardware}-{Path(target_name).name}")


def run_search(cfg: SearchConfig, started: float | None = None) -> SearchResult:
    """The search (and, without a supernet, the pipeline before it); `started`: as for prepare_inputs."""
    import optuna

    from decode.drafts.model import TargetDims
    from nas.choose import to_json
    from nas.objective import ObjectiveConfig, SpeedupObjective, SupernetTau, SweepTau, TauCache
    from nas.report import finished, write_report
    from nas.study import (
        SetupMismatch,
        enqueue_small_space,
        enqueue_starting_archs,
        open_storage,
        open_study,
        sqlite_url,
    )

    cfg.check()
    storage = open_storage(cfg.storage) if cfg.storage is not None else None  # a bad URL fails first
    writable_dir(cfg.out or "out")  # before data, training and profiling: the results must be savable
    if cfg.cache_dir is not None:
        writable_dir(cfg.cache_dir, "--cache-dir")
    inp = prepare_inputs(cfg, started)
    target, choice, held = inp.target, inp.profile, inp.held
    latency = choice.latency
    image_tokens = round(sum(int(s["image_mask"].sum()) for s in held.sequences) / len(held.sequences))
    obj_cfg = ObjectiveConfig(context=cfg.context, image_tokens=image_tokens, max_params=cfg.max_params,
                              max_memory_mb=cfg.max_memory_mb, pareto=cfg.pareto,
                              bytes_per_value=4 if latency.profile.dtype == "float32" else 2, tree=cfg.tree)

    tname = Path(target.name).name
    out = out_dir(cfg, choice.hardware, target.name)
    out.mkdir(parents=True, exist_ok=True)
    url = cfg.storage or sqlite_url(out / "study.db")
    storage = storage or open_storage(url)
    study_name = cfg.study_name or f"nas-{choice.hardware}-{tname}"
    setup = _json({
        "target": target.name, "target_fingerprint": target.fingerprint().to_dict(),
        "supernet": str(Path(inp.checkpoint).resolve()), "supernet_step": inp.state.get("step"),
        "heldout": held.source, "heldout_last": inp.n_heldout, "trial_sequences": len(inp.trial_seqs),
        "hardware": choice.hardware, "profile": choice.describe(), "objective": asdict(obj_cfg),
        "space": inp.space.to_dict(),
    })
    sampler = cfg.sampler or ("nsga2" if cfg.pareto else "tpe")
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial otherwise; tqdm shows progress
    try:
        study, is_new = open_study(storage, study_name, obj_cfg.directions, setup, sampler, cfg.seed,
                                   obj_cfg.constrained)
    except SetupMismatch as err:
        if cfg.study_name:  # a name the user chose: mixing other inputs into it is refused
            raise
        # the default name and new inputs (a new supernet, another machine's profile): a study of their own,
        # named by their digest, so that a rerun with these inputs resumes it
        digest = hashlib.sha256(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:8]
        logger.warning("%s; without --study-name this run uses study '%s-%s'", err, study_name, digest)
        study_name = f"{study_name}-{digest}"
        study, is_new = open_study(storage, study_name, obj_cfg.directions, setup, sampler, cfg.seed,
                                   obj_cfg.constrained)
    n_trials = cfg.trials or int(inp.defaults["trials"])
    if is_new:
        labels = enqueue_starting_archs(study, inp.space, inp.supernet.entropy_layer)
        logger.info("new study '%s': first trials %s", study_name, ", ".join(labels))
        small = enqueue_small_space(study, inp.space, inp.supernet.entropy_layer, cfg.tree != "best",
                                    max(n_trials, EXHAUSTIVE_ARCHS), cfg.seed)
        if small:
            logger.info("the space holds %d archs: each is queued once (exhaustive search)", small)
    else:
        logger.info("continuing study '%s' (%d trials so far)", study_name, len(study.trials))

    if cfg.tree == "best":  # one sweep per (subnet, top_k) scores all its trees; kept on disk for other searches
        store = sweep_store(cfg, inp)
        source = SweepTau(inp.supernet, inp.trial_seqs, target.num_layers, max(inp.space.tree_depth),
                          store=store, store_key=sweep_key(inp, inp.trial_seqs))
    else:
        source = SupernetTau(inp.supernet, inp.trial_seqs, target.num_layers)
    tau = TauCache(source)
    seeded = tau.seed_from(study)  # finished trials of this study (earlier runs, other workers) cost nothing
    objective = SpeedupObjective(inp.space, inp.supernet.entropy_layer, TargetDims.of(target), latency, tau, obj_cfg)
    logger.info("searching %d trials on %s (%s profile %s), context %d, %d of %d held-out sequences%s", n_trials,
                choice.hardware, choice.how, choice.path, objective.context, len(inp.trial_seqs), len(held.sequences),
                f", {seeded} cached taus" if seeded else "")
    objective.seed_proposals(study)
    ran = run_trials(study, objective, n_trials, f"nas {choice.hardware}", until=inp.trials_end,
                     min_new=int(inp.defaults["min_trials"]))

    title = (f"{target.name} on {choice.hardware} ({'predicted' if latency.predicted else 'measured'} profile), "
             f"study {study_name}")
    df, table = write_report(study, out, title)
    done = finished(df)
    best = None
    if not done.empty:
        number = int(done.iloc[0]["number"])
        best = {**next(t for t in study.get_trials(deepcopy=False) if t.number == number).user_attrs, "number": number}
    rows, chosen, kinds_text = choose_kind(cfg, inp, done, source, latency, objective.context, choice.hardware)
    (out / "kinds.json").write_text(to_json(rows, chosen) + "\n")
    draft = command = bench = None
    if cfg.export:
        meta = {"predicted": {k: chosen.get(k) for k in ("tau", "tau_ci95", "speedup", "cycle_ms", "verify_tokens")},
                "kind": chosen["kind"], "kinds": rows, "hardware": choice.hardware, "runtime": cfg.runtime,
                "profile": {**choice.describe(), "how": choice.how}, "study": study_name,
                "trial": best["number"] if best and chosen.get("arch") == best.get("arch") else None,
                "storage": url, "supernet": setup["supernet"], "heldout": held.source,
                "heldout_approximate": held.approximate, "context": objective.context, "search": asdict(cfg)}
        draft = export_best(cfg, inp, chosen, meta, out)
        runtime = ["--runtime", cfg.runtime] if cfg.runtime != "eager" else []
        command = shlex.join(["python", "-m", "decode.run", "--target", target.name, "--draft", str(draft), "--prompt",
                              EXAMPLE_PROMPT, "--compare", *runtime])  # quoted: a path with spaces copy-pastes
        bench = shlex.join(["python", "-m", "decode.bench", "--target", target.name, "--drafts",
                            f"{draft},prompt-lookup,hf-compiled", "--prompts", "sharegpt:10,images:3",
                            *(["--exclude-data", held.directory] if held.directory else []),
                            "--max-new-tokens", "64", "--repeats", "2",
                            *(["--runtimes", f"eager,{cfg.runtime}"] if runtime else [])])
    complete = sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.get_trials(deepcopy=False))
    summary = {"config": asdict(cfg), "study": study_name, "storage": url, "setup": setup, "best": best,
               "draft": str(draft) if draft else None, "command": command, "bench_command": bench,
               "corpus": inp.corpus_path, "tau_cache_hits": tau.hits,
               "sweeps_loaded": getattr(source, "loaded", 0),
               "trials_complete": complete, "kinds": rows, "chosen": chosen}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return SearchResult(out, study_name, url, ran, complete, best or {}, draft, table, command, chosen, kinds_text,
                        bench)


def build_parser() -> argparse.ArgumentParser:
    from decode.targets.presets import preset_names

    p = argparse.ArgumentParser(prog="python -m nas.search", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SearchConfig()
    p.add_argument("--hardware", default=None, help="a100, h100, h200, l4, rtx4090, cpu (default: this device)")
    p.add_argument("--target", default=None, help=f"preset ({', '.join(preset_names())}) or HF model directory "
                                                  f"(default: the supernet's, else {DEFAULT_TARGET})")
    p.add_argument("--supernet", default=None, help="supernet checkpoint (default: the pipeline's, built if missing)")
    p.add_argument("--profile", default=None, help="latency profile JSON (default: stored, measured or predicted)")
    p.add_argument("--profile-dir", default=d.profile_dir, help=f"stored profiles (default: {d.profile_dir})")
    p.add_argument("--runtime", choices=RUNTIMES, default=d.runtime,
                   help="decoding runtime the draft is designed for: eager (default) or compiled (static cache, "
                        "padded trees, torch.compile); the search prices designs with that runtime's profile")
    p.add_argument("--space", default=None, help="search space YAML or name (default: the supernet's space)")
    p.add_argument("--trials", type=int, default=None,
                   help="new archs to score now; re-proposed archs are answered from the cache and not counted; "
                        "a rerun on the same --out continues its study and scores N more (the table then reads "
                        "them all) (default: the scale's: 10 at demo, 16 at cpu scale)")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: sqlite:///OUT/study.db)")
    p.add_argument("--study-name", default=None, help="study to create or continue (default: nas-<hardware>-<target>)")
    p.add_argument("--sampler", choices=SAMPLERS, default=None, help="default: tpe (nsga2 with --pareto)")
    p.add_argument("--out", default=None, help="output folder (default: out/nas-<hardware>-<target>)")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (default: 0)")
    p.add_argument("--heldout", type=int, default=None,
                   help="tau on the last N training sequences (default: the supernet's validation count, or 4)")
    p.add_argument("--heldout-data", default=None, help="feature data of held-out prompts for tau (preferred)")
    p.add_argument("--max-params", type=int, default=None, help="draft parameter budget (constraint)")
    p.add_argument("--max-memory-mb", type=float, default=None,
                   help="extra memory budget in MB: draft weights + its KV cache and cross memory (constraint)")
    p.add_argument("--pareto", action="store_true", help="second objective: fewer draft parameters (Pareto front)")
    p.add_argument("--tree", choices=TREE_MODES, default=d.tree,
                   help="best: the sampler picks the draft and top_k, and each arch gets the tree depth and "
                        "total_tokens with the best predicted speed-up on this hardware (default); sampled: the "
                        "sampler picks the tree too")
    p.add_argument("--sweep-cache", default=None, metavar="DIR",
                   help="where tree sweeps (acceptance of every tree of a subnet, hardware-independent) are kept "
                        "for later searches (default: tau-sweeps/ beside the supernet checkpoint; 'none': off)")
    p.add_argument("--context", type=int, default=None, help="context length of the prediction (default: profile's)")
    p.add_argument("--scale", default=d.scale,
                   help="pipeline scale in configs/scale (default: demo, whose run aims at 20 minutes: training gets "
                        "what the other stages leave of them)")
    p.add_argument("--finetune-steps", type=int, default=None,
                   help="fine-tune the best subnet alone for N sequences before choosing and exporting (its tau "
                        "is re-measured; default: the scale's, 300 at demo scale; 0: off)")
    p.add_argument("--finetune-minutes", type=float, default=None, metavar="M",
                   help="stop fine-tuning after M minutes of it even if steps remain; the learning-rate schedule "
                        "follows whichever runs out first (default: the scale's, 15 at cpu scale; 0: no limit)")
    p.add_argument("--finetune-data", default=None, metavar="DIR",
                   help="a supernet.data folder (e.g. the target's own answers: --mode regenerate) that fine-tuning "
                        "reads besides the supernet's training data (default: the scale's nas.finetune_data, built "
                        "by the pipeline when fine-tuning runs; none with --supernet)")
    p.add_argument("--trial-sequences", type=int, default=None, metavar="N",
                   help="trials score archs on the first N held-out sequences (image share kept); the contenders of "
                        "the final table are confirmed on all of them (default: the scale's, 6 at demo scale; 0: all)")
    p.add_argument("--corpus", default=None, metavar="FILE|DIR|none",
                   help="n-grams for corpus-lookup branches (decode/drafts/corpus.py): a corpus.safetensors or a "
                        "draft folder holding one (python -m decode.corpus); default: the pipeline's, counted from "
                        "every train-split ShareGPT answer and the target's own answers (none with --supernet); "
                        "'none': no corpus branches")
    p.add_argument("--no-export", action="store_true", help="do not export the best draft")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", help="float32|bfloat16|float16|auto")
    p.add_argument("--cache-dir", default=None, help="cache folder (default: $XDG_CACHE_HOME/vlm-draft-nas)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("-v", "--verbose", action="store_true", help="log details")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    logging.getLogger("nas").setLevel(logging.INFO)
    if args.threads < 0:
        raise UserError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = SearchConfig(
        hardware=args.hardware, target=args.target, supernet=args.supernet, profile=args.profile,
        profile_dir=args.profile_dir, space=args.space, trials=args.trials, storage=args.storage,
        study_name=args.study_name, sampler=args.sampler, out=args.out, seed=args.seed, heldout=args.heldout,
        heldout_data=args.heldout_data, max_params=args.max_params, max_memory_mb=args.max_memory_mb,
        pareto=args.pareto, tree=args.tree, sweep_cache=args.sweep_cache, context=args.context, scale=args.scale,
        finetune_steps=args.finetune_steps, finetune_minutes=args.finetune_minutes, finetune_data=args.finetune_data,
        trial_sequences=args.trial_sequences,
        runtime=args.runtime, corpus=args.corpus,
        export=not args.no_export, device=args.device, dtype=args.dtype, cache_dir=args.cache_dir)
    import nas

    res = run_search(cfg, started=nas.IMPORTED)  # the deadline counts the ~10 s of imports before main()
    print(f"study {res.study_name} ({res.storage}): {res.trials_run} trials run, {res.total_complete} finished in all")
    if not res.table.empty:
        print(res.table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"report: {res.out}/trials.csv, {res.out}/best.csv, {res.out}/trials.png")
    if res.kinds_text:
        print(res.kinds_text)
    if res.draft is not None:
        c = res.chosen
        print(f"exported {c['label']} (kind {c['kind']}, predicted speed-up {c['speedup']:.3f}x, "
              f"tau {c['tau']:.3f}) -> {res.draft}")
        print(res.command)
        print("measure it against vanilla, prompt lookup and compiled vanilla on held-out prompts this search "
              "never saw:")
        print(res.bench_command)
    return 0


if __name__ == "__main__":
    run_cli(main)
