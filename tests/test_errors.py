"""Bad input gets one clear line, never a traceback or a silent wrong answer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_target
from PIL import Image

from decode.errors import UserError
from decode.loop.sampling import SamplingConfig
from decode.run import main as run_main
from decode.targets.loader import load_target

ROOT = Path(__file__).resolve().parents[1]


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


def _exported_draft(tmp_path):
    from decode.drafts import make_draft

    target = tiny_target("tiny-llama")
    make_draft("random:concat", target).model.save_pretrained(tmp_path / "d", target)
    return target, tmp_path / "d"


@pytest.mark.parametrize("config", ["{not json", "[1, 2]", '{"format": "x"}', '{"arch": [1], "dims": {}, "target": {}}',
                                    '{"arch": 1, "dims": 1, "target": 1}'])
def test_bad_draft_config_is_one_line(tmp_path, config):
    from decode.drafts import make_draft

    target, d = _exported_draft(tmp_path)
    fingerprint = json.loads((d / "draft_config.json").read_text())["target"]
    if config.startswith('{"arch"'):  # right target, wrong shapes of arch/dims
        config = json.dumps({"arch": [1], "dims": {}, "target": fingerprint})
    (d / "draft_config.json").write_text(config)
    with pytest.raises(UserError, match="draft_config.json|re-export"):
        make_draft(str(d), target)
    with pytest.raises(UserError, match="draft_config.json|re-export"):  # the CLI's path, printed as one line
        run_main(["--target", "tiny-llama", "--draft", str(d), "--prompt", "hi", "--max-new-tokens", "2"])


@pytest.mark.parametrize("payload", [b"", b"garbage" * 10, None])
def test_bad_draft_weights_are_one_line(tmp_path, payload):
    from decode.drafts import make_draft

    target, d = _exported_draft(tmp_path)
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100] if payload is None else payload)  # None: truncated
    with pytest.raises(UserError, match="safetensors"):
        make_draft(str(d), target)
    with pytest.raises(UserError, match="safetensors"):  # the CLI prints it as one `error:` line (run_cli)
        run_main(["--target", "tiny-llama", "--draft", str(d), "--prompt", "hi", "--max-new-tokens", "2"])


def test_bad_device_and_infinite_temperature():
    from decode.targets.loader import pick_device

    with pytest.raises(UserError, match="unknown device 'tpu'"):
        pick_device("tpu")
    for name in ("mps", "meta"):  # torch parses them; the decoding loop does not run there
        with pytest.raises(UserError, match=f"device '{name}' is not supported"):
            pick_device(name)
    with pytest.raises(UserError, match="finite"):
        SamplingConfig(temperature=float("inf"))


@pytest.mark.parametrize("flag,value", [("--ckpt-every", "0"), ("--lr", "-1"), ("--threads", "-2"),
                                        ("--autocast", "fp8")])
def test_bad_training_flags(tmp_path, flag, value):
    from supernet.train import main as train_main

    with pytest.raises(UserError, match=flag):
        train_main(["--target", "tiny-llama", "--data", str(tmp_path), "--out", str(tmp_path / "o"), flag, value])


def test_max_new_tokens_beyond_the_context_is_refused():
    from decode.drafts import PromptLookupDraft
    from decode.loop.speculative import speculative_generate
    from decode.loop.vanilla import vanilla_generate

    target = tiny_target("tiny-llama")
    prompt = target.build_prompt("hello there")
    limit = target.text_config.max_position_embeddings
    for n in (limit, 10**9):
        with pytest.raises(UserError, match="context"):
            vanilla_generate(target, prompt, n)
        with pytest.raises(UserError, match="context"):
            speculative_generate(target, PromptLookupDraft(), prompt, n)
    assert len(vanilla_generate(target, prompt, 4).tokens) <= 4


def test_bad_profile_files_are_one_line(tmp_path):
    from hwprofile.latency import LatencyModel
    from hwprofile.schema import FORMAT

    cases = {"list.json": "[1, 2]", "keys.json": json.dumps({"format": FORMAT, "hardware": "cpu"}),
             "tables.json": json.dumps({"format": FORMAT, "hardware": "cpu", "predicted": False, "device": {},
                                        "versions": {}, "dtype": "float32", "runtime": "eager", "date": "",
                                        "target": {}, "space": {}, "config": {}, "grids": {}, "tables": [1]})}
    complete = json.loads((ROOT / "profiles" / "cpu-smolvlm-135m.json").read_text())
    cases["target.json"] = json.dumps({**complete, "target": ["x"]})  # every key, wrong types
    cases["device.json"] = json.dumps({**complete, "device": "cpu"})
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(UserError, match=f"profile '.*{name}'"):
            LatencyModel.load(tmp_path / name)
    with pytest.raises(UserError, match="is a directory"):
        LatencyModel.load(tmp_path)



def test_validate_checks_its_output_before_measuring(tmp_path):
    """hwprofile.validate runs minutes of real cycles: an --out it cannot write is refused first, before
    the target even loads."""
    from hwprofile import validate

    (tmp_path / "afile").write_text("x")
    profile = str(ROOT / "profiles" / "cpu-smolvlm-135m.json")
    for out in (tmp_path / "afile" / "v.json", tmp_path):
        with pytest.raises(UserError, match="--out"):
            validate.main(["--profile", profile, "--out", str(out)])
