"""hwprofile.validate on a tiny profile: per-sample predicted vs measured JSON; refusals."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import single_thread

from decode.errors import UserError
from hwprofile.profile import main as profile_main
from hwprofile.validate import main as validate_main


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("val") / "cpu-tiny-llama.json"
    with single_thread():
        profile_main(["--target", "tiny-llama", "--quick", "--threads", "1", "--out", str(out), "--no-plot"])
    return out


def test_validate_writes_per_sample_rows_and_mape(tiny_profile, tmp_path, capsys):
    out = tmp_path / "v.json"
    assert validate_main(["--profile", str(tiny_profile), "--samples", "3", "--cycles", "2", "--warmup", "1",
                          "--prompts", "fixed", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 3
    for row in doc["rows"]:
        assert row["measured_ms"] > 0 and row["predicted_ms"] > 0
        assert row["error_pct"] == pytest.approx(100 * (row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"])
        assert row["arch"]["fusion"] in ("concat", "cross", "hybrid") and row["tau"] >= 1
    assert doc["summary"]["mape_pct"] >= 0  # its value depends on machine noise: not asserted
    assert doc["hardware"] == "cpu" and doc["target"] == "tiny-llama"
    assert "MAPE" in capsys.readouterr().out


def test_validate_default_output_is_next_to_the_profile(tiny_profile):
    assert validate_main(["--profile", str(tiny_profile), "--samples", "1", "--cycles", "1", "--warmup", "1",
                          "--prompts", "fixed"]) == 0
    assert tiny_profile.with_name("cpu-tiny-llama.validate.json").is_file()


def test_validate_refuses_predicted_and_foreign_profiles(tiny_profile, tmp_path):
    raw = json.loads(tiny_profile.read_text())
    predicted = tmp_path / "pred.json"
    predicted.write_text(json.dumps({**raw, "predicted": True}))
    with pytest.raises(UserError, match="predicted"):
        validate_main(["--profile", str(predicted), "--samples", "1", "--prompts", "fixed"])
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({**raw, "device": {**raw["device"], "name": "Some Other CPU"}}))
    with pytest.raises(UserError, match="measured on"):
        validate_main(["--profile", str(foreign), "--samples", "1", "--prompts", "fixed"])
    other_target = tmp_path / "other.json"
    fp = {**raw["target"]["fingerprint"], "config_hash": "0" * 16}
    other_target.write_text(json.dumps({**raw, "target": {**raw["target"], "fingerprint": fp}}))
    with pytest.raises(UserError, match="fingerprint"):
        validate_main(["--profile", str(other_target), "--samples", "1", "--prompts", "fixed"])
    if not torch.cuda.is_available():
        gpu = tmp_path / "gpu.json"
        gpu.write_text(json.dumps({**raw, "hardware": "h200", "device": {**raw["device"], "kind": "cuda",
                                                                           "hardware": "h200", "name": "NVIDIA H200"}}))
        with pytest.raises(UserError, match="GPU"):
            validate_main(["--profile", str(gpu), "--samples", "1", "--prompts", "fixed"])
    with pytest.raises(UserError, match="does not exist"):
        validate_main(["--profile", str(tmp_path / "absent.json")])
