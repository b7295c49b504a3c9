"""`decode.bench`: side-by-side records, the summary table and the results JSON (tiny targets, few tokens)."""

from __future__ import annotations

import json

import pytest

import decode.bench as bench
from decode.bench import BenchConfig, format_table, run_bench
from decode.datasets import PromptItem
from decode.errors import UserError
from decode.runtime import small_rows

PROMPTS = [
    PromptItem("sharegpt:a", "Repeat after me: one two three, one two three, one two", None, None),
    PromptItem("sharegpt:b", "Write a short poem about the sea.", None, None),
    PromptItem("image:coffee:0", "Describe this image in detail.", "skimage:coffee", None),
]
REQUIRED = {"config", "command", "device", "versions", "date", "summary", "per_prompt", "prompts", "target", "methods"}


def test_bench_main_writes_json_and_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "parse_prompt_spec", lambda spec, **kw: list(PROMPTS))
    out = tmp_path / "new" / "bench.json"
    assert bench.main(["--target", "tiny-llama", "--drafts", "prompt-lookup,layerskip:1", "--prompts", "sharegpt:2",
                       "--max-new-tokens", "8", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert REQUIRED <= set(res)
    assert res["config"]["drafts"] == ["prompt-lookup", "layerskip:1"] and res["config"]["max_new_tokens"] == 8
    assert set(res["versions"]) == {"python", "torch", "transformers"}
    assert res["small_rows"]["mode"] in small_rows.MODES and isinstance(res["small_rows"]["choices"], dict)
    assert res["prompts"]["count"] == 2 and res["prompts"]["skipped_image_prompts"] == 1  # text-only target
    summary = {row["method"]: row for row in res["summary"]}
    assert list(summary) == ["vanilla", "prompt-lookup", "layerskip:1"]
    assert summary["vanilla"]["speedup"] == pytest.approx(1.0) and summary["vanilla"]["identical_rate"] is None
    for name in ("prompt-lookup", "layerskip:1"):
        assert summary[name]["identical_rate"] == 1.0
        assert summary[name]["tau"] >= 1.0 and summary[name]["speedup"] > 0 and summary[name]["decode_speedup"] > 0
        assert sum(summary[name]["accept_hist"].values()) > 0
    assert len(res["per_prompt"]) == 2 * 3
    assert all(0 < r["decode_ms"] < r["wall_ms"] for r in res["per_prompt"])
    assert all(r["identical"] is True for r in res["per_prompt"] if r["method"] != "vanilla")
    table = capsys.readouterr().out
    assert "prompt-lookup" in table and "layerskip:1" in table and "speedup" in table and "100%" in table


def test_run_bench_on_a_vlm_with_images_and_sampling():
    cfg = BenchConfig(target="tiny-llava", drafts=("layerskip:1",), max_new_tokens=6, repeats=2, warmup=False,
                      tree="chain", candidates="sample", temperature=0.8, seed=3, device="cpu")
    res = run_bench(cfg, prompts=PROMPTS[1:])
    assert res["prompts"]["skipped_image_prompts"] == 0
    assert [r["has_image"] for r in res["per_prompt"]] == [False, False, True, True]
    assert all(r["repeats"] == 2 for r in res["per_prompt"])
    assert all(row["identical_rate"] is None for row in res["summary"])  # sampling: no token-wise claim
    assert res["methods"][1]["tree"]["kind"] == "chain"
    assert "layerskip:1" in format_table(res["summary"])


@pytest.mark.parametrize("cfg,match", [
    (BenchConfig(target="tiny-llama", repeats=0), "--repeats"),
    (BenchConfig(target="tiny-llama", drafts=("prompt-lookup", "prompt-lookup")), "twice"),
    (BenchConfig(target="tiny-llama", top_k=0), "--top-k"),
    (BenchConfig(target="tiny-llama", temperature=-1.0), "temperature"),
    (BenchConfig(target="tiny-llama", drafts=("layerskip:0",)), "layerskip:0"),
])
def test_bad_config_is_a_user_error(cfg, match):
    with pytest.raises(UserError, match=match):
        run_bench(cfg, prompts=PROMPTS[:1])


def test_only_image_prompts_on_a_text_target_is_an_error():
    with pytest.raises(UserError, match="no prompts"):
        run_bench(BenchConfig(target="tiny-llama", device="cpu"), prompts=PROMPTS[2:])


def test_an_interrupted_bench_keeps_its_finished_prompts(tmp_path, monkeypatch):
    """The JSON is rewritten after every prompt: stopping during prompt 2 leaves prompt 1's rows, marked incomplete."""
    monkeypatch.setattr(bench, "parse_prompt_spec", lambda spec, **kw: list(PROMPTS[:2]))
    real_measure, calls = bench.measure, []

    def measure(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # e.g. a time limit on a lent GPU
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(bench, "measure", measure)
    out = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--target", "tiny-llama", "--drafts", "prompt-lookup", "--prompts", "sharegpt:2",
                    "--max-new-tokens", "6", "--repeats", "1", "--no-warmup", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["complete"] is False and res["prompts"]["count"] == 1 and res["prompts"]["planned"] == 2
    assert {r["prompt_id"] for r in res["per_prompt"]} == {"sharegpt:a"}
    assert {row["method"] for row in res["summary"]} == {"vanilla", "prompt-lookup"}
    assert not list(tmp_path.glob("*.tmp"))
    monkeypatch.setattr(bench, "measure", real_measure)
    bench.main(["--target", "tiny-llama", "--drafts", "prompt-lookup", "--prompts", "sharegpt:2",
                "--max-new-tokens", "6", "--repeats", "1", "--no-warmup", "--out", str(out)])
    done = json.loads(out.read_text())
    assert done["complete"] is True and done["prompts"]["count"] == 2


@pytest.mark.parametrize("target", ["tiny-llama", "tiny-llava"])
def test_transformers_generate_and_lookup_rows_beside_ours(target):
    """hf-generate / hf-lookup:N run transformers' own generate in the same bench; greedy, they must emit
    exactly the vanilla tokens (a check on both sides), and their rows carry no tau (HF does not report it)."""
    cfg = BenchConfig(target=target, drafts=("hf-generate", "hf-lookup:4:2", "random:concat+lookup"),
                      max_new_tokens=10, repeats=1, warmup=False, device="cpu")
    res = run_bench(cfg, prompts=PROMPTS)
    summary = {row["method"]: row for row in res["summary"]}
    assert {"hf-generate", "hf-lookup:4:2", "random:concat+lookup"} <= set(summary)
    for name in ("hf-generate", "hf-lookup:4:2", "random:concat+lookup"):
        assert summary[name]["identical_rate"] == 1.0, name
        assert summary[name]["speedup"] > 0
    assert summary["hf-generate"]["tau"] is None and summary["random:concat+lookup"]["tau"] >= 1.0
    assert summary["hf-lookup:4:2"]["prompts"] == 2  # the image prompt is skipped for HF's lookup (Method.supports)
    assert "hf-lookup:4:2" in format_table(res["summary"])


def test_compiled_transformers_generate_is_identical_and_compiles_once():
    """hf-compiled (static cache + torch.compile, inductor on this CPU): the compiled vanilla baseline emits
    the vanilla tokens on prompts of different lengths, an image prompt included, from one compiled step
    graph (the prefill is not compiled, the cache keeps its shape)."""
    from torch._dynamo.utils import counters

    cfg = BenchConfig(target="tiny-llava", drafts=("hf-compiled",), max_new_tokens=8, repeats=1, warmup=True,
                      device="cpu")
    before = counters["stats"]["unique_graphs"]
    res = run_bench(cfg, prompts=PROMPTS)
    summary = {row["method"]: row for row in res["summary"]}
    assert summary["hf-compiled"]["identical_rate"] == 1.0 and summary["hf-compiled"]["prompts"] == 3
    assert counters["stats"]["unique_graphs"] - before == 1  # compiled, and only once


def test_bad_transformers_method_is_a_user_error():
    with pytest.raises(UserError, match="hf-lookup:N"):
        run_bench(BenchConfig(target="tiny-llama", drafts=("hf-lookup:x",), device="cpu"), prompts=PROMPTS[:1])


def test_every_method_gets_its_own_row_name(tmp_path):
    """An exported training-free design beside plain prompt lookup, two checkpoint folders of one name and
    one spec given twice: every method keeps a row of its own (the summary is keyed by name), a folder's row named by
    its path, never like the prompt-lookup baseline."""
    from conftest import tiny_target

    from decode.drafts.kinds import save_training_free
    from decode.drafts.prompt_lookup import LookupSpec

    target = tiny_target("tiny-llama")
    for run in ("a", "b"):
        save_training_free(tmp_path / run / "draft", "prompt-lookup", target, LookupSpec(max_ngram=2, tree_depth=2,
                                                                                          top_k=1, total_tokens=2))
    cfg = BenchConfig(target="tiny-llama", drafts=(str(tmp_path / "a" / "draft"), "prompt-lookup:2:2",
                                                   "prompt-lookup", str(tmp_path / "b" / "draft"), "prompt-lookup",
                                                   "layerskip:1"))
    names = [m.name for m in bench._methods(cfg, target)]
    assert names == ["vanilla", str(tmp_path / "a" / "draft"), "prompt-lookup:2:2", "prompt-lookup",
                     str(tmp_path / "b" / "draft"), "prompt-lookup#5", "layerskip:1"]


def test_bench_passes_over_the_prompts_of_a_data_folder(tmp_path, monkeypatch):
    """--exclude-data: the bench runs on prompts a search's held-out data never held, and records which."""
    seen: dict = {}

    def spec(s, **kw):
        seen.update(kw)
        return [p for p in PROMPTS[:2] if p.id not in kw["exclude"]]

    monkeypatch.setattr(bench, "parse_prompt_spec", spec)
    held = tmp_path / "heldout"
    held.mkdir()
    (held / "manifest.json").write_text(json.dumps({"shards": [{"prompt_ids": ["sharegpt:a"]}]}))
    out = tmp_path / "b.json"
    assert bench.main(["--target", "tiny-llama", "--drafts", "prompt-lookup", "--prompts", "sharegpt:1",
                       "--exclude-data", str(held), "--max-new-tokens", "4", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert seen["exclude"] == {"sharegpt:a"} and res["prompts"]["excluded"] == ["sharegpt:a"]
    assert res["prompts"]["ids"] == ["sharegpt:b"]
    with pytest.raises(UserError, match="not a supernet.data folder"):
        run_bench(BenchConfig(target="tiny-llama", exclude_data=(str(tmp_path / "none"),)))


def test_decode_only_speedup_leaves_the_prefill_out():
    """The decode-phase ratio prices what a draft changes: equal prefills dilute the wall-clock speed-up."""
    from decode.bench import summarize

    def row(method, prompt, wall, prefill, hf=False):
        return {"method": method, "prompt_id": prompt, "new_tokens": 65, "wall_ms": wall, "prefill_ms": prefill,
                "decode_ms": None if hf else wall - prefill, "tau": 1.0, "speedup": None, "identical": True}
    rows = [row("vanilla", "a", 1500, 500), row("vanilla", "b", 2500, 500),
            row("d", "a", 1000, 500), row("d", "b", 1500, 500),  # decode 500 + 1000 ms against 1000 + 2000
            row("hf-generate", "a", 900, 0, hf=True), row("hf-generate", "b", 900, 0, hf=True)]
    out = {r["method"]: r for r in summarize(rows, ["vanilla", "d", "hf-generate"], greedy=True)}
    assert out["vanilla"]["decode_speedup"] == pytest.approx(1.0)
    assert out["d"]["speedup"] == pytest.approx(4000 / 2500)
    assert out["d"]["decode_speedup"] == pytest.approx(3000 / 1500)  # 64 tokens each side: the time ratio
    assert out["hf-generate"]["decode_speedup"] is None
    assert "decode-only" in format_table(list(out.values()))
