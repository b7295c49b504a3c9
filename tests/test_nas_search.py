"""nas.search / nas.export on a tiny target with a briefly trained tiny supernet and a quick CPU profile."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import optuna
import pytest
import torch
from conftest import single_thread, tiny_prompt, tiny_target

import nas.search as search_mod
from decode.arch import DraftArch
from decode.drafts import make_draft
from decode.errors import UserError
from decode.loop.speculative import speculative_generate
from decode.loop.vanilla import vanilla_generate
from hwprofile.config import ProfileConfig
from hwprofile.measure import measure_profile
from nas.cost import draft_params
from nas.export import main as export_main
from nas.loading import load_supernet
from nas.search import SearchConfig, run_search
from supernet.data import DataConfig, build_data
from supernet.train import TrainConfig, train

TARGET = "tiny-llava"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Regenerated data of short prompts, a supernet trained 30 steps, a quick measured CPU profile."""
    root = tmp_path_factory.mktemp("nas")
    target = tiny_target(TARGET)
    with single_thread():
        # short prompts (the tiny tokenizer spends ~1 token per character) so that answers fit max_len
        build_data(DataConfig(target=TARGET, prompts="sharegpt:6", space="tiny", mode="regenerate", max_len=160,
                              max_new_tokens=24, max_prompt_chars=130, topk=16, out=str(root / "data")), target=target)
        train(TrainConfig(target=TARGET, data=str(root / "data"), out=str(root / "sn"), space="tiny", steps=30,
                          lr=3e-3, warmup=3, unroll=2, n_random=1, ckpt_every=30, reorder_at=10, val_sequences=2,
                          device="cpu", dtype="float32"))
        profile = measure_profile(ProfileConfig(target=TARGET, space="tiny", quick=True, plot=False), target=target,
                                  progress=False)
    path = profile.save(root / "profiles" / "cpu-tiny-llava.json")
    return {"root": root, "supernet": str(root / "sn" / "checkpoint"), "profile": str(path)}


def _cfg(assets, out, **kw) -> SearchConfig:
    base = dict(target=TARGET, supernet=assets["supernet"], profile=assets["profile"], out=str(out), trials=2,
                heldout=2, device="cpu", dtype="float32", study_name="s")
    return SearchConfig(**{**base, **kw})


def _complete(storage: str, name: str) -> list[int]:
    study = optuna.load_study(study_name=name, storage=storage)
    return sorted(t.number for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE)


