"""decode.answers: the target's own short answers for the corpus (batched, resumable, excluding prompts that have
answers elsewhere), read by decode.corpus as own answers and built by the pipeline's answers stage."""

from __future__ import annotations

import json

import pytest
from conftest import single_thread, tiny_target

import decode.loop.batched as batched_mod
from decode.answers import CONTEXT, AnswersConfig, build_answers, main, read_answers, read_manifest
from decode.datasets import parse_prompt_spec
from decode.errors import UserError
from decode.loop.vanilla import vanilla_generate


def _config(tmp_path, **kw) -> AnswersConfig:
    base = dict(target="tiny-llama", prompts="sharegpt:6", out=str(tmp_path / "answers"), max_prompt_tokens=24,
                max_new_tokens=6, batch=2, window=4, device="cpu", dtype="float32")
    return AnswersConfig(**{**base, **kw})


def _expected(target, cfg: AnswersConfig, exclude=frozenset()) -> dict[str, list[int]]:
    """Each prompt's answer generated alone (unbatched greedy), after the capped prompt's last CONTEXT tokens."""
    out = {}
    for it in parse_prompt_spec(cfg.prompts, split="train", max_chars=cfg.max_prompt_chars, exclude=exclude):
        prompt = target.build_prompt(it.text).tail(cfg.max_prompt_tokens)
        out[it.id] = prompt.input_ids[0, -CONTEXT:].tolist() + vanilla_generate(target, prompt,
                                                                                 cfg.max_new_tokens).tokens
    return out


def _by_id(folder) -> dict[str, list[int]]:
    manifest = read_manifest(folder)
    ids = [i for c in manifest["chunks"] for i in c["prompt_ids"]]
    return dict(zip(ids, read_answers(folder)))


def test_answers_are_the_targets_greedy_answers_after_the_prompts_tail(tmp_path):
    """Batched answers (tiny target, fp32) equal the answers generated one prompt at a time; long prompts are cut
    to their last max_prompt_tokens tokens; one file per batch, prompts sorted by length within each window of
    the spec's order."""
    target = tiny_target("tiny-llama")
    cfg = _config(tmp_path)
    with single_thread():
        out = build_answers(cfg, target=target)
        expected = _expected(target, cfg)
    manifest = read_manifest(out)
    assert [len(c["prompt_ids"]) for c in manifest["chunks"]] == [2, 2, 2]
    assert all(c["complete"] for c in manifest["chunks"]) and manifest["content"] == cfg.content()
    ids = [it.id for it in parse_prompt_spec(cfg.prompts, split="train")]
    order = [i for c in manifest["chunks"] for i in c["prompt_ids"]]
    assert set(order[:4]) == set(ids[:4]) and order[4:] == ids[4:]  # the first window, then the second
    got = _by_id(out)
    assert got == expected and len(got) == 6
    assert any(len(target.build_prompt(it.text).input_ids[0]) > cfg.max_prompt_tokens
               for it in parse_prompt_spec(cfg.prompts, split="train"))  # the cap is exercised


def test_image_prompts_are_answered_whole_one_at_a_time_in_batches_of_their_own(tmp_path):
    """images:N on a VLM: each image prompt's answer is its greedy answer (whole prompt, image included), image
    prompts never share a batch with text ones, the spec's order of windows holds; a text-only target refuses them."""
    target = tiny_target("tiny-smolvlm")
    cfg = _config(tmp_path, target="tiny-smolvlm", prompts="sharegpt:3,images:3", batch=4, window=8)
    with single_thread():
        out = build_answers(cfg, target=target)
        items = parse_prompt_spec(cfg.prompts, split="train", max_chars=cfg.max_prompt_chars)
        expected = {}
        for it in items:
            prompt = target.build_prompt(it.text).tail(cfg.max_prompt_tokens) if it.image is None else \
                target.build_prompt(it.text, it.image)
            expected[it.id] = prompt.input_ids[0, -CONTEXT:].tolist() + vanilla_generate(
                target, prompt, cfg.max_new_tokens).tokens
    manifest = read_manifest(out)
    kinds = [{i.startswith("image:") for i in c["prompt_ids"]} for c in manifest["chunks"]]
    assert kinds == [{False}, {True}]  # one text batch, then one image batch
    assert _by_id(out) == expected and sum(i.startswith("image:") for i in expected) == 3
    with pytest.raises(UserError, match="reads no images"):
        build_answers(_config(tmp_path, prompts="images:2", out=str(tmp_path / "b")), target=tiny_target("tiny-llama"))


