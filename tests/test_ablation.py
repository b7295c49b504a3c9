"""nas.ablation: variants at equal wall-clock, the --budgets scaling curve (one whole run per budget, CSV for
benchmarks/plot_scaling.py), resume from the result JSON, and one-line errors for bad budget lists."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import single_thread, tiny_target

from decode.errors import UserError
from nas import ablation
from supernet.data import DataConfig, build_data

TARGET = "tiny-llava"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("abl") / "data"
    with single_thread():
        build_data(DataConfig(target=TARGET, prompts="sharegpt:4", space="tiny", mode="regenerate", max_len=160,
                              max_new_tokens=16, max_prompt_chars=130, topk=16, out=str(out)), target=tiny_target(TARGET))
    return out


def _argv(data_dir, tmp_path, *extra) -> list[str]:
    return ["--target", TARGET, "--device", "cpu", "--dtype", "float32", "--data", f"d={data_dir}",
            "--heldout-data", str(data_dir), "--space", "tiny", "--tree", "2x2/4", "--heldout-sequences", "2",
            "--work", str(tmp_path / "work"), "--out", str(tmp_path / "res"), *extra]


def test_budgets_train_one_whole_run_per_budget_and_write_the_scaling_curve(data_dir, tmp_path):
    argv = _argv(data_dir, tmp_path, "--variant", "sn:n_random=1,seqs_per_step=1,warmup=1", "--budgets", "1,2.5",
                 "--scaling-csv", str(tmp_path / "scaling.csv"))
    assert ablation.main(argv) == 0
    runs = json.loads((tmp_path / "res.json").read_text())["runs"]
    assert sorted(runs) == ["sn@1s", "sn@2.5s"]
    for name, budget in (("sn@1s", 1.0), ("sn@2.5s", 2.5)):
        r = runs[name]
        assert r["variant"] == "sn" and r["budget_s"] == budget and r["train"]["time_budget_s"] == budget
        assert r["sequences"] == 2 and r["steps"] >= 1 and r["elapsed_s"] <= budget + 5
        assert 1.0 <= r["tau"]["2x2/4"] <= 3.0
    assert runs["sn@2.5s"]["steps"] > runs["sn@1s"]["steps"]  # a longer budget trains longer
    with (tmp_path / "scaling.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["curve"], float(r["budget_s"])) for r in rows] == [("sn: eagle-like", 1.0), ("sn: eagle-like", 2.5)]
    assert [float(r["tau_2x2_4"]) for r in rows] == [runs["sn@1s"]["tau"]["2x2/4"], runs["sn@2.5s"]["tau"]["2x2/4"]]
    assert "| sn@2.5s | eagle-like |" in (tmp_path / "res.md").read_text()

    # rerun: both runs are kept from the JSON, nothing retrained
    trained = tmp_path / "work" / "sn@1s" / "ablation-trained.json"
    before = trained.stat().st_mtime_ns
    assert ablation.main(argv) == 0
    assert trained.stat().st_mtime_ns == before
    assert json.loads((tmp_path / "res.json").read_text())["runs"] == runs

    # the plot script reads the curve it wrote
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plot_scaling.py"), str(tmp_path / "scaling.csv")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "scaling.png").stat().st_size > 1000


@pytest.mark.parametrize("budgets", ["", "60,-1", "1,two", "0"])
def test_bad_budget_lists_are_refused_before_any_work(budgets, tmp_path):
    with pytest.raises(UserError, match="--budgets"):
        ablation.main(["--data", "d=/nonexistent", "--heldout-data", "/nonexistent", "--variant", "x:",
                       "--budgets", budgets or ",", "--out", str(tmp_path / "r")])
