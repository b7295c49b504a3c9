"""`python -m hwprofile.trace`: profiler summary of real vanilla and speculative decoding (tiny target)."""

from __future__ import annotations

import json

import pytest

from decode.errors import UserError
from hwprofile import trace


def test_trace_writes_both_phases_with_top_ops(tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert trace.main(["--target", "tiny-llama", "--draft", "prompt-lookup", "--max-new-tokens", "8", "--top", "5",
                       "--out", str(out), "--chrome", str(tmp_path / "tr.json")]) == 0
    doc = json.loads(out.read_text())
    assert doc["target"] == "tiny-llama" and doc["device"] == "cpu"
    van, spec = doc["result"]["vanilla"], doc["result"]["speculative"]
    for phase in (van, spec):
        assert phase["new_tokens"] == 8 and phase["wall_ms"] > 0 and phase["self_cpu_ms"] > 0
        assert 0 < len(phase["top_ops"]) <= 5
        assert all(r["op"].startswith("aten::") or r["calls"] >= 1 for r in phase["top_ops"])
        assert phase["self_device_ms"] is None  # no GPU here
    assert spec["cycles"] >= 1 and spec["tau"] >= 1.0 and spec["verify_ms"] > 0
    assert (tmp_path / "tr-vanilla.json").is_file() and (tmp_path / "tr-speculative.json").is_file()
    assert "speculative: 8 tokens" in capsys.readouterr().out


def test_trace_rejects_bad_counts():
    with pytest.raises(UserError, match="at least 1"):
        trace.main(["--target", "tiny-llama", "--draft", "prompt-lookup", "--max-new-tokens", "0"])
