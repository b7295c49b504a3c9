"""Bad input gets one clear line, never a traceback or a silent wrong answer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from PIL import Image

from conftest import tiny_target
from decode.errors import UserError
from decode.loader import load_target
from decode.run import main as run_main
from decode.sampling import SamplingConfig


def test_unknown_preset_lists_presets():
    with pytest.raises(UserError, match="tiny-llava"):
        load_target("no-such-model")


def test_missing_dir_and_non_hf_dir(tmp_path):
    with pytest.raises(UserError, match="no such directory"):
        load_target(str(tmp_path / "absent"))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(UserError, match="not a Hugging Face model directory"):
        load_target(str(tmp_path))


def test_image_on_text_target(tmp_path):
    target = tiny_target("tiny-llama")
    with pytest.raises(UserError, match="text-only"):
        target.build_prompt("describe", "skimage:astronaut")


def test_unreadable_and_missing_image(tmp_path):
    target = tiny_target("tiny-llava")
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(UserError, match="cannot read image"):
        target.build_prompt("describe", str(bad))
    with pytest.raises(UserError, match="does not exist"):
        target.build_prompt("describe", str(tmp_path / "nope.jpg"))
    good = tmp_path / "ok.png"
    Image.new("RGB", (40, 30), "red").save(good)
    assert target.build_prompt("describe", str(good)).has_image


def test_empty_prompt_and_bad_limits():
    target = tiny_target("tiny-llama")
    with pytest.raises(UserError, match="empty"):
        target.build_prompt("   ")
    with pytest.raises(UserError, match="max-new-tokens"):
        run_main(["--target", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "0"])
    with pytest.raises(UserError, match="temperature"):
        SamplingConfig(temperature=-1)
    with pytest.raises(UserError, match="top-p"):
        SamplingConfig(temperature=1, top_p=1.5)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "decode.run", *args], capture_output=True, text=True, timeout=300)


def test_cli_error_is_one_line_without_traceback():
    res = _cli("--target", "no-such-model", "--prompt", "hi")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown target 'no-such-model'")
    assert "Traceback" not in res.stderr


def test_cli_json_on_tiny_vlm():
    res = _cli("--target", "tiny-llava", "--image", "skimage:coffee", "--prompt", "what is this?",
               "--max-new-tokens", "5", "--json", "--seed", "1", "--temperature", "0.8")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert {"text", "new_tokens", "tokens_per_s"} <= set(out)
    assert 1 <= out["new_tokens"] <= 5 and out["tokens_per_s"] > 0


def test_every_bundled_photo_loads():
    from decode.images import BUNDLED_PHOTOS, bundled_photo

    for name in BUNDLED_PHOTOS:
        assert min(bundled_photo(name).size) > 100
    with pytest.raises(UserError, match="unknown bundled photo"):
        bundled_photo("moon-landing")
