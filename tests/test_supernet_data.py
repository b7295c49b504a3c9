"""supernet.data / supernet.dataset / supernet.entropy: shards equal on-the-fly features, resume, target checks,
exact top-k probabilities, entropy-layer choice."""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import ALL_PRESETS, single_thread, tiny_target
from safetensors.torch import load_file

import supernet.data as data_mod
from decode.cli import run_cli
from decode.datasets import PromptItem, image_prompts
from decode.errors import UserError
from decode.loop.vanilla import vanilla_generate
from decode.targets.loader import load_target
from supernet.data import DataConfig, build_data, build_sequence, features_on_the_fly
from supernet.dataset import FeatureData, read_manifest
from supernet.entropy import calibrate, candidate_layers, choose_layer, per_token_layers

TEXT_ITEMS = [
    PromptItem("sharegpt:aaa_0", "What is the capital of France?", None,
               "The capital of France is Paris, a large city on the Seine."),
    PromptItem("sharegpt:bbb_0", "Write a haiku about the sea.", None,
               "Waves fold into foam; the gulls cry over grey stone."),
]
ITEMS = TEXT_ITEMS + image_prompts("train", 1)  # 2 ShareGPT-like prompts + 1 bundled photo


def _fake_spec(spec, split="heldout", max_chars=None, cache_dir=None):
    assert split == "train"
    return list(ITEMS)