def test_study_runs_resumes_and_exports(assets, tmp_path):
    res = run_search(_cfg(assets, tmp_path / "run"))
    assert res.trials_run == 2 and res.total_complete == 2
    study = optuna.load_study(study_name="s", storage=res.storage)
    first = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert [t.user_attrs.get("start") for t in study.trials] == ["eagle-like", "largest", "smallest"]  # enqueued
    assert study.trials[2].state == optuna.trial.TrialState.WAITING  # the third waits for the next run
    for t in first:
        a = t.user_attrs
        assert a["tau"] >= 1.0 and a["cycle_ms"] > 0 and a["params"] > 0 and a["feasible"]
        assert a["speedup"] == pytest.approx(a["tau"] * a["target_step_ms"] / a["cycle_ms"])
    # the same storage and name again: 2 more trials, nothing lost, the third queued arch comes next
    res2 = run_search(_cfg(assets, tmp_path / "run"))
    assert _complete(res2.storage, "s") == [0, 1, 2, 3]
    assert optuna.load_study(study_name="s", storage=res.storage).trials[2].user_attrs["start"] == "smallest"
    assert res2.best["speedup"] == max(t.value for t in optuna.load_study(study_name="s", storage=res.storage).trials
                                       if t.state == optuna.trial.TrialState.COMPLETE)
    for name in ("trials.csv", "best.csv", "trials.png", "summary.json"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    assert "python -m decode.run --target tiny-llava --draft" in res2.command and "--compare" in res2.command
    assert "--exclude-data" not in res2.bench_command  # tau came from training sequences: no held-out prompts

    # the exported draft: standalone, on the right target, lossless
    cfg = json.loads((res2.draft / "draft_config.json").read_text())
    meta = cfg["metadata"]
    assert meta["hardware"] == "cpu" and meta["study"] == "s" and meta["profile"]["path"].endswith("cpu-tiny-llava.json")
    # every kind was priced; the exported one is the fastest of them (nas/choose.py), whatever its kind
    rows = json.loads((tmp_path / "run" / "kinds.json").read_text())["rows"]
    labels = {r["label"] for r in rows}
    assert {"vanilla", "prompt lookup", "layer-skip self-draft", "best neural", "EAGLE-like default",
            "neural #1 + lookup"} <= labels
    chosen = res2.chosen
    assert chosen["speedup"] == max(r["speedup"] for r in rows)
    assert cfg["kind"] == meta["kind"] == chosen["kind"]
    assert meta["predicted"]["tau"] == chosen["tau"] and meta["predicted"]["speedup"] == chosen["speedup"]
    if chosen["kind"] == "neural" and chosen["arch"] == res2.best["arch"]:
        assert meta["trial"] == res2.best["number"]
    for r in rows:
        assert r["tau_ci95"][0] <= r["tau"] <= r["tau_ci95"][1]
    target = tiny_target(TARGET)
    draft = make_draft(str(res2.draft), target)
    prompt = tiny_prompt(target)
    assert speculative_generate(target, draft, prompt, 20).tokens == vanilla_generate(target, prompt, 20).tokens


def test_a_useless_neural_draft_is_not_exported(assets, tmp_path):
    """A supernet that was never trained (random drafts): the search must hand over prompt lookup or plain
    decoding, and say so when it is plain decoding."""
    with single_thread():
        train(TrainConfig(target=TARGET, data=str(Path(assets["root"]) / "data"), out=str(tmp_path / "sn0"),
                          space="tiny", steps=1, lr=1e-12, warmup=1, ckpt_every=1, val_sequences=2, device="cpu",
                          dtype="float32"))
    res = run_search(_cfg(assets, tmp_path / "run", supernet=str(tmp_path / "sn0" / "checkpoint"), study_name="r"))
    # the untrained neural draft alone never wins; merged into lookup's tree it may add a hit or two on the
    # tiny random target, and then the merged row may beat lookup by a hair on a noisy quick profile
    assert res.chosen["kind"] != "neural", res.kinds_text
    cfg = json.loads((res.draft / "draft_config.json").read_text())
    assert cfg["kind"] == res.chosen["kind"]
    if res.chosen["kind"] == "neural+lookup":
        rows = json.loads((res.out / "kinds.json").read_text())["rows"]
        lookup = max((r for r in rows if r["kind"] == "prompt-lookup"), key=lambda r: r["speedup"])
        assert res.chosen["speedup"] > lookup["speedup"] and res.chosen["tau"] >= lookup["tau"], res.kinds_text
    else:
        assert not (res.draft / "model.safetensors").exists()
    if res.chosen["kind"] == "none":
        assert "no draft is predicted faster than plain decoding" in res.kinds_text
    target = tiny_target(TARGET)
    prompt = tiny_prompt(target)
    draft = make_draft(str(res.draft), target)
    assert speculative_generate(target, draft, prompt, 16).tokens == vanilla_generate(target, prompt, 16).tokens


def test_finetuning_is_skipped_when_it_cannot_change_the_choice(assets, tmp_path, monkeypatch):
    """The scale's fine-tuning runs only when some neural row, faster by its kind's FINETUNE_GAIN (8% alone, 5%
    merged with lookup, where fine-tuning has gained less), would reach the best training-free row; a
    --finetune-steps flag runs it anyway."""
    import nas.choose as choose_mod
    from nas import pipeline

    base = {"tau_ci95": [1.0, 1.0], "verify_tokens": 1.0, "arch": None, "lookup": None, "cycles": 0, "tau": 1.0}
    rows = [{**base, "kind": "none", "speedup": 1.0}, {**base, "kind": "prompt-lookup", "speedup": 1.5},
            {**base, "kind": "neural", "speedup": 1.2}, {**base, "kind": "neural+lookup", "speedup": 1.42}]
    assert choose_mod.FINETUNE_GAIN == {"neural": 0.08, "neural+lookup": 0.05}
    assert not choose_mod.finetune_may_pay(rows)  # 1.42 x 1.05 < 1.5 (1.42 x 1.08 would reach it)
    rows[3]["speedup"] = 1.43
    assert choose_mod.finetune_may_pay(rows)  # 1.43 x 1.05 >= 1.5
    rows[3]["speedup"], rows[2]["speedup"] = 1.0, 1.39
    assert choose_mod.finetune_may_pay(rows)  # the subnet alone: 1.39 x 1.08 >= 1.5
    rows[2]["speedup"] = 1.38
    assert not choose_mod.finetune_may_pay(rows)  # 1.38 x 1.08 < 1.5
    assert not choose_mod.finetune_may_pay(rows[:2])  # no neural row: nothing to fine-tune

    defaults = pipeline.nas_defaults
    monkeypatch.setattr(pipeline, "nas_defaults", lambda scale: {**defaults(scale), "finetune_steps": 2})
    monkeypatch.setattr(choose_mod, "finetune_may_pay", lambda rows, gain=None: False)
    asked: list = []  # the fine-tuning data is asked for only once fine-tuning is to run
    monkeypatch.setattr(search_mod, "ensure_finetune_data", lambda inp: asked.append(inp.finetune_data))
    for flag, tuned in ((None, False), (2, True)):
        asked.clear()
        run_search(_cfg(assets, tmp_path / f"run{flag}", study_name="f", finetune_steps=flag))
        labels = {r["label"] for r in json.loads((tmp_path / f"run{flag}" / "kinds.json").read_text())["rows"]}
        assert ("best neural, fine-tuned" in labels) == tuned and ("fine-tuned + lookup" in labels) == tuned
        assert (tmp_path / f"run{flag}" / "finetune").exists() == tuned
        assert asked == ([None] if tuned else [])


def test_the_pipelines_finetuning_data_is_built_when_asked_for_and_only_then(tmp_path, monkeypatch):
    """ensure_finetune_data: a --finetune-data folder is used as given; the pipeline's is built by its stage on the
    first call (not before: the cpu scale's 10 minutes of it were spent even where fine-tuning was skipped), then
    kept; a search on a given supernet (no pipeline) has none."""
    from types import SimpleNamespace

    from nas import pipeline

    built: list = []
    monkeypatch.setattr(pipeline, "finetune_data_stage", lambda cfg, target: built.append(cfg) or tmp_path / "ft")
    given = SimpleNamespace(finetune_data="mine", pipeline="pcfg", target=None)
    assert search_mod.ensure_finetune_data(given) == "mine" and built == []
    inp = SimpleNamespace(finetune_data=None, pipeline="pcfg", target=None)
    assert search_mod.ensure_finetune_data(inp) == str(tmp_path / "ft") and built == ["pcfg"]
    assert search_mod.ensure_finetune_data(inp) == str(tmp_path / "ft") and built == ["pcfg"]
    assert search_mod.ensure_finetune_data(SimpleNamespace(finetune_data=None, pipeline=None, target=None)) is None


def test_choice_says_when_nothing_beats_vanilla():
    from nas.choose import choose, format_table

    base = {"tau_ci95": [1.0, 1.0], "verify_tokens": 1.0, "arch": None, "lookup": None, "cycles": 0}
    rows = [{**base, "kind": "none", "label": "vanilla", "tau": 1.0, "speedup": 1.0},
            {**base, "kind": "prompt-lookup", "label": "prompt lookup", "tau": 1.2, "speedup": 0.97,
             "lookup": {"max_ngram": 3, "min_ngram": 1, "tree_depth": 4, "top_k": 1, "total_tokens": 4}}]
    chosen = choose(rows)
    assert chosen["kind"] == "none"
    assert "no draft is predicted faster than plain decoding on cpu" in format_table(rows, chosen, "cpu")
    rows[1]["speedup"] = 1.0  # a tie goes to the simpler kind
    assert choose(rows)["kind"] == "none"
    rows[1]["speedup"] = 1.2
    assert choose(rows)["kind"] == "prompt-lookup" and "no draft" not in format_table(rows, rows[1], "cpu")


def test_two_workers_share_one_study(assets, tmp_path):
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "nas.search", "--target", TARGET, "--supernet", assets["supernet"], "--profile",
           assets["profile"], "--heldout", "2", "--trials", "2", "--storage", storage, "--study-name", "w",
           "--device", "cpu", "--threads", "1", "--no-export"]
    procs = [subprocess.Popen(cmd + ["--out", str(tmp_path / f"w{i}")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    trials = optuna.load_study(study_name="w", storage=storage).get_trials(deepcopy=False)
    scored = [t.user_attrs["proposal"] for t in trials
              if t.state == optuna.trial.TrialState.COMPLETE and not t.user_attrs.get("repeat")]
    assert len(scored) == 4 and len(set(scored)) == 4  # 2 new archs per worker, none scored by both
    assert not [t for t in trials if t.state != optuna.trial.TrialState.COMPLETE]


def test_two_pipeline_workers_on_one_fresh_cache_build_each_stage_once(tmp_path):
    """Two no-supernet searches on one empty cache: data, supernet, held-out data and profile are built once
    (the second worker waits on each stage's lock and reuses the result)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "nas.search", "--target", TARGET, "--scale", "smoke", "--cache-dir", str(cache),
           "--trials", "2", "--device", "cpu", "--threads", "1", "--no-export"]
    procs = [subprocess.Popen(cmd + ["--out", str(tmp_path / f"w{i}")], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    run = cache / "runs" / f"{TARGET}-smoke"
    for part in ("data", "heldout"):
        assert len(json.loads((run / part / "manifest.json").read_text())["runs"]) == 1, part
    steps = [line.split(",")[0] for line in (run / "supernet" / "train_log.csv").read_text().splitlines()[1:]]
    roles = len([s for s in steps if s == "0"])
    assert len(steps) == len(set(steps)) * roles  # every step logged once per role: trained once
    assert [p.name for p in (run / "profiles").glob("*.json")] == ["cpu-tiny-llava.json"]
    for line in ("data stage: building", "supernet stage: training", "held-out stage: building", "; measuring one ->"):
        assert sum(line in err for _, err in outs) == 1, line  # one worker built it, the other reused it


def test_export_cli_trial_and_arch(assets, tmp_path):
    res = run_search(_cfg(assets, tmp_path / "run", trials=1, study_name="e", export=False))
    assert res.draft is None
    out = tmp_path / "ft"
    assert export_main(["--supernet", assets["supernet"], "--trial", "0", "--storage", res.storage, "--out", str(out),
                        "--finetune-steps", "3", "--device", "cpu"]) == 0
    meta = json.loads((out / "draft_config.json").read_text())["metadata"]
    assert meta["trial"] == 0 and meta["study"] == "e" and meta["finetune"]["steps"] == 3
    assert meta["setup"]["hardware"] == "cpu" and meta["predicted"]["speedup"] > 0
    target = tiny_target(TARGET)
    prompt = tiny_prompt(target)
    draft = make_draft(str(out), target)
    assert speculative_generate(target, draft, prompt, 16).tokens == vanilla_generate(target, prompt, 16).tokens

    arch = {"fusion": "cross", "feature_layers": [1, -1], "depth": 2, "heads": [2, 1], "ffn": [64, 32],
            "draft_vocab": 64, "visual_keep": 0.5, "tree_depth": 2, "top_k": 2, "total_tokens": 4}
    assert export_main(["--supernet", assets["supernet"], "--arch", json.dumps(arch), "--out", str(tmp_path / "a"),
                        "--device", "cpu"]) == 0
    draft = make_draft(str(tmp_path / "a"), target)
    assert draft.model.arch.to_dict() == arch
    # merged with lookup (kind neural+lookup) by the same CLI
    assert export_main(["--supernet", assets["supernet"], "--arch", json.dumps(arch), "--out", str(tmp_path / "m"),
                        "--device", "cpu", "--lookup", "4:2:1", "--merge", "switch"]) == 0
    assert export_main(["--supernet", assets["supernet"], "--arch", json.dumps(arch), "--out", str(tmp_path / "m"),
                        "--device", "cpu"]) == 0  # over an existing export: replaced whole (written beside, moved)
    assert json.loads((tmp_path / "m" / "draft_config.json").read_text())["kind"] == "neural"
    assert export_main(["--supernet", assets["supernet"], "--arch", json.dumps(arch), "--out", str(tmp_path / "m"),
                        "--device", "cpu", "--lookup", "4:2:1:2", "--merge", "switch"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary leftovers
    merged = make_draft(str(tmp_path / "m"), target)
    assert merged.rule == "switch" and merged.lookup.spec.tree_depth == 4 and merged.lookup.spec.max_ngram == 2
    assert merged.lookup.spec.weak_depth == 2  # D:M:K:W, kept through the checkpoint
    assert speculative_generate(target, merged, prompt, 16).tokens == vanilla_generate(target, prompt, 16).tokens
    for bad in (["--lookup", "4:2"], ["--lookup", "4:2:1:5"], ["--lookup", "4:2:1", "--merge", "mix"],
                ["--lookup", "4:2:1:0:0:0:3"], ["--lookup", "4:2:1:0:0:0:3:0"],
                ["--lookup", "4:2:1:0:0:0:3:2"]):  # L without N, N 0; leaf chains without --corpus
        with pytest.raises(UserError):
            export_main(["--supernet", assets["supernet"], "--arch", json.dumps(arch), "--out", str(tmp_path / "x"),
                         "--device", "cpu", *bad])
    # corpus chains under the neural leaves: the corpus travels with the draft
    from decode.drafts.corpus import NgramCorpus

    corpus = NgramCorpus.build([prompt.input_ids[0].tolist()], target.vocab_size).save(tmp_path / "c.safetensors")
    assert export_main(["--supernet", assets["supernet"], "--arch", json.dumps(arch), "--out", str(tmp_path / "leaf"),
                        "--device", "cpu", "--lookup", "4:2:1:0:0:0:3:2", "--corpus", str(corpus)]) == 0
    leafy = make_draft(str(tmp_path / "leaf"), target)
    assert (leafy.lookup.spec.leaf_depth, leafy.lookup.spec.leaf_count) == (3, 2) and leafy.lookup.corpus is not None
    assert speculative_generate(target, leafy, prompt, 16).tokens == vanilla_generate(target, prompt, 16).tokens
    assert sum(p.numel() for p in draft.model.parameters()) == draft_params(draft.model.arch, draft.model.dims)
    assert speculative_generate(target, draft, prompt, 16).tokens == vanilla_generate(target, prompt, 16).tokens


def test_param_count_matches_extracted_models(assets):
    target = tiny_target(TARGET)
    supernet, _ = load_supernet(assets["supernet"], target)
    e = supernet.entropy_layer
    for arch in (supernet.space.largest(e), supernet.space.smallest(e)):
        sub = supernet.extract(arch)
        assert sum(p.numel() for p in sub.parameters()) == draft_params(arch, sub.dims)


def test_bad_input_is_one_line(assets, tmp_path):
    cases = [
        (dict(profile=None, hardware="tpu9"), "unknown hardware 'tpu9'; use one of: a100"),
        (dict(trials=0), "--trials must be at least 1"),
        (dict(storage=f"sqlite:///{tmp_path}/missing/x.db"), "cannot open storage"),
        (dict(storage="nosuchdb://x"), "cannot open storage"),
        (dict(target="tiny-llama"), "was trained for target 'tiny-llava', not 'tiny-llama'"),
        (dict(hardware="h200"), "describes hardware 'cpu', not 'h200'"),
    ]
    for kw, msg in cases:
        with pytest.raises(UserError, match=msg.replace("(", r"\(").replace("[", r"\[")):
            run_search(_cfg(assets, tmp_path / "bad", **kw))
    other = json.loads(Path(assets["profile"]).read_text())
    other["target"]["fingerprint"] = {**other["target"]["fingerprint"], "weights_digest": "0" * 16}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(UserError, match="profile .* is for target"):
        run_search(_cfg(assets, tmp_path / "bad", profile=str(tmp_path / "other.json")))
    space = (ROOT / "configs" / "space" / "tiny.yaml").read_text().replace("heads: [1, 2, 4]", "heads: []")
    (tmp_path / "empty.yaml").write_text(space)
    with pytest.raises(UserError, match="'heads' has no choices"):
        run_search(_cfg(assets, tmp_path / "bad", space=str(tmp_path / "empty.yaml")))
    with pytest.raises(UserError, match="other settings"):  # a study keeps what its values mean
        run_search(_cfg(assets, tmp_path / "bad", study_name="x"))
        run_search(replace(_cfg(assets, tmp_path / "bad", study_name="x"), context=40))
    r = subprocess.run([sys.executable, "-m", "nas.search", "--trials", "0"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: --trials must be at least 1, got 0"]


def test_default_study_name_moves_on_when_the_inputs_change(assets, tmp_path):
    """Rerunning `nas.search` without --study-name after its inputs changed (here the context length; a new
    supernet or this machine's own profile alike) starts a study named by the new inputs instead of
    failing, and a second run with those inputs resumes that one."""
    cfg = replace(_cfg(assets, tmp_path / "run", trials=1, export=False), study_name=None)
    first = run_search(cfg)
    second = run_search(replace(cfg, context=40))
    assert second.study_name.startswith(first.study_name + "-") and second.total_complete == 1
    third = run_search(replace(cfg, context=40))
    assert third.study_name == second.study_name and third.total_complete == 2


def test_pipeline_builds_once_then_reuses(tmp_path):
    """No --supernet: held-out data, profile, then data and the supernet (last, so that a deadline can share what
    is left between them: nas.pipeline.Deadline) are built under the cache, then reused."""
    cfg = SearchConfig(target=TARGET, scale="smoke", cache_dir=str(tmp_path / "cache"),
                       profile_dir=str(tmp_path / "profiles"), out=str(tmp_path / "out"), trials=2, device="cpu",
                       dtype="float32")
    res = run_search(cfg)
    run = tmp_path / "cache" / "runs" / "tiny-llava-smoke"
    made = [run / "data" / "manifest.json", run / "supernet" / "checkpoint" / "state.json",
            run / "heldout" / "manifest.json", run / "profiles" / "cpu-tiny-llava.json"]
    stamps = [p.stat().st_mtime_ns for p in made]
    assert stamps[2] < stamps[0] < stamps[1] and stamps[3] < stamps[0]  # data, training after the fixed stages
    manifests = [json.loads((run / f / "manifest.json").read_text()) for f in ("data", "heldout")]
    assert manifests[0]["entropy"]["layer"] == manifests[1]["entropy"]["layer"]  # one entropy layer
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "split heldout" in summary["setup"]["heldout"] and summary["setup"]["heldout_last"] is None
    assert json.loads((run / "heldout" / "manifest.json").read_text())["config"]["mode"] == "regenerate"
    # the suggested bench runs on held-out prompts the search never scored
    assert shlex.split(res.bench_command)[-6:-4] == ["--exclude-data", str(run / "heldout")]
    assert summary["bench_command"] == res.bench_command
    first = {r["label"]: r for r in json.loads((tmp_path / "out" / "kinds.json").read_text())["rows"]}
    assert "best neural, fine-tuned" not in first  # smoke scale: no fine-tuning by default
    res2 = run_search(replace(cfg, finetune_steps=2))
    assert [p.stat().st_mtime_ns for p in made] == stamps  # every stage skipped
    assert res2.total_complete == 4 and res.study_name == res2.study_name == "nas-cpu-tiny-llava"
    meta = json.loads((res2.draft / "draft_config.json").read_text())["metadata"]
    assert meta["profile"]["how"] == "stored"
    rows = {r["label"]: r for r in json.loads((tmp_path / "out" / "kinds.json").read_text())["rows"]}
    assert rows["best neural, fine-tuned"]["tuned"] and rows["fine-tuned + lookup"]["tuned"]
    if rows["best neural"]["arch"] == first["best neural"]["arch"]:  # tuned on a copy: the supernet is unchanged
        assert rows["best neural"]["tau"] == first["best neural"]["tau"]
    if res2.chosen.get("tuned"):
        assert meta["finetune"]["steps"] == 2
    target = tiny_target(TARGET)
    prompt = tiny_prompt(target)
    draft = make_draft(str(res2.draft), target)
    assert speculative_generate(target, draft, prompt, 12).tokens == vanilla_generate(target, prompt, 12).tokens


def test_the_cli_counts_the_deadline_from_its_imports(monkeypatch):
    """python -m nas.search spends ~10 s importing torch and transformers before main() runs: its deadline counts from
    the package import (nas.IMPORTED), not from the pipeline's first stage."""
    import nas
    import nas.search as search_mod

    seen = []

    def stop(cfg, started=None):
        seen.append(started)
        raise UserError("stopped here")

    monkeypatch.setattr(search_mod, "run_search", stop)
    with pytest.raises(UserError, match="stopped here"):
        search_mod.main(["--target", TARGET, "--scale", "smoke"])
    assert seen == [nas.IMPORTED]


def test_a_killed_worker_trial_is_failed_and_its_arch_rerun(assets, tmp_path, monkeypatch):
    """kill -9 of a search mid-trial leaves it RUNNING; the next run marks it FAIL (no heartbeat for
    GRACE_S) and scores its arch again, instead of listing a RUNNING trial forever."""
    import signal
    import time

    import nas.study

    storage = f"sqlite:///{tmp_path / 'k.db'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "nas.search", "--target", TARGET, "--supernet", assets["supernet"], "--profile",
           assets["profile"], "--heldout", "2", "--trials", "6", "--storage", storage, "--study-name", "k",
           "--device", "cpu", "--threads", "1", "--no-export", "--out", str(tmp_path / "k")]
    def running() -> list[int]:
        try:
            trials = optuna.load_study(study_name="k", storage=storage).get_trials(deepcopy=False)
        except Exception:  # the study does not exist yet
            return []
        return [t.number for t in trials if t.state == optuna.trial.TrialState.RUNNING]

    killed = None
    for _ in range(5):  # a trial may finish between seeing it run and the kill: then try again
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and not running():
            time.sleep(0.02)
        time.sleep(0.4)  # into the trial (killed before or after its first heartbeat: both must be failed)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        stuck = running()  # what the kill really left behind
        if stuck:
            killed = stuck[0]
            break
    assert killed is not None, "no trial could be caught running"
    monkeypatch.setattr(nas.study, "GRACE_S", 1)
    time.sleep(2.5)  # > grace: the killed worker's heartbeat is stale
    run_search(_cfg(assets, tmp_path / "k2", storage=storage, study_name="k", trials=1, export=False))
    trials = optuna.load_study(study_name="k", storage=storage).get_trials(deepcopy=False)
    assert trials[killed].state == optuna.trial.TrialState.FAIL
    retried = [t for t in trials if t.system_attrs.get("failed_trial") == killed]
    assert retried and trials[killed].params.items() <= retried[0].params.items()  # killed mid-suggest: a prefix
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]


def test_a_trial_killed_before_its_first_heartbeat_is_failed_once_old(tmp_path, monkeypatch):
    """Optuna creates a trial RUNNING and only then records its first heartbeat: a worker killed in between
    leaves a trial with no heartbeat, which Optuna alone never fails. Ours does once it is GRACE_S old, and
    leaves alone a young silent trial and an old one whose heartbeat is fresh."""
    import time

    import nas.study

    monkeypatch.setattr(nas.study, "GRACE_S", 1)
    storage = nas.study.open_storage(f"sqlite:///{tmp_path / 'h.db'}")
    study = optuna.create_study(storage=storage, study_name="h")
    silent_old, beating_old = study.ask(), study.ask()  # ask() starts no heartbeat thread: both silent
    time.sleep(1.5)
    silent_young = study.ask()
    storage.record_heartbeat(beating_old._trial_id)
    optuna.storages.fail_stale_trials(study)
    state = {t.number: t.state for t in study.get_trials(deepcopy=False)}
    assert state[silent_old.number] == optuna.trial.TrialState.FAIL
    assert state[beating_old.number] == optuna.trial.TrialState.RUNNING
    assert state[silent_young.number] == optuna.trial.TrialState.RUNNING
    retried = [t for t in study.get_trials(deepcopy=False) if t.system_attrs.get("failed_trial") == silent_old.number]
    assert len(retried) == 1 and retried[0].state == optuna.trial.TrialState.WAITING  # its arch is queued again


def test_search_with_a_supernet_writes_its_new_profile_into_its_own_out(assets, tmp_path, monkeypatch):
    """No profile given or stored: the one measured now goes to <out>/profiles, never ./profiles of the
    working directory (the checkout's tracked folder), and a second run reuses it."""
    from hwprofile.schema import Profile

    monkeypatch.chdir(tmp_path)
    cfg = _cfg(assets, tmp_path / "my run", profile=None, trials=1, export=False, scale="smoke")
    res = run_search(cfg)
    own = tmp_path / "my run" / "profiles" / "cpu-tiny-llava.json"
    assert own.is_file() and not (tmp_path / "profiles").exists()
    assert Profile.load(own).target_name == TARGET
    mtime = own.stat().st_mtime
    res = run_search(replace(cfg, study_name="again", export=True))
    assert own.stat().st_mtime == mtime and res.total_complete >= 1
    words = shlex.split(res.command)  # the printed next step survives copy-paste of a path with a space
    assert words[:3] == ["python", "-m", "decode.run"] and words[words.index("--draft") + 1] == str(res.draft)


def test_a_stored_profile_of_another_machine_is_not_used(assets, tmp_path, caplog):
    """A measured "cpu" profile from another CPU (model, cores or vector extensions) does not describe this
    one: its few-row verify costs can differ 2x (decode.runtime.small_rows). It is skipped, with a warning, and this
    machine's profile is measured into the run's own folder instead."""
    import logging

    from hwprofile.device import DeviceInfo, local_device, other_machine

    here = local_device("cpu")
    assert other_machine(here, here) is None
    assert "cores" in other_machine(replace(here, cpu_cores=here.cpu_cores + 1), here)
    assert "vs" in other_machine(replace(here, cpu_isa="avx2,amx_tile,sve"), here)
    assert other_machine(replace(here, cpu_isa=""), here) is None  # profiles from before the field: model + cores
    elsewhere = tmp_path / "stored"
    elsewhere.mkdir()
    data = json.loads(Path(assets["profile"]).read_text())
    data["device"] = {**DeviceInfo.from_dict(data["device"]).to_dict(), "cpu_model": "Some Other CPU"}
    (elsewhere / "cpu-tiny-llava.json").write_text(json.dumps(data))
    cfg = _cfg(assets, tmp_path / "run", profile=None, trials=1, export=False, scale="smoke")
    with caplog.at_level(logging.WARNING, logger="nas.hardware"):
        run_search(replace(cfg, profile_dir=str(elsewhere)))
    assert any("measured on another machine" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "run" / "profiles" / "cpu-tiny-llava.json").is_file()  # measured here instead
    # a second stored profile, tagged, measured on this kind of machine: the next search takes it and measures nothing
    data["device"] = here.to_dict()
    (elsewhere / "cpu-tiny-llava@here.json").write_text(json.dumps(data))
    (elsewhere / "cpu-tiny-llava-compiled@here.json").write_text(json.dumps(data))  # another runtime's: not this one
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nas.hardware"):
        res = run_search(replace(cfg, profile_dir=str(elsewhere), out=str(tmp_path / "run2")))
    assert any("using the stored measured profile" in r.getMessage() and "@here" in r.getMessage()
               for r in caplog.records)
    assert not (tmp_path / "run2" / "profiles").exists() and res.total_complete >= 1


def test_recorded_command_names_the_module_and_quotes_its_arguments():
    from decode.benchio import command_line

    assert command_line(["/x/nas/search.py", "--out", "a b"]) == "python -m nas.search --out 'a b'"
    assert command_line(["/x/hwprofile/profile.py", "--quick"]) == "python -m hwprofile.profile --quick"


def _postgres_url() -> str:
    """The CI server (.ci/run starts one and sets VLM_DRAFT_NAS_PG_URL); under CI=true it must be there."""
    url = os.environ.get("VLM_DRAFT_NAS_PG_URL")
    if url:
        return url
    if os.environ.get("CI") == "true":
        pytest.fail("CI=true but VLM_DRAFT_NAS_PG_URL is not set: .ci/run starts PostgreSQL (.ci/postgres.sh)")
    pytest.skip("no PostgreSQL server: set VLM_DRAFT_NAS_PG_URL=postgresql+psycopg2://USER@HOST:PORT/DB "
                "(.ci/run starts one)")


def test_three_workers_on_postgresql_score_every_arch_once_and_agree_with_one_worker(assets, tmp_path):
    import uuid

    url = _postgres_url()
    space = tmp_path / "six.yaml"  # 6 archs (3 fusions x 2 FFN widths), a subspace of the supernet's: enumerated
    space.write_text("fusion: [concat, cross, hybrid]\nfeature_layers: [[-1]]\ndepth: [1]\nheads: [2]\n"
                     "ffn: [32, 64]\ndraft_vocab: [null]\nvisual_keep: [1.0]\ntree_depth: [2]\ntop_k: [2]\n"
                     "total_tokens: [4]\n")
    name = f"pg-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "nas.search", "--target", TARGET, "--supernet", assets["supernet"], "--profile",
           assets["profile"], "--space", str(space), "--heldout", "2", "--trials", "2", "--storage", url,
           "--study-name", name, "--seed", "0", "--device", "cpu", "--threads", "1", "--no-export"]
    procs = [subprocess.Popen(cmd + ["--out", str(tmp_path / f"w{i}")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    study = optuna.load_study(study_name=name, storage=url)
    scored = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and not t.user_attrs.get("repeat")]
    proposals = [t.user_attrs["proposal"] for t in scored]
    assert len(proposals) == 6 and len(set(proposals)) == 6  # every arch of the space, each scored once
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]

    one = run_search(_cfg(assets, tmp_path / "one", space=str(space), trials=6, storage=url,
                          study_name=f"{name}-one", seed=0, export=False))
    single = optuna.load_study(study_name=f"{name}-one", storage=url)
    assert single.best_trial.user_attrs["arch"] == study.best_trial.user_attrs["arch"]
    assert single.best_value == study.best_value and one.best["arch"] == study.best_trial.user_attrs["arch"]


def test_trial_subset_keeps_the_image_share_and_the_order():
    import torch

    from nas.loading import trial_subset

    seqs = [{"image_mask": torch.tensor([i % 4 == 3, False]), "i": i} for i in range(12)]  # 3 image sequences
    sub = trial_subset(seqs, 4)
    assert [s["i"] for s in sub] == [0, 1, 2, 3]  # 3 text + 1 image, in order
    assert [s["i"] for s in trial_subset(seqs, 2)] == [0, 3]  # one image even when its share rounds to 0
    assert trial_subset(seqs, None) == seqs and trial_subset(seqs, 20) == seqs


def test_designs_picked_on_the_trial_sequences_are_confirmed_on_all(assets, tmp_path, monkeypatch):
    """Trials score 2 held-out sequences; the final table re-scores each row's design on all 4 (every row a
    contender here), and those are the numbers the choice and the export use."""
    import nas.choose
    from decode.drafts.prompt_lookup import LookupSpec
    from nas.kinds import KindScorer
    from nas.loading import heldout_sequences, read_supernet_state
    from nas.objective import SweepTau

    monkeypatch.setattr(nas.choose, "CONFIRM_MARGIN", 1.0)
    res = run_search(_cfg(assets, tmp_path / "run", heldout=4, trial_sequences=2, finetune_steps=0,
                          study_name="c"))
    rows = json.loads((tmp_path / "run" / "kinds.json").read_text())["rows"]
    assert all(r["sequences"] == 4 and r["search"]["sequences"] == 2 for r in rows)
    assert "exact greedy tau on 4 held-out sequences; designs picked on the 2 the trials scored" in res.kinds_text
    target = tiny_target(TARGET)
    net, _ = load_supernet(assets["supernet"], target)
    seqs = heldout_sequences(target, net, read_supernet_state(assets["supernet"]), None, 4, net.space).sequences
    assert len(seqs) == 4
    every = KindScorer(seqs, None)
    look = next(r for r in rows if r["kind"] == "prompt-lookup")
    assert look["tau"] == round(every.replay_lookup(LookupSpec(**look["lookup"])).acceptance.tau, 4)
    merged = next(r for r in rows if r["kind"] == "neural+lookup")
    arch = DraftArch.from_json(merged["arch"])
    sweep = SweepTau(net.float(), seqs, target.num_layers, 1).sweep(arch)
    rep = every.replay_neural(arch, sweep, LookupSpec(**merged["lookup"]), rule=merged["merge"])
    assert merged["tau"] == round(rep.acceptance.tau, 4)
    assert res.chosen["speedup"] == max(r["speedup"] for r in rows)


def test_rows_far_behind_the_best_are_not_confirmed():
    """Only contenders get a sweep over the whole held-out set: rows within the margin of the best, the
    training-free ones, and rows sharing a contender's sweep (at the deepest tree among them)."""
    from dataclasses import replace as dc_replace

    from nas.choose import confirm_rows

    a = DraftArch(fusion="concat", feature_layers=(-1,), depth=1, heads=(3,), ffn=(384,), draft_vocab=4096,
                  visual_keep=1.0, tree_depth=2, top_k=1, total_tokens=2)
    eagle = dc_replace(a, heads=(9,), ffn=(1536,), draft_vocab=None, tree_depth=4, top_k=2, total_tokens=14)
    deep = dc_replace(a, tree_depth=3, total_tokens=3)

    def row(kind, speedup, arch=None, label=""):
        return {"kind": kind, "speedup": speedup, "tau": 1.0, "tau_ci95": [1.0, 1.0], "sequences": 8, "label": label,
                "arch": arch.to_json() if arch else None, "lookup": None}

    class Scorer:
        seqs = [None] * 96

        def vanilla(self):
            return row("none", 1.0)

        def lookup(self, spec):
            return row("prompt-lookup", 1.25)

        def neural(self, arch, sweep, lookup, rule):
            return {**row("neural", 1.1, arch), "sweep": sweep}

    rows = [row("none", 1.0, label="vanilla"), row("prompt-lookup", 1.2, label="lookup"),
            row("neural", 1.0, a, "best neural"), row("neural", 0.9, deep, "deeper"), row("neural", 0.4, eagle, "eagle")]
    rows[1]["lookup"] = {"max_ngram": 2, "tree_depth": 2, "top_k": 1, "total_tokens": 2}
    swept = []
    out = {r["label"]: r for r in confirm_rows(rows, Scorer(), lambda arch: swept.append(arch) or arch.tree_depth,
                                               margin=0.2)}
    assert {k for k, r in out.items() if r["sequences"] == 96} == {"vanilla", "lookup", "best neural", "deeper"}
    assert out["eagle"] is rows[4]  # 0.4x: left as the trials scored it
    assert [s.tree_depth for s in swept] == [3, 3] and out["best neural"]["sweep"] == 3  # one depth for both
    assert out["best neural"]["search"] == {"tau": 1.0, "tau_ci95": [1.0, 1.0], "speedup": 1.0, "sequences": 8}


def test_lookup_rows_are_picked_again_over_their_grid_on_the_whole_set():
    """The training-free lookup rows are re-picked over their grid on the whole held-out set (replays cost no
    forward): a spec that won on the trials' few sequences does not stay fixed when another wins on all of them.
    A lookup row without a grid keeps its spec."""
    from decode.drafts.prompt_lookup import LookupSpec
    from nas.choose import confirm_rows, lookup_grids
    from nas.kinds import LOOKUP_ALONE_GRID

    plain = LookupSpec(max_ngram=2, tree_depth=4, top_k=1, total_tokens=4)
    two = LookupSpec(max_ngram=2, tree_depth=4, top_k=1, total_tokens=4, corpus_depth=2)
    runner_up = LookupSpec(max_ngram=2, tree_depth=4, top_k=1, total_tokens=4, corpus_depth=2, corpus_second=1)

    class Scorer:
        seqs = [None] * 168

        def vanilla(self):
            return {"kind": "none", "speedup": 1.0, "tau": 1.0, "tau_ci95": [1.0, 1.0], "arch": None, "lookup": None}

        def lookup(self, spec):  # the whole set prefers the runner-up branch
            speedup = {plain: 1.2, two: 1.546, runner_up: 1.565}[spec]
            return {"kind": "prompt-lookup", "speedup": speedup, "tau": speedup, "tau_ci95": [1.0, 1.0],
                    "arch": None, "lookup": asdict(spec)}

        def best_lookup(self, grid):
            return max((self.lookup(s) for s in grid), key=lambda r: r["speedup"])

    def row(label, spec, speedup):
        return {"kind": "prompt-lookup", "speedup": speedup, "tau": 1.0, "tau_ci95": [1.0, 1.0], "sequences": 4,
                "label": label, "arch": None, "lookup": asdict(spec)}

    rows = [row("prompt + corpus lookup", two, 1.44), row("prompt lookup", plain, 1.15), row("other", two, 1.3)]
    grids = lookup_grids((two, runner_up), lookup_grid=(plain,))
    out = {r["label"]: r for r in confirm_rows(rows, Scorer(), None, grids=grids)}
    assert LookupSpec(**out["prompt + corpus lookup"]["lookup"]) == runner_up
    assert out["prompt + corpus lookup"]["speedup"] == 1.565 and out["prompt + corpus lookup"]["sequences"] == 168
    assert out["prompt + corpus lookup"]["search"]["speedup"] == 1.44  # what the trials' sequences said
    assert LookupSpec(**out["prompt lookup"]["lookup"]) == plain
    assert LookupSpec(**out["other"]["lookup"]) == two  # no grid: its spec fixed
    fixed = {r["label"]: r for r in confirm_rows(rows, Scorer(), None)}  # without grids: specs fixed, as before
    assert LookupSpec(**fixed["prompt + corpus lookup"]["lookup"]) == two
    assert lookup_grids() == {"prompt lookup": LOOKUP_ALONE_GRID}  # no corpus: no corpus row to pick


@pytest.mark.parametrize("kernel", ["attention", "linear"])
def test_a_stored_profile_measured_with_old_kernels_is_measured_again(assets, tmp_path, caplog, kernel):
    """Profiles record the attention implementation and the few-row linear kernels they timed: one from before
    the packed grouped-query attention (no record: transformers' repeat_kv made multi-token verifies dearer) or
    before the cold-weight linear choice (one-row steps on a one-core GEMV) misprices steps and trees. On this
    machine it is skipped, with a warning, and measured again; another device's keeps a warning."""
    import logging

    from decode.runtime import native_attention
    from decode.runtime.small_rows import linear_kernels
    from hwprofile.schema import Profile
    from nas.hardware import resolve_profile, stale_kernels

    target = tiny_target(TARGET)
    data = json.loads(Path(assets["profile"]).read_text())
    assert data["versions"]["attention"] == target.attention_kernels()  # recorded when measured
    assert data["versions"]["linear"] == linear_kernels()
    assert data["versions"]["kv_cache"] == target.kv_cache() == "roomy"  # recorded, not checked (see stale_kernels)
    assert data["versions"]["attention_kernel"] == native_attention.VERSION
    assert stale_kernels(Profile.from_json(data), target) is None
    del data["versions"][kernel]
    said = "older tree attention" if kernel == "attention" else "older few-row linear kernels"
    assert said in stale_kernels(Profile.from_json(data), target)
    stored = tmp_path / "stored"
    stored.mkdir()
    (stored / "cpu-tiny-llava.json").write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="nas.hardware"):
        with single_thread():
            choice = resolve_profile(target, None, None, [stored], tmp_path / "run", quick=True)
    assert any(said in r.getMessage() for r in caplog.records)
    assert choice.path == tmp_path / "run" / "cpu-tiny-llava.json" and choice.path.is_file()  # measured here
    assert Profile.load(choice.path).versions["attention"] == target.attention_kernels()
    assert Profile.load(choice.path).versions["linear"] == linear_kernels()


def test_the_cpu_attention_kernel_makes_cpu_profiles_stale_not_gpu_ones():
    """A CPU profile timed before the native decoding attention ("+native") misprices steps and trees on this
    machine; a GPU profile (which never runs that kernel) read by a search on a CPU host stays valid."""
    from types import SimpleNamespace

    from nas.hardware import stale_kernels

    target = tiny_target(TARGET)
    assert target.attention_kernels().endswith("+native")  # a CPU float32 target with the kernels built
    plain = target.model.config._attn_implementation
    gpu = SimpleNamespace(predicted=False, device={"kind": "cuda"}, versions={"attention": plain}, runtime="eager")
    assert stale_kernels(gpu, target) is None
    from decode.drafts.pack import cpu_format
    from decode.runtime.small_rows import linear_kernels

    cpu = SimpleNamespace(predicted=False, device={"kind": "cpu"}, runtime="eager",
                          versions={"attention": plain, "linear": linear_kernels(), "draft_weights": cpu_format()})
    assert "tree attention" in stale_kernels(cpu, target)
    cpu.versions["attention"] = target.attention_kernels()
    assert stale_kernels(cpu, target) is None


def test_a_stored_profile_of_a_smaller_space_is_measured_again(assets, tmp_path, caplog):
    """A stored profile of this machine whose draft tables were measured for a smaller space than the search's (the
    repo's CPU profile is the demo and cpu scales' `compact` space) would extrapolate the other choices' draft costs:
    it is skipped, with a warning naming what it lacks, and measured again; one that covers the space is used."""
    import logging

    from decode.space import SearchSpace
    from nas.hardware import resolve_profile, uncovered

    compact, default = SearchSpace.load("compact"), SearchSpace.load("default")
    assert uncovered(compact.to_dict(), compact) is None and uncovered(default.to_dict(), compact) is None
    why = uncovered(compact.to_dict(), default)
    assert "fusion ['cross', 'hybrid'] not measured" in why and "depth [3, 4] outside 1..2" in why
    assert uncovered({}, default) is None  # profiles from before the space was recorded: as before
    target = tiny_target(TARGET)
    data = json.loads(Path(assets["profile"]).read_text())
    assert uncovered(data["space"], SearchSpace.load("tiny")) is None  # the assets profile is the tiny space's
    stored = tmp_path / "stored"
    stored.mkdir()
    (stored / "cpu-tiny-llava.json").write_text(json.dumps(data))
    with single_thread():
        assert resolve_profile(target, None, None, [stored], tmp_path / "run", quick=True).how == "stored"
    data["space"] = {**data["space"], "fusion": ["concat"], "depth": [1]}
    (stored / "cpu-tiny-llava.json").write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="nas.hardware"):
        with single_thread():
            choice = resolve_profile(target, None, None, [stored], tmp_path / "run", quick=True)
    said = [r.getMessage() for r in caplog.records if "does not cover the search space" in r.getMessage()]
    assert said and "fusion ['cross', 'hybrid'] not measured" in said[0] and "depth [2] outside 1..1" in said[0]
    assert choice.how == "measured" and choice.path == tmp_path / "run" / "cpu-tiny-llava.json"
    # a search of a space within it (e.g. a supernet's own, given as an object: a custom YAML's name cannot be
    # loaded again) uses it
    small = replace(SearchSpace.load("tiny"), fusion=("concat",), depth=(1,))
    with single_thread():
        assert resolve_profile(target, None, None, [stored], tmp_path / "run2", quick=True,
                               search_space=small).how == "stored"


