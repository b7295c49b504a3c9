"""benchmarks/gpu_session.sh runs unchanged on a CPU with QUICK=1 (the script a lent GPU runs once, with no
second try: it must not rot). A tiny VLM target; every stage must succeed and leave its results."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import tiny_target

from decode.drafts.kinds import save_training_free
from decode.drafts.prompt_lookup import LookupSpec

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["sanity-vanilla", "bench", "profile", "validate", "trace", "bench-big-tree", "bench-fp32"]


def test_gpu_session_script_runs_quick_on_a_cpu(tmp_path):
    target = tiny_target("tiny-llava")
    draft = tmp_path / "draft"
    save_training_free(draft, "prompt-lookup", target, LookupSpec(max_ngram=2, tree_depth=2, top_k=1, total_tokens=2))
    res = tmp_path / "res"
    env = {**os.environ, "QUICK": "1", "TARGET": "tiny-llava", "HW": "cpu", "RES": str(res), "PY": sys.executable,
           "DRAFTS": str(draft), "HF": "hf-generate,hf-compiled", "RUNTIMES": "eager,compiled",
           "PROFILE_RUNTIME": "eager", "TRACE": "1", "TRACE_RUNTIME": "eager", "BIG_TREE": "2 2 4",
           "BIG_RUNTIMES": "eager", "FP32": "1"}
    # compiled: the main bench only (each compiled stage costs a minute or more of inductor builds on 2 cores;
    # the compiled runtime itself is tested in test_compiled_runtime.py, here the script's flags are)
    run = subprocess.run(["bash", "benchmarks/gpu_session.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    log = (res / "session.log").read_text()
    assert run.returncode == 0, run.stderr
    done = dict(re.findall(r"\] ([\w-]+): rc=(\d+) after", log))
    assert done == {s: "0" for s in STAGES}, log[-3000:]
    for name in ("trace-tiny-llava-cpu.json", "cpu-tiny-llava-eager.json", "bench-tiny-llava-cpu-big-tree.json",
                 "bench-tiny-llava-cpu-fp32.json"):
        assert (res / name).stat().st_size > 0, name
    bench = json.loads((res / "bench-tiny-llava-cpu-drafts.json").read_text())
    rows = {r["method"]: r for r in bench["summary"]}
    ours = {name for name in rows if not name.startswith("hf-") and "@" not in name}
    assert {"vanilla", "prompt-lookup", "hf-generate", "hf-compiled"} <= set(rows) and bench["complete"]
    assert len(ours) == 3  # vanilla, the draft dir and prompt lookup
    assert {f"{name}@compiled" for name in ours} <= set(rows)  # every one of ours ran on both runtimes
    assert all(r["identical_rate"] == 1.0 for name, r in rows.items() if name != "vanilla")
    profile = json.loads((res / "cpu-tiny-llava-eager.json").read_text())
    assert profile["runtime"] == "eager"


def test_gpu_session_skips_the_stages_named_in_skip(tmp_path):
    """One session split over two device calls: the stages in SKIP do not run (and leave nothing), the rest do."""
    res = tmp_path / "res"
    skip = [s for s in STAGES if s != "sanity-vanilla"]
    env = {**os.environ, "QUICK": "1", "TARGET": "tiny-llama", "HW": "cpu", "RES": str(res), "PY": sys.executable,
           "PROFILE_RUNTIME": "eager", "SKIP": " ".join(skip)}
    run = subprocess.run(["bash", "benchmarks/gpu_session.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    log = (res / "session.log").read_text()
    assert run.returncode == 0, run.stderr
    assert dict(re.findall(r"\] ([\w-]+): rc=(\d+) after", log)) == {"sanity-vanilla": "0"}, log[-2000:]
    assert set(re.findall(r"\] ([\w-]+): skipped \(SKIP\)", log)) == {"bench", "profile"}  # validate needs a profile
    assert not list(res.glob("*.json"))
