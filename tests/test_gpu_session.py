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
STAGES = ["sanity-vanilla", "sanity-draft", "trace", "bench", "profile", "validate", "bench-big-tree", "bench-fp32"]


def test_gpu_session_script_runs_quick_on_a_cpu(tmp_path):
    target = tiny_target("tiny-llava")
    draft = tmp_path / "draft"
    save_training_free(draft, "prompt-lookup", target, LookupSpec(max_ngram=2, tree_depth=2, top_k=1, total_tokens=2))
    res = tmp_path / "res"
    env = {**os.environ, "QUICK": "1", "TARGET": "tiny-llava", "HW": "cpu", "RES": str(res), "PY": sys.executable,
           "DRAFTS": f"{draft} random:concat"}
    run = subprocess.run(["bash", "benchmarks/gpu_session.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    log = (res / "session.log").read_text()
    assert run.returncode == 0, run.stderr
    done = dict(re.findall(r"\] ([\w-]+): rc=(\d+) after", log))
    assert done == {s: "0" for s in STAGES}, log[-3000:]
    for name in ("trace-tiny-llava-cpu.json", "cpu-tiny-llava.json", "bench-tiny-llava-cpu-big-tree.json",
                 "bench-tiny-llava-cpu-fp32.json"):
        assert (res / name).stat().st_size > 0, name
    bench = json.loads((res / "bench-tiny-llava-cpu-drafts.json").read_text())
    rows = {r["method"]: r for r in bench["summary"]}
    assert {"vanilla", "prompt-lookup", "random:concat", "hf-generate", "hf-compiled"} <= set(rows) and bench["complete"]
    assert all(r["identical_rate"] == 1.0 for name, r in rows.items() if name != "vanilla")