def test_finetuning_unrolls_no_deeper_than_the_chosen_tree(assets, monkeypatch):
    """A one-token draft (tree_depth 1) is fine-tuned on its first guess only; a deeper tree keeps the
    supernet's unroll (2 here)."""
    import nas.finetune as ft
    from supernet.dataset import FeatureData

    seen: list[int] = []
    real = ft.subnet_losses

    def spy(model, seq, cfg, **kw):
        seen.append(cfg.unroll)
        return real(model, seq, cfg, **kw)

    monkeypatch.setattr(ft, "subnet_losses", spy)
    target = tiny_target(TARGET)
    net, state = load_supernet(assets["supernet"], target)
    data = FeatureData(state["data"], target)
    base = net.space.largest(net.entropy_layer)
    for depth, want in ((1, 1), (3, 2)):
        arch = DraftArch.from_dict({**base.to_dict(), "tree_depth": depth, "top_k": 1, "total_tokens": depth})
        seen.clear()
        info = ft.finetune_subnet(net, arch, data, [0, 1], ft.FinetuneConfig.like_training(2, state))
        assert seen == [want, want] and info["unroll"] == want


def test_finetuning_warms_up_then_decays_its_learning_rate(assets, monkeypatch):
    """A constant learning rate left the fine-tuned subnet below the supernet's: fine-tuning warms up and then
    decays (cosine) to final_lr x lr, and the optimizer steps with that rate."""
    import nas.finetune as ft
    from supernet.dataset import FeatureData

    cfg = ft.FinetuneConfig(steps=100, lr=1e-3, warmup=10, final_lr=0.1)
    lrs = [ft.finetune_lr(cfg, s) for s in range(cfg.steps)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3, rel=0.05)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(1e-4)
    used: list[float] = []
    real_step = torch.optim.AdamW.step

    def spy(self, *a, **k):
        used.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    target = tiny_target(TARGET)
    net, state = load_supernet(assets["supernet"], target)
    short = ft.FinetuneConfig(steps=4, lr=1e-3, warmup=2, final_lr=0.1)
    ft.finetune_subnet(net, net.space.largest(net.entropy_layer), FeatureData(state["data"], target), [0, 1], short)
    assert used == pytest.approx([ft.finetune_lr(short, s) for s in range(4)]) and used[-1] == pytest.approx(1e-4)