def _config(out, **kw) -> DataConfig:
    base = dict(target="tiny-llava", prompts="sharegpt:2,images:1", space="tiny", max_len=80, topk=8,
                image_answer_tokens=6, shard_size=1, out=str(out))
    return DataConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "llava"
    with single_thread(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(data_mod, "parse_prompt_spec", _fake_spec)
        build_data(_config(out), target=tiny_target("tiny-llava"))
    return out


@pytest.fixture
def fake_prompts(monkeypatch):
    monkeypatch.setattr(data_mod, "parse_prompt_spec", _fake_spec)


# ---------------------------------------------------------------- teacher-mode data

def test_shards_and_manifest_written(built):
    m = read_manifest(built)
    target = tiny_target("tiny-llava")
    assert m["complete"] and len(m["shards"]) == 3 and all(s["complete"] for s in m["shards"])
    assert m["target"]["fingerprint"] == target.fingerprint().to_dict()
    assert m["counts"]["sequences"] == 3 and m["counts"]["tokens"] > 0 and m["counts"]["image_tokens"] > 0
    assert m["entropy"]["layer"] in m["layers"] and target.num_layers in m["layers"]  # -1 stored as L
    assert len(m["dataset_mean_entropy"]) == target.num_layers
    assert (built / "token_counts.safetensors").is_file()
    data = FeatureData(built, target)
    assert len(data) == 3 and data.ids == [p.id for p in ITEMS] and data.entropy_layer == m["entropy"]["layer"]
    assert data.layer_index(-1) == target.num_layers


def test_shards_equal_on_the_fly_features(built):
    target = tiny_target("tiny-llava")
    data = FeatureData(built, target)
    for i, item in enumerate(ITEMS):
        stored, fresh = data[i], features_on_the_fly(target, item, data.config)
        for key in ("input_ids", "topk_ids", "loss_mask", "image_mask", "prompt_len"):
            assert torch.equal(stored[key], fresh[key]), key
        for key in ("topk_logits", "lse", "attn_entropy", "attn_received"):
            torch.testing.assert_close(stored[key], fresh[key])
        assert set(stored["hidden"]) == set(fresh["hidden"]) == set(data.layers)
        for h in data.layers:  # stored in bf16
            torch.testing.assert_close(stored["hidden"][h], fresh["hidden"][h], rtol=1.6e-2, atol=1e-2)
        t = stored["input_ids"].numel()
        assert stored["hidden"][data.layers[0]].shape == (t, target.hidden_size)
        assert stored["attn_entropy"].shape == (t, target.num_layers) and stored["topk_ids"].shape == (t, 8)
        assert not stored["loss_mask"][-1] and not bool((stored["loss_mask"] & stored["image_mask"]).any())
    image_seq = data[2]
    assert int(image_seq["image_mask"].sum()) == int((image_seq["input_ids"] == target.image_token_id).sum()) > 0
    answer = target.tokenizer(ITEMS[0].answer, add_special_tokens=False)["input_ids"] + [target.tokenizer.eos_token_id]
    tail = data[0]["input_ids"][int(data[0]["prompt_len"]):].tolist()
    assert len(tail) > 0 and tail == answer[: len(tail)]  # teacher: the dataset's answer (+ end token), truncated


def test_topk_probabilities_are_exact(built):
    target = tiny_target("tiny-llava")
    data = FeatureData(built, target)
    for i, item in enumerate(ITEMS):
        seq = data[i]
        full, _ = build_sequence(target, item, data.config)
        logits = target.prefill(full, all_logits=True).logits  # (T, V)
        probs = torch.softmax(logits, dim=-1)
        p_top = torch.exp(seq["topk_logits"] - seq["lse"][:, None])  # (T, K)
        assert bool((p_top.sum(-1) <= 1 + 1e-5).all())
        torch.testing.assert_close(p_top, probs.gather(-1, seq["topk_ids"]), rtol=1e-4, atol=1e-6)
        assert torch.equal(seq["topk_ids"][:, 0], logits.argmax(-1))


def test_hot_tokens_and_split(built):
    data = FeatureData(built)
    counts = torch.zeros(data.vocab_size, dtype=torch.long)
    for i in range(len(data)):
        s = data[i]
        counts += torch.bincount(s["input_ids"][1:][s["loss_mask"][:-1]], minlength=data.vocab_size)
    assert torch.equal(data.token_counts(), counts)
    hot = data.hot_tokens(10)
    assert hot.shape == (10,) and bool((counts[hot][:-1] >= counts[hot][1:]).all())
    assert hot.tolist() == read_manifest(built)["top_tokens"][:10]
    train, val = data.split(val_fraction=0.34)
    assert len(val) == 1 and sorted(train + val) == list(range(3)) and data.split(val_fraction=0.34) == (train, val)
    with pytest.raises(UserError):
        data.hot_tokens(data.vocab_size + 1)


# ---------------------------------------------------------------- resume and target checks

def test_resume_rebuilds_only_missing_or_broken_shards(built, tmp_path, fake_prompts):
    out = tmp_path / "copy"
    shutil.copytree(built, out)
    shards = sorted(out.glob("shard-*.safetensors"))
    # clone: load_file may map the file, which is about to be overwritten in place
    before = {p.name: (p.stat().st_mtime_ns, {k: v.clone() for k, v in load_file(p).items()}) for p in shards}
    shards[1].unlink()
    shards[2].write_bytes(b"not a safetensors file")  # unreadable: rebuilt too
    build_data(_config(out), target=tiny_target("tiny-llava"))
    for p in shards:
        assert p.is_file()
        tensors = load_file(p)
        assert set(tensors) == set(before[p.name][1])
        assert all(torch.equal(tensors[k], before[p.name][1][k]) for k in tensors), p.name
    assert shards[0].stat().st_mtime_ns == before[shards[0].name][0], "an intact shard was rewritten"
    assert read_manifest(out)["complete"] and len(FeatureData(out)) == 3


def test_a_changed_prompt_list_keeps_the_shards_whose_prompts_stay(tmp_path, monkeypatch):
    """More prompts: the shards holding the same prompts are kept as they are, the new ones built; fewer: the shards
    past the list's end are deleted. The pipeline leaves a folder whose prompts changed to this (nas.pipeline._complete)
    and removes one built with other settings."""
    from nas.pipeline import _complete

    items = [PromptItem(f"sharegpt:p{i}_0", f"Say something about {i}.", None, f"Something about {i}.")
             for i in range(5)]
    monkeypatch.setattr(data_mod, "parse_prompt_spec", lambda spec, split, max_chars, cache_dir: items[
        :int(spec.split(":")[1])])
    out = tmp_path / "data"
    target = tiny_target("tiny-llama")
    cfg = _config(out, target="tiny-llama", prompts="sharegpt:3", shard_size=2, max_len=40)
    with single_thread():
        build_data(cfg, target=target)
        stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.safetensors")}
        assert sorted(stamps) == ["shard-00000.safetensors", "shard-00001.safetensors"]
        more = replace(cfg, prompts="sharegpt:5")
        assert not _complete(out, more) and out.is_dir()  # prompts changed only: the folder stays
        build_data(more, target=target)
    now = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.safetensors")}
    assert len(now) == 3 and now["shard-00000.safetensors"] == stamps["shard-00000.safetensors"]  # kept
    assert now["shard-00001.safetensors"] != stamps["shard-00001.safetensors"]  # p2 -> p2, p3: built again
    assert [s["prompt_ids"] for s in read_manifest(out)["shards"]] == [[f"sharegpt:p{i}_0" for i in (0, 1)],
                                                                       [f"sharegpt:p{i}_0" for i in (2, 3)],
                                                                       ["sharegpt:p4_0"]]
    assert len(FeatureData(out)) == 5
    with single_thread():
        build_data(replace(cfg, prompts="sharegpt:2"), target=target)
    assert [p.name for p in out.glob("shard-*.safetensors")] == ["shard-00000.safetensors"]
    assert len(FeatureData(out)) == 2
    assert not _complete(out, replace(cfg, prompts="sharegpt:2", max_len=48)) and not out.exists()  # other settings


def test_a_time_budget_stops_with_the_shards_built_and_a_later_run_finishes(tmp_path, monkeypatch, caplog):
    """--time-budget-s: no shard starts once this run has spent the budget; the folder is complete and readable with
    the shards built, the manifest says how many of how many; a later run goes on, keeping the shards there, and one
    without the budget builds the rest. At least one shard is in the folder, however small the budget."""
    from nas.pipeline import _complete

    items = [PromptItem(f"sharegpt:p{i}_0", f"Say something about {i}.", None, f"Something about {i}.")
             for i in range(5)]
    monkeypatch.setattr(data_mod, "parse_prompt_spec", lambda spec, split, max_chars, cache_dir: items)
    out = tmp_path / "data"
    target = tiny_target("tiny-llama")
    cfg = _config(out, target="tiny-llama", prompts="sharegpt:5", shard_size=2, max_len=40, time_budget_s=1e-6)
    with single_thread(), caplog.at_level(logging.WARNING, logger="supernet.data"):
        build_data(cfg, target=target)
    manifest = read_manifest(out)
    assert manifest["complete"] and [s["file"] for s in manifest["shards"]] == ["shard-00000.safetensors"]
    assert manifest["budget"] == {"time_budget_s": 1e-6, "shards": 1, "of": 3, "prompts_unused": 3}
    assert manifest["runs"][-1]["stopped_by_budget"] and manifest["runs"][-1]["shards_built"] == 1
    assert "time budget is spent after 1 of 3 shards" in caplog.text
    assert [p.name for p in out.glob("shard-*.safetensors")] == ["shard-00000.safetensors"]
    assert len(FeatureData(out)) == 2 and manifest["counts"]["sequences"] == 2
    assert _complete(out, cfg)  # the pipeline reuses it as it is
    stamp = (out / "shard-00000.safetensors").stat().st_mtime_ns
    with single_thread():
        build_data(cfg, target=target)  # a shard is there and the budget is spent at once: nothing more
        assert len(read_manifest(out)["shards"]) == 1 and (out / "shard-00000.safetensors").stat().st_mtime_ns == stamp
        build_data(replace(cfg, time_budget_s=3600.0), target=target)  # a budget to spare: it goes on
        assert len(read_manifest(out)["shards"]) == 3 and "budget" not in read_manifest(out)
        build_data(replace(cfg, time_budget_s=0.0), target=target)
    manifest = read_manifest(out)
    assert "budget" not in manifest and len(FeatureData(out)) == 5
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(UserError, match="time-budget-s"):
        replace(cfg, time_budget_s=-1.0).check()


def test_a_time_budget_is_checked_before_each_shard(tmp_path, monkeypatch):
    """With shards of 10 s a 15-s budget starts shards at 0 and 10 s (two built), a 25-s one at 0, 10 and 20 s
    (three): the last shard may end past the budget, none starts after it."""
    items = [PromptItem(f"sharegpt:p{i}_0", f"Say something about {i}.", None, f"Something about {i}.")
             for i in range(8)]
    monkeypatch.setattr(data_mod, "parse_prompt_spec", lambda spec, split, max_chars, cache_dir: items)
    clock = [0.0]
    monkeypatch.setattr(data_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    real = data_mod._build_shard

    def ten_seconds(*args, **kwargs):
        real(*args, **kwargs)
        clock[0] += 10.0

    monkeypatch.setattr(data_mod, "_build_shard", ten_seconds)
    with single_thread():
        for budget, shards in ((15.0, 2), (25.0, 3)):
            out = tmp_path / f"data-{budget:g}"
            build_data(_config(out, target="tiny-llama", prompts="sharegpt:6", shard_size=2, max_len=40,
                               time_budget_s=budget), target=tiny_target("tiny-llama"))
            assert read_manifest(out)["budget"]["shards"] == shards and len(FeatureData(out)) == 2 * shards


def test_other_target_is_rejected(built, tmp_path, fake_prompts, capsys):
    other = tiny_target("tiny-llama")
    with pytest.raises(UserError, match="tiny-llava") as err:
        FeatureData(built, other)
    assert "\n" not in str(err.value)
    assert "pass --target tiny-llava" in str(err.value) and "--out" not in str(err.value)  # a reader's advice
    with pytest.raises(UserError, match="holds features of target .* use another --out"):
        build_data(_config(built, target="tiny-llama"), target=other)
    with pytest.raises(SystemExit) as exit_:
        run_cli(data_mod.main, ["--target", "tiny-llama", "--space", "tiny", "--out", str(built)])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and "tiny-llava" in lines[-1]
    with pytest.raises(UserError, match="max_len=80"):  # same target, other settings
        build_data(_config(built, max_len=70), target=tiny_target("tiny-llava"))
    with pytest.raises(UserError, match="no manifest"):
        FeatureData(tmp_path)


def test_text_target_skips_images_and_regenerates(tmp_path, fake_prompts, caplog):
    target = tiny_target("tiny-llama")
    with caplog.at_level(logging.WARNING, logger="supernet.data"):
        build_data(_config(tmp_path, target="tiny-llama", mode="regenerate", max_new_tokens=5, shard_size=4),
                   target=target)
    assert "skipping 1 image prompt" in caplog.text
    data = FeatureData(tmp_path, target)
    assert len(data) == 2
    for i, item in enumerate(TEXT_ITEMS):
        seq = data[i]
        p = int(seq["prompt_len"])
        expect = vanilla_generate(target, target.build_prompt(item.text), 5).tokens
        assert seq["input_ids"][p:].tolist() == expect  # regenerate: the target's own greedy answer


def test_image_cut_by_max_len_is_skipped(tmp_path, fake_prompts):
    target = tiny_target("tiny-llava")
    ids = target.build_prompt(ITEMS[2].text, ITEMS[2].image).input_ids[0]
    last_image = int((ids == target.image_token_id).nonzero().max())
    build_data(_config(tmp_path, max_len=last_image, entropy_layer=1), target=target)  # cuts the last image token
    m = read_manifest(tmp_path)
    assert list(m["skipped"]) == [ITEMS[2].id] and m["counts"]["sequences"] == 2


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_teacher_forcing_matches_incremental_decoding(name):
    """One forward over prompt + answer gives the logits the target has while decoding the answer
    token by token (per-token inputs extended per family: PaliGemma's answer is a causal suffix)."""
    target = tiny_target(name)
    item = PromptItem("x", "Tell me about the picture, please.", "skimage:chelsea" if target.is_vlm else None, None)
    full, p = build_sequence(target, item, _config("unused", mode="regenerate", max_new_tokens=4, max_len=200))
    logits = target.prefill(full, all_logits=True).logits  # (T, V)
    answer = full.input_ids[0, p:].tolist()
    assert len(answer) >= 1
    step = [target.prefill(target.build_prompt(item.text, item.image)).logits[-1]]
    step += [target.step(t).logits[-1] for t in answer[:-1]]
    torch.testing.assert_close(logits[p - 1: -1], torch.stack(step), rtol=1e-4, atol=1e-4)
    assert logits[p - 1: -1].argmax(-1).tolist() == answer  # regenerate: the answer is the greedy one


# ---------------------------------------------------------------- entropy layer

def test_entropy_layer_choice_on_synthetic_entropies():
    assert candidate_layers(30) == tuple(range(2, 28))  # hidden states 2..L-3
    assert candidate_layers(2) == (1,) and candidate_layers(4) == (1, 2, 3)  # tiny: every intermediate state
    mean = torch.linspace(3.0, 4.0, 30)  # (L,) per decoder layer: rising with depth
    mean[0], mean[29] = 0.1, 0.2  # excluded ends (hidden states 1 and 30)
    mean[12] = 1.0  # decoder layer 12 -> hidden state 13
    assert choose_layer(mean) == 13
    mean[20] = 1.0  # a tie goes to the shallower layer
    assert choose_layer(mean) == 13
    ent = torch.full((30, 4), 5.0)  # (L, T)
    ent[5, 0], ent[9, 1], ent[0, 2], ent[26, 2], ent[26, 3] = 0.5, 0.5, 0.1, 0.3, 0.4
    assert per_token_layers(ent).tolist() == [6, 10, 27, 27]
    a, b = torch.full((30, 10), 2.0), torch.full((30, 30), 2.0)
    a[3], b[7] = 0.0, 1.0  # token-weighted: row 7 (30 tokens at 1.0) beats row 3 (10 tokens at 0.0)
    choice = calibrate([a, b])
    assert choice.tokens == 40 and choice.layer == 8
    assert math.isclose(choice.mean_entropy[3], 30 * 2.0 / 40 + 0.0) and sum(choice.per_token.values()) == 40


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_entropy_is_finite_in_low_precision(dtype):
    torch.manual_seed(0)
    target = load_target("tiny-llama", device="cpu", dtype=dtype)
    prompt = target.build_prompt("Tell me a long story about a cat who sails around the world.")
    pre = target.prefill(prompt, attention_stats=True)
    ent = pre.attn_entropy
    assert ent.dtype == torch.float32 and ent.shape == (target.num_layers, prompt.length)
    assert bool(torch.isfinite(ent).all()) and bool((ent >= 0).all())
    assert bool((ent <= math.log(prompt.length) + 1e-3).all()) and bool(torch.isfinite(pre.attn_received).all())
    assert calibrate([ent]).layer in candidate_layers(target.num_layers)


def test_calibration_prompts_are_spread_over_the_list():
    items = [PromptItem(f"sharegpt:{i}", "t", None, "a") for i in range(64)] + image_prompts("train", 8)
    picked = data_mod.calibration_items(items, 8)
    assert len(set(p.id for p in picked)) == 8 and sum(p.image is not None for p in picked) == 1
    assert data_mod.calibration_items(items[:3], 8) == items[:3]


def test_features_on_the_fly_needs_the_entropy_layer():
    with pytest.raises(UserError, match="entropy_layer"):
        features_on_the_fly(tiny_target("tiny-llava"), ITEMS[0], replace(_config("x"), entropy_layer=None))


@pytest.mark.parametrize("manifest", ["[1, 2]", '{"format": "x"}', '{"target": [], "shards": []}'])
def test_a_damaged_manifest_is_one_line(tmp_path, manifest):
    (tmp_path / "manifest.json").write_text(manifest)
    with pytest.raises(UserError, match="not a data manifest"):
        FeatureData(tmp_path)


def test_a_chat_item_is_answered_after_its_history():
    """A chat prompt (PromptItem.history) reaches the data: its sequence holds the earlier exchange before the
    message, and the regenerated answer is the target's greedy continuation of that whole prompt."""
    target = tiny_target("tiny-llama")
    item = PromptItem("chat:aaa_0:1", "And the capital of Spain?", None, "Madrid.",
                      history=(("What is the capital of France?", "Paris."),))
    cfg = _config("unused", target="tiny-llama", mode="regenerate", max_new_tokens=4, max_len=200)
    full, p = build_sequence(target, item, cfg)
    prompt = target.build_prompt(item.text, None, item.history)
    assert p == prompt.length and full.input_ids[0, :p].tolist() == prompt.input_ids[0].tolist()
    assert p > target.build_prompt(item.text).length
    want = vanilla_generate(target, prompt, max_new_tokens=4).tokens
    assert full.input_ids[0, p:].tolist() == want[:full.length - p]