def test_an_interrupted_build_resumes_at_its_first_unfinished_chunk(tmp_path, monkeypatch):
    """A kill in the third batch keeps the first two batches' files; the rerun answers only the rest and ends
    with the answers of an uninterrupted build."""
    target = tiny_target("tiny-llama")
    cfg = _config(tmp_path)
    real = batched_mod.batch_greedy
    calls: list[int] = []

    def dies_on_third_batch(tgt, prompts, max_new):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(tgt, prompts, max_new)

    monkeypatch.setattr(batched_mod, "batch_greedy", dies_on_third_batch)
    with single_thread(), pytest.raises(KeyboardInterrupt):
        build_answers(cfg, target=target)
    manifest = read_manifest(cfg.out)
    assert [c["complete"] for c in manifest["chunks"]] == [True, True, False]
    first = (tmp_path / "answers" / manifest["chunks"][0]["file"]).stat().st_mtime_ns
    calls.clear()
    monkeypatch.setattr(batched_mod, "batch_greedy", lambda tgt, p, n: (calls.append(len(p)), real(tgt, p, n))[1])
    with single_thread():
        build_answers(cfg, target=target)
        expected = _expected(target, cfg)
    assert calls == [2]  # only the third batch
    assert (tmp_path / "answers" / manifest["chunks"][0]["file"]).stat().st_mtime_ns == first
    assert _by_id(cfg.out) == expected


def test_a_time_budget_stops_after_the_chunk_that_spends_it_and_a_rerun_goes_on(tmp_path, monkeypatch):
    """--minutes: the first batch always runs, the rest waits once the budget is spent (the manifest says so); a
    rerun with the same budget answers nothing more, one without a budget finishes the prompts."""
    target = tiny_target("tiny-llama")
    real = batched_mod.batch_greedy
    calls: list[int] = []
    monkeypatch.setattr(batched_mod, "batch_greedy", lambda tgt, p, n: (calls.append(len(p)), real(tgt, p, n))[1])
    tight = _config(tmp_path, time_budget_s=1e-6)
    with single_thread():
        build_answers(tight, target=target)
        manifest = read_manifest(tight.out)
        assert manifest["budget_spent"] and [c["complete"] for c in manifest["chunks"]] == [True, False, False]
        assert calls == [2] and len(read_answers(tight.out)) == 2 and manifest["spent_s"] > 0
        ids = parse_prompt_spec(tight.prompts, split="train")
        assert set(manifest["chunks"][0]["prompt_ids"]) <= {it.id for it in ids[:4]}  # the spec's first window
        calls.clear()
        build_answers(tight, target=target)
        assert calls == [] and len(read_answers(tight.out)) == 2
        build_answers(_config(tmp_path), target=target)
        assert calls == [2, 2] and _by_id(tight.out) == _expected(target, tight)
    with pytest.raises(UserError, match="--minutes must be >= 0"):
        build_answers(_config(tmp_path, time_budget_s=-60), target=target)