def test_a_fine_tuned_row_exports_with_the_weights_the_search_tuned(assets, tmp_path, monkeypatch):
    """`nas.export --finetuned OUT/finetune` writes the subnet with the weights the search fine-tuned and scored
    (benchmarks/kinds_drafts.py benches the rows marked fine-tuned that way); a checkpoint of another network or
    of another supernet, or a folder that is no fine-tuning checkpoint, is refused with one line."""
    tuned_nets: list = []
    real = search_mod.finetune_best

    def keeping(*a, **kw):
        net, info = real(*a, **kw)
        tuned_nets.append(net)
        return net, info

    monkeypatch.setattr(search_mod, "finetune_best", keeping)
    out = tmp_path / "run"
    run_search(_cfg(assets, out, study_name="ft", finetune_steps=3, export=False))
    rows = {r["label"]: r for r in json.loads((out / "kinds.json").read_text())["rows"]}
    row = rows["best neural, fine-tuned"]
    assert row["tuned"] and len(tuned_nets) == 1
    target = tiny_target(TARGET)
    base = ["--supernet", assets["supernet"], "--arch", row["arch"], "--device", "cpu", "--dtype", "float32"]
    assert export_main([*base, "--out", str(tmp_path / "tuned"), "--finetuned", str(out / "finetune")]) == 0
    assert export_main([*base, "--out", str(tmp_path / "plain")]) == 0
    train_dir = str(Path(assets["supernet"]).parent)  # the training folder above checkpoint/: the same supernet
    assert export_main([*base, "--supernet", train_dir, "--out", str(tmp_path / "via-train-dir"),
                        "--finetuned", str(out / "finetune")]) == 0
    tuned, plain = make_draft(str(tmp_path / "tuned"), target), make_draft(str(tmp_path / "plain"), target)
    want = tuned_nets[0].extract(DraftArch.from_json(row["arch"]), target).state_dict()
    got, before = tuned.model.state_dict(), plain.model.state_dict()
    assert all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)
    assert any(not torch.equal(got[k], before[k]) for k in got)  # fine-tuning moved them: not the supernet's
    assert tuned.model.metadata["finetune"]["steps"] == 3
    prompt = tiny_prompt(target)
    assert speculative_generate(target, tuned, prompt, 16).tokens == vanilla_generate(target, prompt, 16).tokens

    other = json.loads(row["arch"])
    other["heads"] = [1 if h != 1 else 2 for h in other["heads"]]  # the tiny space's heads: 1, 2, 4
    moved = tmp_path / "sn-copy"
    import shutil

    shutil.copytree(assets["supernet"], moved)
    for f in moved.glob("*.safetensors"):
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1))  # the weights changed since
    cases = [(["--arch", json.dumps(other)], "fine-tuned another network"),
             (["--supernet", str(moved)], "another supernet"),
             (["--finetuned", assets["supernet"]], "not a fine-tuning checkpoint"),
             (["--finetuned", str(tmp_path / "nowhere")], "not a fine-tuning checkpoint"),
             (["--finetune-steps", "2"], "not both")]
    for extra, message in cases:
        argv = [*base, "--out", str(tmp_path / "x"), "--finetuned", str(out / "finetune"), *extra]
        with pytest.raises(UserError, match=message):
            export_main(argv)


