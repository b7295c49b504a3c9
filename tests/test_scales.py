"""Run scales (configs/scale): every file parses into valid data/train settings; the cpu and full recipes run
on a tiny target (full: a few hundred steps, so the GPU recipe cannot rot unseen); a killed cpu-scale training
resumes losing at most one checkpoint interval, and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
from conftest import single_thread, tiny_target
from safetensors.torch import load_file

from configs import config_dir
from decode.datasets import PromptItem
from decode.errors import UserError
from decode.space import SearchSpace
from supernet import checkpoint as ckpt
from supernet.data import DataConfig, build_data
from supernet.train import (
    TrainConfig,
    build_parser,
    config_from_args,
    scale_defaults,
    scale_space,
    train,
)

TARGET = "tiny-llava"
SCALES = sorted(p.stem for p in config_dir("scale").glob("*.yaml"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("scales") / "data"
    with single_thread():
        build_data(DataConfig(target=TARGET, prompts="sharegpt:8,images:1", space="tiny", max_len=96, topk=16,
                              image_answer_tokens=8, shard_size=4, max_prompt_chars=130, out=str(out)),
                   target=tiny_target(TARGET))
    return out


@pytest.mark.parametrize("scale", SCALES)
def test_scale_files_give_valid_settings(scale, tmp_path):
    assert {"cpu", "demo", "full", "smoke"} <= set(SCALES)
    data = scale_defaults(scale, "data")
    known = {f.name for f in fields(DataConfig)}
    assert set(data) <= known, set(data) - known  # no key is silently ignored
    DataConfig(**data).check()
    train_keys = set(scale_defaults(scale, "train"))
    assert train_keys <= {f.name for f in fields(TrainConfig)}, train_keys
    cfg = config_from_args(build_parser().parse_args(["--data", str(tmp_path), "--scale", scale]))
    assert cfg.scale == scale and cfg.loss in ("topk", "full")
    from nas.pipeline import NAS_DEFAULTS, nas_defaults

    nas_keys = set(scale_defaults(scale, "nas"))
    assert nas_keys <= set(NAS_DEFAULTS), nas_keys - set(NAS_DEFAULTS)  # no key is silently ignored
    own = nas_defaults(scale)["finetune_data"]  # the fine-tuning data (the target's own answers), where a scale has it
    if own is not None:
        assert set(own) <= known, set(own) - known
        DataConfig(**{**data, **own}).check()
    SearchSpace.load(cfg.space)  # the scale's space exists
    assert scale_space(scale, "tiny-llava") == "tiny"  # tiny targets keep the tiny space whatever the scale


def test_the_demo_and_cpu_scales_train_the_compact_space_everywhere():
    """supernet.train, supernet.data and the nas.search pipeline agree on the scale's space (compact at demo and
    cpu scale, default at full scale), and the pipeline retrains a cached supernet of another space instead of reusing it."""
    from nas.pipeline import PipelineConfig

    assert scale_space("demo", "smolvlm-135m") == "compact" == scale_space("cpu", "smolvlm-135m")
    assert scale_space("full", "smolvlm-135m") == "default"
    assert PipelineConfig(scale="demo").space_name == "compact"
    assert config_from_args(build_parser().parse_args(["--data", "d", "--scale", "demo"])).space == "compact"
    assert config_from_args(build_parser().parse_args(["--data", "d", "--scale", "demo", "--space", "eagle"])).space \
        == "eagle"
    assert config_from_args(build_parser().parse_args(["--data", "d", "--cache-dir", "/c"])).cache_dir == "/c"
    assert config_from_args(build_parser().parse_args(["--data", "d"])).cache_dir is None
    compact, default = SearchSpace.load("compact"), SearchSpace.load("default")
    assert compact.feature_layers == default.feature_layers  # the same stored layers: demo data stays valid


def test_full_recipe_runs_a_few_hundred_steps_on_a_tiny_target(data_dir, tmp_path):
    args = build_parser().parse_args(["--target", TARGET, "--data", str(data_dir), "--space", "tiny", "--scale", "full",
                                      "--steps", "200", "--warmup", "20", "--reorder-at", "50", "--ckpt-every", "100",
                                      "--seqs-per-step", "1", "--val-sequences", "1", "--out", str(tmp_path / "full"),
                                      "--no-answer-only"])
    cfg = config_from_args(args)
    assert cfg.unroll == 4 and cfg.negatives == 4096 and cfg.loss == "topk"  # the full recipe's own settings
    assert cfg.loss_config().feat_weight == 1.0 and cfg.loss_config().decay == cfg.unroll_decay
    with single_thread():
        ck = train(cfg)
    state = json.loads((ck / ckpt.STATE).read_text())
    assert state["step"] == 200
    rows = list(csv.DictReader(open(tmp_path / "full" / "train_log.csv")))
    first = [float(r["loss"]) for r in rows[:40] if r["role"] == "largest"]
    last = [float(r["loss"]) for r in rows[-40:] if r["role"] == "largest"]
    assert sum(last) / len(last) < 0.95 * sum(first) / len(first)  # it learns (lr 3e-4: slowly on a tiny target)
    assert all(int(r["positions"]) > 0 for r in rows)  # no wasted step
    assert all(torch.isfinite(t).all() for t in load_file(str(ck / ckpt.MODEL)).values())


def _cli(data_dir, out, *extra) -> list[str]:
    return [sys.executable, "-m", "supernet.train", "--target", TARGET, "--data", str(data_dir), "--space", "tiny",
            "--scale", "cpu", "--steps", "60", "--ckpt-every", "5", "--threads", "1", "--device", "cpu",
            "--no-answer-only", "--val-sequences", "1", "--time-budget-s", "0", "--out", str(out), *extra]
    # no time budget: with one (the cpu scale's 50 min) the LR schedule follows the clock and runs are not bit-equal


def test_cpu_scale_resumes_after_a_kill(data_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight = subprocess.run(_cli(data_dir, tmp_path / "straight"), capture_output=True, text=True, env=env,
                              timeout=600)
    assert straight.returncode == 0, straight.stderr[-2000:]
    out = tmp_path / "killed"
    proc = subprocess.Popen(_cli(data_dir, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    state_file = out / "checkpoint" / ckpt.STATE
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if state_file.is_file() and json.loads(state_file.read_text() or "{}").get("step", 0) >= 10:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "training ended before it could be killed; raise --steps"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = json.loads(state_file.read_text())["step"]
    logged = {int(r["step"]) for r in csv.DictReader(open(out / "train_log.csv"))}
    assert max(logged) + 1 - saved <= 5  # lost work: at most one checkpoint interval
    resumed = subprocess.run(_cli(data_dir, out, "--resume"), capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = load_file(str(tmp_path / "straight" / "checkpoint" / ckpt.MODEL))
    b = load_file(str(out / "checkpoint" / ckpt.MODEL))
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit-identical to the run that was never killed
    rows_a = list(csv.DictReader(open(tmp_path / "straight" / "train_log.csv")))
    rows_b = list(csv.DictReader(open(out / "train_log.csv")))
    assert [(r["step"], r["role"], r["loss"]) for r in rows_a] == [(r["step"], r["role"], r["loss"]) for r in rows_b]


def test_supernet_data_at_smoke_scale_takes_the_scale_and_the_tiny_space(tmp_path):
    """No --space on a tiny target (the tiny space is picked, as hwprofile and nas.search do) and the scale's
    prompt-length, answer-length and shard-size settings reach the manifest; every sequence has an answer."""
    import yaml

    from configs import config_dir
    from supernet.data import main as data_main
    from supernet.dataset import read_manifest

    smoke = yaml.safe_load((config_dir("scale") / "smoke.yaml").read_text())["data"]
    out = tmp_path / "d"
    assert data_main(["--target", "tiny-llava", "--scale", "smoke", "--prompts", "sharegpt:4", "--out", str(out),
                      "--device", "cpu", "--threads", "1"]) == 0
    m = read_manifest(out)
    for key in ("max_prompt_chars", "max_new_tokens", "shard_size", "max_len", "mode"):
        assert m["config"][key] == smoke[key], key
    assert m["config"]["space"] == "tiny"
    assert m["counts"]["sequences"] == 4
    from supernet.dataset import FeatureData

    assert all(n > 0 for n in FeatureData(out).scored_positions(True))  # no sequence without an answer position


def test_library_configs_default_to_the_targets_own_space():
    """DataConfig / TrainConfig built in code (not through the CLIs) get the space the CLIs would pick,
    and it is a concrete name by the time it is written into a manifest or a checkpoint."""
    assert DataConfig(target="tiny-llava").space == "tiny"
    assert DataConfig(target="smolvlm-135m").space == "default"
    assert TrainConfig(target="tiny-llava", data="d", out="o").space == "tiny"
    assert TrainConfig(target="smolvlm-135m", data="d", out="o", space="eagle").space == "eagle"


def test_pipeline_retrains_a_cached_supernet_of_another_space(tmp_path, monkeypatch):
    import supernet.train as train_mod
    from nas.pipeline import PipelineConfig, supernet_stage

    cfg = PipelineConfig(target="tiny-llava", scale="smoke", root=str(tmp_path))
    ck = tmp_path / "supernet" / "checkpoint"
    ck.mkdir(parents=True)
    calls = []
    monkeypatch.setattr(train_mod, "train", lambda c: calls.append(c) or ck)
    supernet_stage(cfg, tmp_path / "data")  # nothing cached: trains, and shows the scale's config
    recipe = dataclasses.asdict(calls.pop())
    state = {"step": 10**6, "space": SearchSpace.load("tiny").to_dict(), "config": recipe}
    (ck / ckpt.STATE).write_text(json.dumps(state))
    assert supernet_stage(cfg, tmp_path / "data") == ck and not calls  # its own space, trained: reused
    (ck / ckpt.STATE).write_text(json.dumps({**state, "step": 3, "budget_spent": True}))
    assert supernet_stage(cfg, tmp_path / "data") == ck and not calls  # stopped by its time budget: finished too
    (ck / ckpt.STATE).write_text(json.dumps({**state, "step": 3}))
    supernet_stage(cfg, tmp_path / "data")
    assert len(calls) == 1 and calls.pop().resume  # short of its steps and of its budget: resumed
    other_trees = {**state["space"], "tree_depth": [2, 3], "total_tokens": [4]}  # e.g. saved before depth 1 joined
    (ck / ckpt.STATE).write_text(json.dumps({**state, "space": other_trees}))
    assert supernet_stage(cfg, tmp_path / "data") == ck and not calls  # trees are not weights: reused
    (ck / ckpt.STATE).write_text(json.dumps({**state, "space": SearchSpace.load("default").to_dict()}))
    supernet_stage(cfg, tmp_path / "data")
    assert len(calls) == 1 and calls[0].space == "tiny" and not calls[0].resume  # trained anew, not resumed


def test_the_pipeline_deadline_shortens_training_to_what_the_other_stages_left(tmp_path, monkeypatch):
    """nas.pipeline.Deadline: training gets the deadline minus the time gone and the stages after it (all of it, also
    past the scale's own budget, which only claims its part against the data), at least the floor; a resumed run's
    training so far counts towards it; supernet_stage trains with that budget."""
    import time

    import supernet.train as train_mod
    from nas.pipeline import Deadline, PipelineConfig, supernet_stage

    now = time.perf_counter()
    assert Deadline().training_budget(270) == 270 and Deadline().training_budget(0) == 0  # no deadline
    d = Deadline(total_s=1200, after_s=280, start=now - 780)  # 13 minutes gone, 4:40 set aside: 140 s left
    assert 130 < d.training_budget(270) <= 140
    assert 130 < d.training_budget(0) <= 140  # no budget of the scale's own: the deadline's
    assert 130 < d.training_budget(100) <= 140  # more than the scale's own where the deadline leaves more
    assert 230 < d.training_budget(270, trained_s=100) <= 240  # resumed after 100 s of training
    assert Deadline(1200, 280, now - 1190).training_budget(270) == 60  # past the deadline: the floor
    cfg = PipelineConfig(target="tiny-llava", scale="smoke", root=str(tmp_path))
    calls = []
    monkeypatch.setattr(train_mod, "train", lambda c: calls.append(c) or tmp_path)
    supernet_stage(cfg, tmp_path / "data")
    assert calls.pop().time_budget_s == scale_defaults("smoke", "train").get("time_budget_s", 0)  # no deadline
    supernet_stage(cfg, tmp_path / "data", d)
    assert 130 < calls.pop().time_budget_s <= 140
    supernet_stage(PipelineConfig(target="tiny-llava", scale="smoke", root=str(tmp_path), cache_dir="/c"), tmp_path)
    assert calls.pop().cache_dir == "/c"  # the target is loaded from the run's cache, not the default one


def test_the_deadline_paces_the_time_set_aside_after_training_by_the_heldout_stage(tmp_path):
    """Deadline.paced: a machine that builds the held-out data faster than the reference machine (where after_s and
    confirm_s were measured) sets aside proportionally less for the stages after training, never under 0.7 and never
    more than measured; too little timed work, no reference or no deadline leave the pace at 1. built_tokens counts the
    complete shards of a data folder's manifest (read by supernet.dataset.read_manifest)."""
    import time

    from nas.pipeline import Deadline, built_tokens

    now = time.perf_counter()
    d = Deadline(total_s=1200, after_s=300, start=now - 600)  # 600 s gone, 300 set aside: 300 s left
    fast = d.paced(tokens=36000, seconds=320, reference_tokens_per_s=90)  # 112.5 tokens/s against 90
    assert abs(fast.pace - 0.8) < 1e-9 and abs(fast.reserved() - 240) < 1e-6
    assert 355 < fast.left() <= 360 and 355 < fast.training_budget(270) <= 360  # training takes the 60 s freed
    assert abs(fast.trials_end(150) - (d.start + 1200 - 120)) < 1e-6  # the confirmation's reserve at the same pace
    assert d.paced(36000, 600, 90).pace == 1.0  # slower than the reference: the reserve stays as measured
    assert d.paced(36000, 60, 90).pace == Deadline.MIN_PACE == 0.7  # never under 0.7
    assert d.paced(1000, 1, 90) is d and d.paced(36000, 240, 0) is d  # too little work to time; no reference
    assert Deadline().paced(36000, 240, 90).pace == 1.0 and Deadline().training_budget(270) == 270  # no deadline
    assert built_tokens(tmp_path / "none") == 0
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": [{"tokens": 300, "complete": True},
                                                                   {"tokens": 50, "complete": False},
                                                                   {"tokens": 20, "complete": True}]}))
    assert built_tokens(tmp_path) == 320
    (tmp_path / "manifest.json").write_text("[1, 2")
    with pytest.raises(UserError, match="delete the directory"):  # supernet.dataset.read_manifest's one-line error
        built_tokens(tmp_path)


