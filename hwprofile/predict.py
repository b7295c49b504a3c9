"""Predicted profiles for devices that are not present (`python -m hwprofile.profile --predict`).

1. A measured profile of this machine (the calibration) gives, per table entry, the measured time
   and the op census; hwprofile.roofline fits the measured/roofline ratios on it.
2. The target's tables and the draft components of the predicted device's grid (the GPU grid
   reaches 256 verify tokens and 2048 context) are censused on this machine with the same real
   decode code (one untimed run each: FLOPs, traffic and kernels do not depend on the device).
3. Each entry's time = the calibrated roofline of the spec sheet; the overhead table (host-side
   Python) is carried over from the calibration unchanged.

The result has the schema of a measured profile, `"predicted": true` and `calibrated_from`.
"""

from __future__ import annotations

import datetime
import logging
import time
from pathlib import Path

from decode.benchio import command_line
from decode.errors import UserError
from hwprofile.bench_draft import measure_draft
from hwprofile.bench_target import census_target
from hwprofile.config import ProfileConfig, default_grids
from hwprofile.device import DeviceInfo
from hwprofile.measure import load_space, measure_profile, open_target, target_info, versions
from hwprofile.roofline import OP_CLASS, fit_calibration
from hwprofile.schema import TABLE_AXES, Profile, default_profile_path
from hwprofile.specs import dtype_key, load_spec
from hwprofile.tables import Table
from hwprofile.timing import Timer

logger = logging.getLogger(__name__)


def _calibration(cfg: ProfileConfig, local: DeviceInfo, out: Path, progress: bool) -> tuple[Profile, str]:
    """The measured local profile to calibrate with: given, found next to the output, or measured now."""
    path = Path(cfg.calibration) if cfg.calibration else default_profile_path(local.hardware, cfg.target, out.parent)
    if path.is_file():
        prof = Profile.load(path)
        if prof.predicted or prof.hardware != local.hardware or prof.device.get("name") != local.name:
            raise UserError(f"calibration profile {path} was not measured on this machine ({local.hardware}, "
                            f"{local.name}); pass --calibration with a profile measured here, or remove it")
        if prof.target_name != cfg.target:
            raise UserError(f"calibration profile {path} is for target '{prof.target_name}', not '{cfg.target}'; "
                            "pass --calibration with a profile of the same target")
        return prof, str(path)
    if cfg.calibration:
        raise UserError(f"calibration profile '{cfg.calibration}' does not exist; measure one with "
                        f"python -m hwprofile.profile --target {cfg.target}")
    logger.warning("no measured %s profile of %s at %s: measuring it first", local.hardware, cfg.target, path)
    local_cfg = ProfileConfig(hardware=local.hardware, target=cfg.target, dtype="auto", device=cfg.device,
                              space=cfg.space, out=str(path), quick=cfg.quick, threads=cfg.threads, plot=False,
                              seed=cfg.seed, cache_dir=cfg.cache_dir)
    prof = measure_profile(local_cfg, progress=progress)
    prof.save(path)
    return prof, str(path)


def predict_profile(cfg: ProfileConfig, hardware: str, local: DeviceInfo, out: Path, progress: bool = True) -> Profile:
    t0 = time.perf_counter()
    spec = load_spec(hardware)
    local_spec = load_spec(local.hardware, local.variant)  # UserError when this machine has no sheet
    calib_profile, calib_path = _calibration(cfg, local, out, progress)
    target = open_target(ProfileConfig(target=cfg.target, dtype=calib_profile.dtype, device=cfg.device,
                                       threads=cfg.threads, cache_dir=cfg.cache_dir))
    if target.fingerprint().to_dict() != calib_profile.target["fingerprint"]:
        raise UserError(f"target '{cfg.target}' differs from the one in the calibration profile {calib_path}; "
                        "re-measure the calibration profile")
    calibration = fit_calibration(calib_profile, local_spec)
    logger.info("calibration on %s: alpha %s, beta %.3f", local.hardware, calibration.alpha, calibration.beta)
    dtype = dtype_key(cfg.dtype) if cfg.dtype != "auto" else ("bf16" if spec.kind == "cuda" else "fp32")
    space = load_space(cfg, target)
    grids = default_grids(spec.kind, space, cfg.quick)
    census = census_target(target, grids.contexts, grids.verify_tokens)
    drafts = measure_draft(target, space, grids, Timer(target.device), progress, with_census=True, timed=False)
    tables: dict[str, Table] = {}
    for name, op_class in OP_CLASS.items():
        entries = census[name] if name in census else drafts[name].census
        table = Table(TABLE_AXES[name])
        for point, c in entries.items():
            table.put(point, calibration.predict_ms(c, op_class, spec, dtype), c)
        tables[name] = table
    tables["overhead"] = calib_profile.tables["overhead"]  # host-side Python: taken as is
    device = DeviceInfo(hardware=spec.name, kind=spec.kind, name=spec.description, memory_bytes=int(spec.memory_bytes),
                        variant=spec.variant)
    return Profile(
        hardware=spec.name, predicted=True, device=device.to_dict(), versions=versions(local),
        dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype], runtime="eager",
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), command=command_line(),
        target=target_info(target), space=space.to_dict(), config=cfg.to_dict(), grids=grids.to_dict(), tables=tables,
        wall_s=time.perf_counter() - t0, spec=spec.to_dict(),
        calibrated_from={"hardware": local.hardware, "device": local.to_dict(), "profile": calib_path,
                         "profile_date": calib_profile.date, **calibration.to_dict()},
        notes=[f"roofline prediction from configs/hardware/{spec.name}.yaml, calibrated on {local.hardware} "
               f"({local.name}); overhead table copied from the calibration profile (host-side Python)"],
    )