def test_finetuning_resumes_bit_exact_after_a_kill(assets, tmp_path, monkeypatch, caplog):
    """Fine-tuning at cpu scale takes 18 minutes: killed after its step 3 with a checkpoint every 2 steps, a rerun
    trains steps 2-4 again only and ends with the weights of an uninterrupted run; a finished run is restored
    without training; a checkpoint of another run (other steps) is not resumed."""
    import nas.finetune as ft
    from supernet.dataset import FeatureData

    target = tiny_target(TARGET)
    real = ft.subnet_losses
    trained: list[int] = []

    def counting(model, seq, cfg, **kw):
        trained.append(kw["seed"])
        return real(model, seq, cfg, **kw)

    def run(ckpt=None, steps=5):
        net, state = load_supernet(assets["supernet"], target)
        arch = net.space.largest(net.entropy_layer)
        cfg = replace(ft.FinetuneConfig.like_training(steps, state), warmup=2)
        info = ft.finetune_subnet(net, arch, FeatureData(state["data"], target), [0, 1, 2], cfg, ckpt_dir=ckpt,
                                  ckpt_every=2, identity={"supernet": "x"})
        return net.state_dict(), info

    monkeypatch.setattr(ft, "subnet_losses", counting)
    whole, info_whole = run()
    ckpt = tmp_path / "finetune"

    def dying(model, seq, cfg, **kw):
        if len(trained) == 3:
            raise KeyboardInterrupt  # a kill during step 3 (0-based), after the save at step 2
        return counting(model, seq, cfg, **kw)

    trained.clear()
    monkeypatch.setattr(ft, "subnet_losses", dying)
    with pytest.raises(KeyboardInterrupt):
        run(ckpt)
    monkeypatch.setattr(ft, "subnet_losses", counting)
    trained.clear()
    resumed, info = run(ckpt)
    assert len(trained) == 3  # steps 2, 3, 4
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert info["last_loss"] == pytest.approx(info_whole["last_loss"])
    trained.clear()
    again, _ = run(ckpt)
    assert trained == [] and all(torch.equal(whole[k], again[k]) for k in whole)  # finished: restored, not retrained
    with caplog.at_level("WARNING"):
        run(ckpt, steps=6)
    assert len(trained) == 6 and "another run's" in caplog.text


