"""The few-row linear kernel choices of decode.runtime.small_rows, kept per machine in a file so that every process
on one machine runs the same kernels.

Why: auto mode times W @ x^T against F.linear once per (rows, in, out) shape and process. Where the two are within
noise of each other the answer flips between processes (three fresh processes on a 2-core AMD EPYC disagreed on the
one-row down projection 1x1536->576 and on 1x192->192). The hardware profile then priced a decoding step with one
set of kernels (57 ms) while the bench decoded with another (42 ms), and the search's predicted speed-ups were 36%
too high at cpu scale. A choice measured once is now written here and read by every later process with the same
machine key (CPU model, vector extensions, cores, torch threads and version, the rule's version).

The file: `<cache>/kernels/<slug>.json` = {"format", "machine": key, "choices": {"2x576->49192": "native", ...}}, each
value the product small_rows.PRODUCTS names ("linear", "wx", "native").
VLM_DRAFT_NAS_KERNEL_TABLE=off keeps choices in memory only (one process, as before); =PATH uses that file.
Delete the file to measure again. Writes merge with what other processes wrote, under a lock, and replace the file
atomically; an unreadable file is ignored with a warning and rewritten.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path

import torch

from decode.runtime.machine import cpu_cores, cpu_isa, cpu_model

log = logging.getLogger(__name__)

FORMAT = "vlm-draft-nas/kernel-choices-v2"
ENV = "VLM_DRAFT_NAS_KERNEL_TABLE"
Shape = tuple[int, int, int]  # (rows, in, out)


@functools.lru_cache(maxsize=1)
def _cpu() -> str:
    return f"{cpu_model()}|{cpu_isa()}|cores={cpu_cores()}"


def machine_key(version: str) -> str:
    """What the choices depend on: the CPU, the torch threads and build, and the rule that measured them."""
    return f"{_cpu()}|threads={torch.get_num_threads()}|torch={torch.__version__}|{version}"


def table_path(key: str) -> Path | None:
    """The file holding `key`'s choices; None when persistence is off."""
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in ("off", "0", "none"):
        return None
    if setting:
        return Path(setting).expanduser()
    from decode.targets.embedded import default_cache_dir  # the project's cache folder (same layer, imported late)

    slug = re.sub(r"[^a-z0-9]+", "-", key.split("|")[0].lower()).strip("-")[:40] or "cpu"
    return default_cache_dir() / "kernels" / f"{slug}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


def _name(shape: Shape) -> str:
    return f"{shape[0]}x{shape[1]}->{shape[2]}"


def _shape(name: str) -> Shape:
    rows, rest = name.split("x", 1)
    n_in, n_out = rest.split("->")
    return int(rows), int(n_in), int(n_out)


def _read(path: Path, key: str) -> dict[Shape, str]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("machine") != key:
            raise ValueError(f"made for {data.get('machine')!r}, not {key!r}")
        choices = {_shape(k): v for k, v in data["choices"].items()}
        if not all(isinstance(v, str) for v in choices.values()):
            raise ValueError("a choice that is not a product name")
        return choices
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("ignoring the kernel choice table %s (%s); the choices are measured again", path, e)
        return {}


def load(key: str) -> dict[Shape, str]:
    """The persisted choices for `key` ({} when none, persistence off, or the file unreadable)."""
    path = table_path(key)
    return {} if path is None else _read(path, key)


@contextlib.contextmanager
def _locked(path: Path):
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def save(key: str, choices: dict[Shape, str]) -> dict[Shape, str]:
    """Merge `choices` into `key`'s file (entries already there win: the first measurement on a machine is the one
    every process uses) and replace it atomically; -> the merged table, which the caller adopts. A file system that
    refuses the write only costs the persistence (logged), never the decoding."""
    path = table_path(key)
    merged = dict(choices)
    if path is None or not choices:
        return merged
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            merged = {**choices, **_read(path, key)}
            text = json.dumps({"format": FORMAT, "machine": key,
                               "choices": {_name(s): v for s, v in sorted(merged.items())}}, indent=1)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, path)
    except OSError as e:
        log.warning("could not keep the kernel choices in %s (%s); they hold for this process only", path, e)
    return merged
