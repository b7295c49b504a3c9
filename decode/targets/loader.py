"""Load a TargetModel from a preset name or a local HF directory."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from decode.errors import UserError
from decode.runtime.small_rows import use_small_rows
from decode.targets.attention import use_packed_gqa
from decode.targets.families import family_spec
from decode.targets.presets import is_preset, load_preset, resolve_dir
from decode.targets.target import TargetModel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def pick_device(device: str | None = None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device '{device}' requested but no CUDA GPU is visible; use --device cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"unknown device '{device}'; use cpu, cuda, cuda:N or auto") from None
    if dev.type not in ("cpu", "cuda"):  # e.g. mps, xpu, meta: torch parses them, the loop does not run there
        raise UserError(f"device '{device}' is not supported here; use cpu, cuda, cuda:N or auto")
    return dev


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 matmuls are slow there), bf16 on GPU, unless asked otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise UserError(f"unknown dtype '{dtype}'; use one of: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_target(
    target: str,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    cache_dir: Path | None = None,
    attn_implementation: str = "sdpa",
) -> TargetModel:
    """TargetModel from a preset name (configs/targets) or a local HF model directory."""
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    if is_preset(target):
        preset = load_preset(target)
        if preset.source == "tiny":
            from decode.targets.tiny import build_tiny

            model, processor = build_tiny(preset.family or "", seed=preset.seed)
            model.set_attn_implementation(attn_implementation)
            model = model.to(device=dev, dtype=dt)
            use_small_rows(model)
            use_packed_gqa(model)
            cfg = model.config
            spec = family_spec(cfg.model_type, hasattr(cfg, "vision_config"))
            return TargetModel(model, processor, spec, preset.name)
        if preset.source == "embedded":
            from decode.targets.embedded import prepare

            path = prepare(preset.name, cache_dir)
        else:
            path = resolve_dir(preset.path or "")
        return _load_dir(path, preset.name, dev, dt, attn_implementation)
    return _load_dir(resolve_dir(target), target, dev, dt, attn_implementation)


def _load_dir(path: Path, name: str, device: torch.device, dtype: torch.dtype, attn: str) -> TargetModel:
    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError) as err:
        raise UserError(f"cannot read the model config in '{path}': {str(err).splitlines()[0]}") from None
    has_vision = hasattr(cfg, "vision_config")
    spec = family_spec(cfg.model_type, has_vision)
    model_cls = AutoModelForImageTextToText if spec.is_vlm else AutoModelForCausalLM
    logger.info("loading %s (%s) from %s as %s on %s", name, cfg.model_type, path, dtype, device)
    try:
        model = model_cls.from_pretrained(path, dtype=dtype, local_files_only=True, attn_implementation=attn)
        processor = (AutoProcessor if spec.is_vlm else AutoTokenizer).from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load the model in '{path}': {str(err).splitlines()[0]}") from None
    model = model.to(device)
    use_small_rows(model)  # faster few-row linears on a CPU (decode.runtime.small_rows); vanilla and speculative alike
    use_packed_gqa(model)  # tree verification without copying the KV cache per group (decode.targets.attention)
    return TargetModel(model, processor, spec, name)