def test_finetuning_stops_at_its_time_budget_and_resumes_its_clock(assets, tmp_path, monkeypatch):
    """With a time budget, fine-tuning stops once that much wall-clock has gone (a step here takes 10 s of a fake
    clock: 25 s -> 3 of 50 steps), its cosine follows the time, and the checkpoint keeps the clock: killed after
    its second step, a rerun trains one step more, and a run stopped by its budget is restored, not retrained."""
    import nas.finetune as ft
    from supernet.dataset import FeatureData

    target = tiny_target(TARGET)
    clock = [1000.0]
    real = ft.subnet_losses
    trained: list[int] = []
    lrs: list[float] = []
    kill_at = [None]

    def ten_seconds(model, seq, cfg, **kw):
        if kill_at[0] is not None and len(trained) == kill_at[0]:
            raise KeyboardInterrupt
        trained.append(kw["seed"])
        clock[0] += 10.0
        return real(model, seq, cfg, **kw)

    monkeypatch.setattr(ft, "subnet_losses", ten_seconds)
    monkeypatch.setattr(ft.time, "perf_counter", lambda: clock[0])
    real_step = torch.optim.AdamW.step

    def spy(self, *a, **k):
        lrs.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)

    def run(ckpt=None):
        net, state = load_supernet(assets["supernet"], target)
        cfg = replace(ft.FinetuneConfig.like_training(50, state, time_budget_s=25.0), warmup=1)
        info = ft.finetune_subnet(net, net.space.largest(net.entropy_layer), FeatureData(state["data"], target),
                                  [0, 1, 2], cfg, ckpt_dir=ckpt, ckpt_every=1, identity={"supernet": "x"})
        return cfg, info

    cfg, info = run()
    assert len(trained) == 3 and info["steps"] == 3 and info["budget_spent"]
    assert lrs == pytest.approx([ft.finetune_lr(cfg, s, 10.0 * s) for s in range(3)])
    assert lrs[2] < ft.finetune_lr(cfg, 2) * 0.8  # the time, not the 50 steps, drives the decay
    assert ft.finetune_lr(cfg, 3, 25.0) == pytest.approx(cfg.final_lr * cfg.lr)
    ckpt = tmp_path / "finetune"
    trained.clear()
    kill_at[0] = 2  # killed in its third step, after the checkpoint of step 2 (20 s of fine-tuning)
    with pytest.raises(KeyboardInterrupt):
        run(ckpt)
    kill_at[0] = None
    trained.clear()
    _, info = run(ckpt)
    assert len(trained) == 1 and info["steps"] == 3 and info["budget_spent"]  # 20 s kept + one 10 s step
    trained.clear()
    _, info = run(ckpt)
    assert trained == [] and info["steps"] == 3  # spent: restored without training


