"""The Optuna study: storage (SQLite by default, any RDB URL), sampler, resume checks, first trials.

Resuming: a study is identified by (storage, name). Rerunning with the same pair continues it: its
finished trials are kept (Optuna writes each one when it ends, so an interrupted search loses only
the trial in flight) and `--trials N` runs N more. Several processes may work on one study at once
(SQLite with a 60 s busy timeout; TPE's constant liar keeps them from sampling alike).

The study remembers what its values mean (`setup`: target, supernet, held-out data, hardware,
profile, objective settings, space) in a study user attribute; a rerun that would mix other values
into it is refused.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from datetime import datetime, timedelta
from pathlib import Path

import optuna
from sqlalchemy.exc import SQLAlchemyError

from decode.errors import UserError
from decode.space import SearchSpace
from nas.objective import constraints_func
from nas.suggest import arch_to_params, every_arch, starting_archs

logger = logging.getLogger(__name__)

SAMPLERS = ("tpe", "nsga2", "random")
SETUP_ATTR = "setup"


def sqlite_url(path: str | Path) -> str:
    return f"sqlite:///{Path(path).resolve()}"


HEARTBEAT_S = 10  # a running trial records a heartbeat this often ...
GRACE_S = int(os.environ.get("VLM_DRAFT_NAS_GRACE_S", "60"))  # ... and is a dead worker's after this long without


class HeartbeatStorage(optuna.storages.RDBStorage):
    """RDBStorage whose stale trials also include those killed before their first heartbeat.

    Optuna creates a trial RUNNING, then starts the thread that records its heartbeats: a worker killed
    in between leaves a RUNNING trial with no heartbeat, which Optuna never fails (it only compares
    recorded heartbeats). Such a trial older than the grace period is a dead worker's too.
    """

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        stale = super()._get_stale_trial_ids(study_id)
        try:  # Optuna internals (the heartbeat table); an Optuna that moved them only loses this extra rule
            from optuna.storages._rdb import models
            from optuna.storages._rdb.storage import _create_scoped_session
        except ImportError:
            return stale
        cutoff = datetime.now() - timedelta(seconds=self.grace_period or 2 * (self.heartbeat_interval or 0))
        old = [t._trial_id for t in self.get_all_trials(study_id, deepcopy=False,
                                                          states=(optuna.trial.TrialState.RUNNING,))
               if t.datetime_start is not None and t.datetime_start < cutoff and t._trial_id not in stale]
        with _create_scoped_session(self.scoped_session) as session:
            silent = [i for i in old if models.TrialHeartbeatModel.where_trial_id(i, session) is None]
        return stale + silent


def open_storage(url: str, retries: int = 3) -> optuna.storages.RDBStorage:
    """An RDBStorage for `url`; UserError (one line) when it cannot be opened.

    SQLite gets a 60 s busy timeout so that concurrent workers wait for each other's writes instead of
    failing with "database is locked"; table creation is retried (two fresh workers may race on it).
    Running trials send heartbeats: a trial whose worker was killed is marked FAIL by the next worker
    (at the start of its next trial, after GRACE_S without a heartbeat) and its arch is queued again once
    (RetryHeartbeatStaleTrialCallback), so a killed search loses nothing but the trial in flight; a trial
    killed before its first heartbeat is failed too once GRACE_S old (HeartbeatStorage).
    """
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    if url.startswith("sqlite:///"):
        parent = Path(url.removeprefix("sqlite:///")).parent
        if not parent.is_dir():
            raise UserError(f"cannot open storage '{url}': folder {parent} does not exist")
    for attempt in range(retries):
        try:
            with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna 5: no warning per run
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return HeartbeatStorage(
                    url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
        except SQLAlchemyError as err:
            msg = str(err).lower()
            racing = ("locked", "already exists", "unique constraint")  # two fresh workers creating the tables
            if attempt + 1 < retries and any(m in msg for m in racing):
                time.sleep(0.5 * (attempt + 1))
                continue
            raise UserError(f"cannot open storage '{url}': {str(err).splitlines()[0]}") from None
        except (ValueError, ImportError, ModuleNotFoundError) as err:  # bad URL scheme, missing DB driver
            raise UserError(f"cannot open storage '{url}': {str(err).splitlines()[0]}; "
                            "give an Optuna RDB URL such as sqlite:///path/study.db") from None
    raise AssertionError("unreachable")


def make_sampler(name: str, seed: int | None, constrained: bool) -> optuna.samplers.BaseSampler:
    cons = constraints_func if constrained else None
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, constraints_func=cons, n_startup_trials=8)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, constraints_func=cons, population_size=16)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)  # budgets are still recorded and respected at the end
    raise UserError(f"unknown sampler '{name}'; use one of: {', '.join(SAMPLERS)}")


class SetupMismatch(UserError):
    """A stored study was run with other inputs than this run's (target, supernet, profile, objective, ...)."""


def open_study(storage: optuna.storages.BaseStorage, name: str, directions: list[str], setup: dict, sampler_name: str,
               seed: int, constrained: bool) -> tuple[optuna.Study, bool]:
    """Create or load the study; -> (study, is_new). The sampler seed is offset by the trials already there,
    so a resumed run (or a second worker joining later) does not replay the first run's random draws."""
    existing = {s.study_name: s for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    n_before = existing[name].n_trials if name in existing else 0
    sampler = make_sampler(sampler_name, seed + n_before, constrained)
    try:
        study = optuna.create_study(storage=storage, study_name=name, directions=directions, sampler=sampler,
                                    load_if_exists=True)
    except ValueError as err:  # e.g. an existing study with other directions
        raise UserError(f"study '{name}': {err}") from None
    if [d.name.lower() for d in study.directions] != directions:
        raise UserError(f"study '{name}' optimises {[d.name.lower() for d in study.directions]}, not {directions} "
                        "(--pareto changed?); use another --study-name")
    old = study.user_attrs.get(SETUP_ATTR)
    if old is None:
        study.set_user_attr(SETUP_ATTR, setup)
    elif old != setup:
        diff = ", ".join(f"{k}: stored {json.dumps(old.get(k))} vs now {json.dumps(setup.get(k))}"
                         for k in sorted(set(old) | set(setup)) if old.get(k) != setup.get(k))
        raise SetupMismatch(f"study '{name}' was run with other settings ({diff}); use another --study-name or the "
                            "same inputs")
    return study, not study.trials


def enqueue_starting_archs(study: optuna.Study, space: SearchSpace, entropy_layer: int | None) -> list[str]:
    """Queue the EAGLE-like default, the largest and the smallest arch as the first trials; -> labels."""
    labels = []
    for label, arch in starting_archs(space, entropy_layer):
        study.enqueue_trial(arch_to_params(arch, space, entropy_layer), user_attrs={"start": label},
                            skip_if_exists=True)
        labels.append(label)
    return labels


def enqueue_small_space(study: optuna.Study, space: SearchSpace, entropy_layer: int | None, tree: bool,
                        limit: int, seed: int) -> int:
    """A space of at most `limit` archs is searched exhaustively: every arch queued once, in a seeded random
    order (sampling without replacement: no trial spent on a re-proposal); -> archs queued (0: too many)."""
    import random

    every = every_arch(space, entropy_layer, tree, limit)
    if every is None:
        return 0
    random.Random(seed).shuffle(every)
    for params in every:
        study.enqueue_trial(params, skip_if_exists=True)  # the starting archs are queued already
    return len(every)
