"""`python -m decode.run`: vanilla / speculative / --compare output, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from decode.errors import UserError
from decode.run import main

PROMPT = "the cat sat on the mat and the cat sat on the mat and the cat"
KEYS = {"text", "new_tokens", "tau", "tokens_per_s", "accept_hist", "draft_ms", "verify_ms", "tree", "target",
        "draft", "cycles", "prefill_ms"}


def run_json(capsys, *args: str) -> dict:
    assert main(["--target", "tiny-llama", "--prompt", PROMPT, "--max-new-tokens", "12", *args, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, "--json prints exactly one line"
    return json.loads(out[0])


def test_compare_prompt_lookup_is_identical_for_greedy(capsys):
    out = run_json(capsys, "--draft", "prompt-lookup", "--compare", "--repeats", "2")
    assert KEYS | {"vanilla_tokens_per_s", "speedup", "identical"} <= set(out)
    assert out["identical"] is True
    assert out["draft"] == "prompt-lookup" and out["target"] == "tiny-llama" and out["mode"] == "speculative"
    assert out["tree"] == {"kind": "dynamic", "candidates": "topk", "tree_depth": 8, "top_k": 1, "total_tokens": 8}
    assert out["speedup"] == pytest.approx(out["tokens_per_s"] / out["vanilla_tokens_per_s"])
    assert out["repeats"] == 2 and out["new_tokens"] == out["vanilla_new_tokens"]
    assert sum(out["accept_hist"].values()) == out["cycles"]
    assert out["tau"] == pytest.approx((out["new_tokens"] - 1) / out["cycles"])


def test_layerskip_with_tree_overrides(capsys):
    out = run_json(capsys, "--draft", "layerskip:1", "--tree-depth", "3", "--top-k", "2", "--total-tokens", "5")
    assert KEYS <= set(out) and "speedup" not in out
    assert out["draft"] == "layerskip:1"
    assert out["tree"] == {"kind": "dynamic", "candidates": "topk", "tree_depth": 3, "top_k": 2, "total_tokens": 5}
    assert out["mean_tree_size"] <= 6 and 1 <= out["new_tokens"] <= 12


def test_image_on_tiny_llava_compare(capsys):
    assert main(["--target", "tiny-llava", "--prompt", "Describe the image.", "--image", "skimage:coffee",
                 "--draft", "layerskip:1", "--compare", "--repeats", "1", "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] is True and out["target"] == "tiny-llava"
    assert out["prompt_tokens"] > 8  # the image tokens are in the prompt


def test_sampling_compare_reports_identical_as_null(capsys):
    out = run_json(capsys, "--draft", "layerskip:1", "--tree", "static:2,1", "--candidates", "sample",
                   "--temperature", "0.9", "--seed", "1", "--compare", "--repeats", "1")
    assert out["identical"] is None and out["tree"]["branching"] == [2, 1]
    assert out["sampling"] == {"temperature": 0.9, "top_p": 1.0, "seed": 1}


def test_vanilla_and_text_mode(capsys):
    out = run_json(capsys)
    assert out["mode"] == "vanilla" and out["draft"] is None and out["tau"] == 1.0
    assert main(["--target", "tiny-llama", "--prompt", PROMPT, "--max-new-tokens", "6", "--draft", "prompt-lookup",
                 "--compare", "--repeats", "1"]) == 0
    cap = capsys.readouterr()
    summary = cap.err.strip().splitlines()
    assert len(summary) == 1 and "tau" in summary[0] and "speedup" in summary[0] and "identical" in summary[0]
    assert cap.out.endswith("\n") and not cap.out.startswith("{\"target\"")


@pytest.mark.parametrize("args,match", [
    (["--draft", "no-such-draft"], "unknown draft"),
    (["--draft", "layerskip:0"], "layerskip:0"),
    (["--draft", "random:nope"], "random:nope"),
    (["--draft", "prompt-lookup", "--top-k", "0"], "--top-k"),
    (["--draft", "prompt-lookup", "--total-tokens", "0"], "--total-tokens"),
    (["--draft", "prompt-lookup", "--tree-depth", "-1"], "--tree-depth"),
    (["--draft", "prompt-lookup", "--tree", "static:2,x"], "static"),
    (["--draft", "layerskip:1", "--candidates", "sample"], "chain or static"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top-p"),
    (["--vanilla", "--draft", "prompt-lookup"], "--vanilla and --draft"),
    (["--compare"], "--compare needs"),
    (["--top-k", "2"], "need a --draft"),
    (["--draft", "prompt-lookup", "--compare", "--repeats", "0"], "--repeats"),
])
def test_bad_input_raises_one_line_user_error(args, match):
    with pytest.raises(UserError, match=match) as err:
        main(["--target", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "4", *args])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("args", [["--draft", "layerskip:0"], ["--vanilla", "--draft", "prompt-lookup"]])
def test_cli_exit_code_and_one_stderr_line(args):
    proc = subprocess.run([sys.executable, "-m", "decode.run", "--target", "tiny-llama", "--prompt", "hi", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert proc.stdout == ""
