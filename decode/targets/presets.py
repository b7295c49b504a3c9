"""Target presets: configs/targets/<name>.yaml, each naming where a target comes from.

    source: embedded   -> one of the default targets prepared into the cache (decode.targets.embedded)
    source: tiny       -> a tiny random model of `family` (decode.targets.tiny), `seed` optional
    source: path       -> a local HF model directory at `path` (~ and $VARS expanded)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from configs import config_dir
from decode.errors import UserError


@dataclass(frozen=True)
class TargetPreset:
    name: str
    source: str  # embedded | tiny | path
    family: str | None = None
    seed: int = 0
    path: str | None = None
    description: str = ""


def preset_names() -> list[str]:
    return sorted(p.stem for p in config_dir("targets").glob("*.yaml"))


def load_preset(name: str) -> TargetPreset:
    file = config_dir("targets") / f"{name}.yaml"
    if not file.is_file():
        raise UserError(f"unknown target preset '{name}'; presets: {', '.join(preset_names())}")
    raw = yaml.safe_load(file.read_text()) or {}
    unknown = set(raw) - set(TargetPreset.__dataclass_fields__)
    if unknown or raw.get("source") not in ("embedded", "tiny", "path"):
        raise UserError(f"preset file {file} is malformed (source must be embedded|tiny|path; unknown keys: {sorted(unknown)})")
    preset = TargetPreset(**{**raw, "name": raw.get("name", name)})
    if preset.source == "path" and preset.path:
        preset = TargetPreset(**{**raw, "path": os.path.expandvars(os.path.expanduser(preset.path))})
    return preset


def is_preset(name: str) -> bool:
    return (config_dir("targets") / f"{name}.yaml").is_file()


def resolve_dir(path: str) -> Path:
    """A local HF model directory, checked."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise UserError(f"unknown target '{path}': not a preset ({', '.join(preset_names())}) and no such directory")
    if not (p / "config.json").is_file():
        raise UserError(f"'{path}' is not a Hugging Face model directory (no config.json); point --target at a saved model folder")
    return p
