"""Shipped YAML configuration (targets, search spaces, hardware sheets); read via importlib.resources."""

from importlib.resources import files
from pathlib import Path


def config_dir(kind: str) -> Path:
    """The folder configs/<kind> (targets, space, hardware ...) of the installed project."""
    return Path(str(files(__name__) / kind))