def test_finetuning_budget_comes_from_the_flag_or_the_scale():
    """--finetune-minutes sets fine-tuning's wall-clock budget, else the scale's (15 minutes at cpu scale, none at
    demo scale); a negative or infinite value is one error line."""
    from nas.pipeline import nas_defaults
    from nas.search import SearchConfig, build_parser, finetune_budget_s

    assert nas_defaults("cpu")["finetune_time_budget_s"] == 900 and nas_defaults("demo")["finetune_time_budget_s"] == 0
    args = build_parser().parse_args(["--finetune-minutes", "2.5"])
    assert args.finetune_minutes == 2.5
    assert finetune_budget_s(SearchConfig(finetune_minutes=2.5), nas_defaults("cpu")) == 150.0
    assert finetune_budget_s(SearchConfig(finetune_minutes=0), nas_defaults("cpu")) == 0.0
    assert finetune_budget_s(SearchConfig(), nas_defaults("cpu")) == 900.0
    for bad in (-1.0, float("inf")):
        with pytest.raises(UserError, match="--finetune-minutes"):
            SearchConfig(finetune_minutes=bad).check()


def test_finetuning_reads_the_targets_own_answers_with_the_training_data(assets, tmp_path, monkeypatch):
    """--finetune-data: fine-tuning trains on the supernet's training data and that folder together (MixedData), the
    export records it; a folder of held-out prompts or a missing one is refused with one line before any work."""
    import shutil

    import nas.finetune as ft
    from supernet.dataset import FeatureData, MixedData

    target = tiny_target(TARGET)
    extra = tmp_path / "own"
    with single_thread():
        build_data(DataConfig(target=TARGET, prompts="sharegpt:3", space="tiny", mode="regenerate", max_len=160,
                              max_new_tokens=16, max_prompt_chars=130, topk=16, out=str(extra)), target=target)
    net, state = load_supernet(assets["supernet"], target)
    train_data, own = FeatureData(state["data"], target), FeatureData(extra, target)
    mixed = MixedData([train_data, own])
    assert len(mixed) == len(train_data) + len(own)
    assert torch.equal(mixed[len(train_data) + 1]["input_ids"], own[1]["input_ids"])
    assert torch.equal(mixed.token_counts(), train_data.token_counts() + own.token_counts())
    own_ids = {tuple(own[i]["input_ids"].tolist()) for i in range(len(own))}
    seen: list[tuple] = []
    real = ft.subnet_losses

    def spy(model, seq, cfg, **kw):
        seen.append(tuple(seq["input_ids"].tolist()))
        return real(model, seq, cfg, **kw)

    monkeypatch.setattr(ft, "subnet_losses", spy)
    steps = 12
    res = run_search(_cfg(assets, tmp_path / "run", trials=1, finetune_steps=steps, finetune_data=str(extra)))
    n_train = len(train_data) - 2  # the checkpoint's last 2 sequences are this search's held-out tail
    assert len(seen) == steps and own_ids & set(seen)  # its own answers were trained on
    # one epoch of the shuffled union covers both folders, and never the held-out tail
    assert set(seen) <= own_ids | {tuple(train_data[i]["input_ids"].tolist()) for i in range(n_train)}
    tuned = [r for r in json.loads((tmp_path / "run" / "kinds.json").read_text())["rows"] if r.get("tuned")]
    assert tuned and res.total_complete == 1
    if res.chosen.get("tuned"):
        meta = json.loads((res.draft / "draft_config.json").read_text())["metadata"]
        assert meta["finetune"]["sequences"] == n_train + len(own) and meta["finetune"]["finetune_data"] == str(extra)
    held = tmp_path / "held"
    shutil.copytree(extra, held)
    manifest = json.loads((held / "manifest.json").read_text())
    manifest["config"]["split"] = "heldout"
    (held / "manifest.json").write_text(json.dumps(manifest))
    for bad, match in ((held, "held-out prompts"), (tmp_path / "nowhere", "manifest")):
        with pytest.raises(UserError, match=match):
            run_search(_cfg(assets, tmp_path / "bad", finetune_steps=2, finetune_data=str(bad)))
        assert not (tmp_path / "bad" / "study.db").exists()
