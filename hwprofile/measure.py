"""Measure a profile on this machine: target tables, draft component tables, the cycle overhead."""

from __future__ import annotations

import datetime
import logging
import os
import platform
import time

import torch

from decode.benchio import command_line
from decode.drafts.pack import cpu_format
from decode.runtime import native_attention
from decode.runtime.compiled import compile_tag
from decode.runtime.small_rows import linear_kernels
from decode.space import SearchSpace
from decode.targets.loader import load_target, pick_device, pick_dtype
from decode.targets.target import TargetModel
from hwprofile.bench_draft import measure_draft
from hwprofile.bench_overhead import measure_overhead
from hwprofile.bench_target import measure_target
from hwprofile.config import ProfileConfig, default_grids
from hwprofile.device import DeviceInfo, local_device
from hwprofile.schema import Profile
from hwprofile.tables import Table
from hwprofile.timing import Timer

logger = logging.getLogger(__name__)


def versions(info: DeviceInfo | None = None) -> dict:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "driver": info.driver if info is not None else None}


def target_info(target: TargetModel) -> dict:
    cfg = target.text_config
    heads = int(cfg.num_attention_heads)
    return {"name": target.name, "fingerprint": target.fingerprint().to_dict(), "hidden_size": target.hidden_size,
            "num_layers": target.num_layers, "num_heads": heads,
            "num_kv_heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(cfg, "head_dim", None) or target.hidden_size // heads),
            "vocab_size": target.vocab_size}


def load_space(cfg: ProfileConfig, target: TargetModel) -> SearchSpace:
    space = SearchSpace.load(cfg.space_name)
    space.check_target(target.num_layers, target.vocab_size)
    return space


def load_average() -> float | None:
    """1-minute system load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def open_target(cfg: ProfileConfig) -> TargetModel:
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    dev = pick_device(cfg.device)
    target = load_target(cfg.target, device=str(dev), dtype=pick_dtype(cfg.dtype, dev), cache_dir=cfg.cache_dir)
    return target.use_runtime(cfg.runtime)


def measure_profile(cfg: ProfileConfig, target: TargetModel | None = None, progress: bool = True) -> Profile:
    """A measured profile of cfg.target on this machine (cfg.hardware must be this machine)."""
    t0, load_before = time.perf_counter(), load_average()
    if target is None:
        return _measure(cfg, open_target(cfg), progress, t0, load_before)
    previous = target.runtime  # a caller's target: measured on cfg's runtime, then handed back on its own
    try:
        return _measure(cfg, target.use_runtime(cfg.runtime), progress, t0, load_before)
    finally:
        target.use_runtime(previous)


def _measure(cfg: ProfileConfig, target: TargetModel, progress: bool, t0: float, load_before) -> Profile:
    space = load_space(cfg, target)
    info = local_device(target.device)
    grids = default_grids(target.device.type, space, cfg.quick)
    timer = Timer(target.device)
    logger.info("profiling %s on %s (%s, %d torch threads)", target.name, info.name, target.dtype, info.torch_threads)

    tables: dict[str, Table] = {}
    # the op census (what roofline predictions re-price) counts eager ops; compiled graphs would re-trace under it
    tables.update(measure_target(target, grids, timer, progress, with_census=target.runtime == "eager"))
    tables.update(measure_draft(target, space, grids, timer, progress))
    tables["overhead"], notes = measure_overhead(target, space, grids, timer, tables["scorer"], progress)
    profile = Profile(
        hardware=info.hardware, predicted=False, device=info.to_dict(),
        # nas.hardware.stale_kernels checks attention, linear, draft_weights (and compiled): a stored profile measured
        # with others is measured again; kv_cache and attention_kernel are recorded for the record
        versions=versions(info) | {"attention": target.attention_kernels(), "linear": linear_kernels(),
                                   "draft_weights": cpu_format() if target.device.type == "cpu" else "model",
                                   "kv_cache": target.kv_cache(), "attention_kernel": native_attention.VERSION}
        | ({"compiled": compile_tag(target.device.type)} if target.runtime == "compiled" else {}),
        dtype=str(target.dtype).removeprefix("torch."), runtime=target.runtime,
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), command=command_line(),
        target=target_info(target), space=space.to_dict(), config=cfg.to_dict(), grids=grids.to_dict(),
        tables=tables,
    )
    profile.notes.extend(notes)
    profile.wall_s = time.perf_counter() - t0
    profile.load_avg = {"before": load_before, "after": load_average(), "cpu_cores": info.cpu_cores}
    if target.device.type == "cpu":
        from decode.runtime import small_rows

        profile.small_rows = {"mode": small_rows.MODE, "choices": small_rows.choices(), "table": small_rows.table_file()}
    return profile