def test_excluded_prompts_are_passed_over_and_bad_reruns_are_refused(tmp_path):
    """--exclude skips the prompts another answers folder has answered; a rerun with other settings or another
    target is one clear error."""
    target = tiny_target("tiny-llama")
    with single_thread():
        first = build_answers(_config(tmp_path, prompts="sharegpt:3", out=str(tmp_path / "a")), target=target)
        second = build_answers(_config(tmp_path, prompts="sharegpt:3", out=str(tmp_path / "b"),
                                       exclude=(str(first),)), target=target)
    a, b = set(_by_id(first)), set(_by_id(second))
    assert len(a) == len(b) == 3 and not a & b
    with pytest.raises(UserError, match="other settings"):
        build_answers(_config(tmp_path, prompts="sharegpt:3", out=str(first), max_new_tokens=7), target=target)
    with pytest.raises(UserError, match="another target"):
        build_answers(_config(tmp_path, prompts="sharegpt:3", out=str(first)), target=tiny_target("tiny-qwen2"))
    with pytest.raises(UserError, match="not a folder"):
        build_answers(_config(tmp_path, exclude=(str(tmp_path / "nowhere"),)), target=target)
    with pytest.raises(UserError, match="--batch must be >= 1"):
        build_answers(_config(tmp_path, batch=0), target=target)


def test_the_corpus_counts_an_answers_folder_as_the_targets_own_answers(tmp_path):
    """decode.corpus --data takes an answers folder: its answers are corpus items counted OWN_WEIGHT times."""
    from safetensors.torch import save_file

    from decode.answers import FORMAT, MANIFEST
    from decode.corpus import OWN_WEIGHT, build_corpus, data_items, data_weight

    folder = tmp_path / "answers"
    folder.mkdir()
    import torch

    save_file({"tokens": torch.tensor([1, 2, 6, 5], dtype=torch.int32), "offsets": torch.tensor([0, 4])},
              str(folder / "chunk-00000.safetensors"))
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "chunks": [
        {"file": "chunk-00000.safetensors", "prompt_ids": ["p"], "complete": True}]}))
    assert data_items(folder) == [[1, 2, 6, 5]] and data_weight(folder) == OWN_WEIGHT
    teacher = tmp_path / "teacher"  # "1 2" followed by 4, in two sequences counted once each
    teacher.mkdir()
    save_file({"input_ids": torch.tensor([1, 2, 4, 1, 2, 4]), "offsets": torch.tensor([0, 3, 6]),
               "prompt_len": torch.tensor([0, 0])}, str(teacher / "shard-00000.safetensors"))
    target = tiny_target("tiny-llama")
    corpus = build_corpus(target, 0, [teacher, folder], min_count=1)
    assert corpus.next_of([1, 2]) == 6 and corpus.runner_up([1, 2]) == 4  # 8 against 2
    assert corpus.info.sources[1] == f"{folder} (1 sequences x{OWN_WEIGHT})"


def test_the_pipeline_answers_stage_builds_reuses_and_rebuilds_on_new_settings(tmp_path, monkeypatch):
    """nas.pipeline.answers_stage follows the scale's nas.answers: built once, reused, answered again when the
    settings change; a scale without nas.answers has none."""
    import nas.pipeline as pipeline

    target = tiny_target("tiny-llama")
    settings = {"prompts": "sharegpt:3", "max_new_tokens": 4, "max_prompt_tokens": 16, "batch": 2, "window": 2}
    monkeypatch.setattr(pipeline, "nas_defaults", lambda scale: {"answers": dict(settings)})
    cfg = pipeline.PipelineConfig(target="tiny-llama", root=str(tmp_path / "run"), device="cpu", dtype="float32")
    with single_thread():
        out = pipeline.answers_stage(cfg, target)
        assert len(read_answers(out)) == 3
        stamp = (out / "manifest.json").stat().st_mtime_ns
        assert pipeline.answers_stage(cfg, target) == out and (out / "manifest.json").stat().st_mtime_ns == stamp
        settings["max_new_tokens"] = 5
        out = pipeline.answers_stage(cfg, target)
    assert read_manifest(out)["content"]["max_new_tokens"] == 5
    assert all(len(a) <= CONTEXT + 5 for a in read_answers(out)) and any(len(a) > CONTEXT + 4
                                                                         for a in read_answers(out))
    monkeypatch.setattr(pipeline, "nas_defaults", lambda scale: {"answers": None})
    assert pipeline.answers_stage(cfg, target) is None