def test_the_search_paces_its_deadline_by_the_heldout_stage_it_built(tmp_path, monkeypatch):
    """nas.search's pipeline times the held-out stage it builds (the tokens of the shards built in this run) and hands
    the paced deadline to the data and training stages; a reused held-out stage leaves the pace at 1."""
    from nas import pipeline, search

    seen = []
    clock = iter(float(x) for x in range(0, 10**6, 120))  # every perf_counter() call 120 s later

    def heldout(cfg, target):
        out = cfg.run_dir / "heldout"
        out.mkdir(parents=True, exist_ok=True)
        (out / "manifest.json").write_text(json.dumps({"shards": [{"tokens": 20000, "complete": True}]}))
        return out

    class Stop(Exception):
        pass

    def data_stage(cfg, target, deadline):
        seen.append(deadline)
        raise Stop

    monkeypatch.setattr(search.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(pipeline, "begin", lambda cfg: None)
    monkeypatch.setattr(pipeline, "heldout_stage", heldout)
    monkeypatch.setattr(pipeline, "answers_stage", lambda cfg, target: None)
    monkeypatch.setattr(pipeline, "profile_stage", lambda *a, **k: None)
    monkeypatch.setattr(pipeline, "data_stage", data_stage)
    monkeypatch.setattr(pipeline, "nas_defaults", lambda scale: {**pipeline.NAS_DEFAULTS, "deadline_s": 1200,
                                                                 "after_training_s": 300, "pace_tokens_per_s": 125})
    import decode.targets.loader as loader

    monkeypatch.setattr(loader, "load_target", lambda *a, **k: SimpleNamespace(name="t"))
    cfg = search.SearchConfig(target="tiny-llama", scale="demo", profile="p.json", corpus="none",
                              cache_dir=str(tmp_path))
    with pytest.raises(Stop):
        search.prepare_inputs(cfg, started=0.0)
    # 20000 tokens in 120 s (167 tokens/s) against 125: pace 0.75, 225 s set aside instead of 300
    assert abs(seen[-1].pace - 0.75) < 1e-9 and abs(seen[-1].reserved() - 225) < 1e-6
    with pytest.raises(Stop):
        search.prepare_inputs(cfg, started=0.0)  # the held-out data reused: nothing built, nothing timed
    assert seen[-1].pace == 1.0


def test_training_loads_the_target_from_the_cache_it_is_given(tmp_path, monkeypatch):
    """supernet.train with cache_dir (nas.search --cache-dir through the pipeline) loads the target from there, not
    from the default cache (where it would prepare a second copy)."""
    from pathlib import Path

    import supernet.train as train_mod

    seen = {}

    def loader(name, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("loaded")

    monkeypatch.setattr(train_mod, "load_target", loader)
    with pytest.raises(RuntimeError, match="loaded"):
        train_mod.train(train_mod.TrainConfig(target="t", data=str(tmp_path), out=str(tmp_path / "o"), cache_dir="/c"))
    assert seen["cache_dir"] == Path("/c")


def test_the_deadline_shares_what_is_left_between_data_and_training(tmp_path, monkeypatch):
    """Deadline.data_budget: what the scale's own training budget leaves of the time the deadline leaves once the
    stages after training are set aside, at least the data's share (no deadline: no budget, every prompt); data_stage
    builds with it and with the run's one entropy layer, and training then gets what the data left."""
    import time

    from nas import pipeline
    from supernet import data as data_mod

    now = time.perf_counter()
    assert pipeline.Deadline().data_budget() == 0  # no deadline
    d = pipeline.Deadline(total_s=1200, after_s=280, start=now - 520, data_share=0.5)  # 400 s left: 200 s to data
    assert 195 < d.data_budget() <= 200
    assert 195 < d.data_budget(270) <= 200  # training's own 270 s would leave the data less than its share
    early = pipeline.Deadline(total_s=1200, after_s=280, start=now - 220, data_share=0.25)  # 700 s left
    assert 425 < early.data_budget(270) <= 430  # training's 270 s first, the rest to the data
    assert 170 < early.data_budget() <= 175  # no training budget of the scale's own: the data's share
    assert pipeline.Deadline(1200, 280, now - 1190).data_budget() == 60  # past the deadline: the floor
    cfg = pipeline.PipelineConfig(target="tiny-llava", scale="smoke", root=str(tmp_path))
    built = []
    monkeypatch.setattr(pipeline, "entropy_layer", lambda cfg, target: 2)
    monkeypatch.setattr(data_mod, "build_data", lambda c, target=None: built.append(c) or tmp_path / "data")
    pipeline.data_stage(cfg, None, d)
    assert 195 < built[-1].time_budget_s <= 200 and built[-1].entropy_layer == 2 and built[-1].split == "train"
    pipeline.data_stage(cfg, None)
    assert built[-1].time_budget_s == 0  # no deadline: every prompt


def test_the_runs_entropy_layer_is_the_training_datas_else_the_heldout_datas_else_calibrated(tmp_path, monkeypatch):
    """The held-out stage now runs before the data stage: both take one entropy layer, the training data's where a
    cache has it, else the held-out data's, else calibrated on the training prompts (what supernet.data does)."""
    from nas import pipeline
    from supernet import data as data_mod

    cfg = pipeline.PipelineConfig(target="tiny-llava", scale="smoke", root=str(tmp_path))
    calls = []
    monkeypatch.setattr(data_mod, "load_prompts", lambda c, is_vlm, name: calls.append(c) or ["p"])
    monkeypatch.setattr(data_mod, "calibrate_entropy", lambda target, items, c: SimpleNamespace(layer=3))
    target = SimpleNamespace(is_vlm=True, name="tiny-llava")
    assert pipeline.entropy_layer(cfg, target) == 3 and calls[0].split == "train"
    for folder, layer in (("heldout", 1), ("data", 2)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "manifest.json").write_text(json.dumps({"complete": False, "entropy": {"layer": layer}}))
        assert pipeline.entropy_layer(cfg, target) == layer
    assert len(calls) == 1


def test_pipeline_retrains_a_cached_supernet_of_another_recipe(tmp_path, monkeypatch):
    """A checkpoint trained before the scale's recipe changed (here: feat_weight, and an older config without
    the field at all, which ran the default) is trained anew; run-only fields (threads, steps) do not count."""
    import supernet.train as train_mod
    from nas.pipeline import PipelineConfig, supernet_stage
    from supernet.train import TrainConfig, recipe_changes

    cfg = PipelineConfig(target="tiny-llava", scale="smoke", root=str(tmp_path))
    ck = tmp_path / "supernet" / "checkpoint"
    calls = []
    monkeypatch.setattr(train_mod, "train", lambda c: calls.append(c) or ck)
    supernet_stage(cfg, tmp_path / "data")
    scale_cfg = calls.pop()
    recipe = dataclasses.asdict(scale_cfg)
    ck.mkdir(parents=True)
    state = {"step": 10**6, "space": SearchSpace.load("tiny").to_dict()}
    for saved, retrained in [({**recipe, "threads": 7, "steps": 10**6, "out": "elsewhere"}, False),
                             ({**recipe, "feat_weight": scale_cfg.feat_weight + 0.5}, True),
                             ({k: v for k, v in recipe.items() if k != "feat_weight"}, scale_cfg.feat_weight != 0.2)]:
        ck.mkdir(parents=True, exist_ok=True)
        (ck / ckpt.STATE).write_text(json.dumps({**state, "config": saved}))
        supernet_stage(cfg, tmp_path / "data")
        assert bool(calls) == retrained and not (calls and calls[0].resume), saved
        calls.clear()
    assert TrainConfig.__dataclass_fields__["feat_weight"].default == 0.2  # what configs saved before it ran
    assert recipe_changes({"lr": 0.5}, scale_cfg)[0].startswith("lr 0.5 -> ")


def test_pipeline_rebuilds_a_cached_data_folder_made_with_other_prompts(tmp_path):
    """Other prompts: built again, the folder kept (supernet.data keeps the shards whose prompts stay); other
    settings: the folder removed."""
    from nas.pipeline import _complete

    out = tmp_path / "heldout"
    out.mkdir()
    cfg = DataConfig(target="tiny-llava", prompts="sharegpt:12", out=str(out))
    (out / "manifest.json").write_text(json.dumps({"complete": True, "config": {"prompts": "sharegpt:12"}}))
    assert _complete(out, cfg) and out.is_dir()
    (out / "manifest.json").write_text(json.dumps({"complete": True, "config": {"prompts": "sharegpt:8"}}))
    assert not _complete(out, cfg) and out.is_dir()  # the stage builds it again, over the shards that stay
    (out / "manifest.json").write_text(json.dumps({"complete": True, "config": {"prompts": "sharegpt:8",
                                                                                "mode": "regenerate"}}))
    assert not _complete(out, cfg) and not out.exists()  # removed: the stage builds it anew


def test_pipeline_builds_the_scales_own_answer_data_once(data_dir, tmp_path, monkeypatch):
    """A scale with nas.finetune_data gets a finetune-data/ folder of the target's own answers to train-split prompts
    (the training data's entropy layer), reused on the next run; a scale without one gets none."""
    import shutil

    from nas import pipeline

    target = tiny_target(TARGET)
    cfg = pipeline.PipelineConfig(target=TARGET, scale="smoke", root=str(tmp_path / "run"), device="cpu",
                                  dtype="float32")
    shutil.copytree(data_dir, tmp_path / "run" / "data")
    assert pipeline.finetune_data_stage(cfg, target) is None  # smoke: no own-answer data
    real = pipeline.nas_defaults
    monkeypatch.setattr(pipeline, "nas_defaults",
                        lambda scale: {**real(scale), "finetune_data": {"prompts": "sharegpt:2", "max_new_tokens": 8}})
    with single_thread():
        out = pipeline.finetune_data_stage(cfg, target)
    manifest = json.loads((out / "manifest.json").read_text())
    assert out == tmp_path / "run" / "finetune-data" and manifest["complete"]
    assert manifest["config"]["mode"] == "regenerate" and manifest["config"]["split"] == "train"
    assert manifest["entropy"]["layer"] == json.loads((data_dir / "manifest.json").read_text())["entropy"]["layer"]
    stamp = (out / "manifest.json").stat().st_mtime_ns
    assert pipeline.finetune_data_stage(cfg, target) == out and (out / "manifest.json").stat().st_mtime_ns == stamp


def test_the_heldout_stage_leaves_room_for_every_answer(tmp_path, monkeypatch):
    """The held-out stage's data keeps max_new_tokens of room after each prompt (min_answer): a chat prompt whose
    history outgrows max_len keeps its tail instead of filling max_len and dropping out of the replay for want of an
    answer; a cached folder made with another min_answer is built again."""
    from nas import pipeline
    from nas.pipeline import PipelineConfig, _complete, heldout_stage
    from supernet import data as data_mod

    built = []
    monkeypatch.setattr(pipeline, "entropy_layer", lambda cfg, target: 1)
    monkeypatch.setattr(data_mod, "build_data", lambda c, target=None: built.append(c) or tmp_path / "heldout")
    defaults = pipeline.nas_defaults("smoke")
    monkeypatch.setattr(pipeline, "nas_defaults", lambda scale: {
        **defaults, "heldout_data": {**defaults["heldout_data"], "prompts": "chat:2", "max_new_tokens": 24}})
    heldout_stage(PipelineConfig(target="tiny-llama", scale="smoke", root=str(tmp_path)), tiny_target("tiny-llama"))
    cfg = built.pop()
    assert cfg.min_answer == cfg.max_new_tokens == 24 and cfg.split == "heldout"
    long = PromptItem("chat:x_0:1", "And then?", None, None, history=(("word " * 300, "reply " * 300),))
    prompt = data_mod.build_prompt(tiny_target("tiny-llama"), long, cfg)
    assert prompt.length == cfg.max_len - 24 and data_mod.answer_budget(prompt, long, cfg) == 24

    out = tmp_path / "old"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"complete": True, "config": {
        "prompts": cfg.prompts, "mode": cfg.mode, "max_len": cfg.max_len, "max_new_tokens": 24, "min_answer": 0}}))
    assert not _complete(out, dataclasses.replace(cfg, out=str(out))) and not out.exists()