def test_cli_writes_answers_and_rejects_bad_flags(tmp_path, capsys):
    with single_thread():
        assert main(["--target", "tiny-llama", "--device", "cpu", "--prompts", "sharegpt:2", "--max-new-tokens", "3",
                     "--out", str(tmp_path / "a")]) == 0
    assert "2 answers" in capsys.readouterr().out
    with pytest.raises(UserError, match="--max-new-tokens must be >= 1"):
        main(["--target", "tiny-llama", "--max-new-tokens", "0", "--out", str(tmp_path / "b")])
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="existing file"):
        main(["--target", "tiny-llama", "--out", str(tmp_path / "file")])


@pytest.mark.parametrize("scale", ["smoke", "demo", "cpu", "full"])
def test_every_scales_answers_section_is_a_valid_answers_config(scale):
    """A scale file's nas.answers holds AnswersConfig fields only, with values its check accepts."""
    from nas.pipeline import nas_defaults

    settings = nas_defaults(scale).get("answers")
    if settings is None:
        assert scale in ("smoke", "full")  # the scales that answer no extra prompts
        return
    cfg = AnswersConfig(**settings)
    cfg.check()
    assert cfg.time_budget_s > 0 and cfg.prompts.startswith("sharegpt:")


def test_a_changed_spec_keeps_the_answers_it_still_asks_for(tmp_path, monkeypatch):
    """The bug this guards: a spec that lost its image prompts shifted every window, no batch matched the new plan,
    the earlier runs' time counted as spent and the folder ended with no answers at all (a corpus built from it then
    had none). Now each finished batch whose prompts the new spec still asks for is kept, whatever its file; only the
    rest are answered; a dropped batch's answers go; the kept batches' share of the earlier time counts."""
    target = tiny_target("tiny-smolvlm")
    first = _config(tmp_path, target="tiny-smolvlm", prompts="images:2,sharegpt:4", batch=2, window=4)
    with single_thread():
        build_answers(first, target=target)
    old = read_manifest(first.out)
    kept = [c for c in old["chunks"] if not any(i.startswith("image:") for i in c["prompt_ids"])]
    assert len(old["chunks"]) == 3 and len(kept) == 2  # window [img, img, s1, s2]: a text and an image batch; [s3, s4]
    stamps = {c["file"]: (tmp_path / "answers" / c["file"]).stat().st_mtime_ns for c in kept}
    old.update(spent_s=600.0, budget_spent=True)  # as if the first run had spent 10 minutes: 400 s on the text
    (tmp_path / "answers" / "manifest.json").write_text(json.dumps(old))
    real, calls = batched_mod.batch_greedy, []
    monkeypatch.setattr(batched_mod, "batch_greedy", lambda tgt, p, n: (calls.append(len(p)), real(tgt, p, n))[1])
    second = _config(tmp_path, target="tiny-smolvlm", prompts="sharegpt:6", batch=2, window=4, time_budget_s=500.0)
    with single_thread():
        build_answers(second, target=target)
        expected = _expected(target, second)
    assert calls == [2]  # s5 and s6 only: 400 of the 500 s were left
    manifest = read_manifest(second.out)
    assert manifest["chunks"][:2] == kept and all(c["complete"] for c in manifest["chunks"])
    assert 400.0 <= manifest["spent_s"] < 450.0 and not manifest["budget_spent"]
    assert all((tmp_path / "answers" / f).stat().st_mtime_ns == t for f, t in stamps.items())
    assert _by_id(second.out) == expected  # no image answer left, every text one the unbatched greedy one
    assert sorted(p.name for p in (tmp_path / "answers").glob("chunk-*")) == sorted(c["file"] for c in
                                                                                    manifest["chunks"])
