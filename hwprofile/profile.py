"""`python -m hwprofile.profile`: measure (or predict) the latency profile of a target on a device.

    python -m hwprofile.profile --hardware cpu --target smolvlm-135m            # measure here
    python -m hwprofile.profile --hardware h200 --target smolvlm-135m --predict # roofline, calibrated here
    python -m hwprofile.profile --hardware cpu --target tiny-llama --quick --out /tmp/p.json

Measures, with the real decode code, the target's prefill / step / tree verification over a grid of
tree sizes and context lengths, the draft's components (layers per heads/FFN/cross-attention, fusion
fc per feature-layer count, LM head per vocabulary) at the widths a draft step processes, and the
per-cycle overhead; writes one JSON profile (default profiles/<hardware>-<target>.json) and a PNG
plot next to it. A hardware name other than this machine's is refused unless --predict is given:
then the profile is a roofline prediction from configs/hardware/<name>.yaml, calibrated against a
measured profile of this machine (--calibration, or <out dir>/<this machine>-<target>.json, measured
first when missing), and marked "predicted": true.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from pathlib import Path

from decode.cli import add_target_args, run_cli, setup_logging
from decode.errors import UserError
from decode.paths import writable_file
from decode.runtime.compiled import RUNTIMES
from decode.targets.loader import pick_device
from hwprofile.config import ProfileConfig
from hwprofile.device import local_device
from hwprofile.schema import Profile, default_profile_path

logger = logging.getLogger("hwprofile.profile")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hwprofile.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hardware", default=None,
                   help="canonical hardware name: a100, h100, h200, l4, rtx4090, cpu (default: this machine)")
    add_target_args(p)
    p.add_argument("--space", default=None, help="search space YAML or name (default: tiny for tiny-* targets, else default)")
    p.add_argument("--out", default=None, help="profile JSON (default: profiles/<hardware>-<target>.json)")
    p.add_argument("--predict", action="store_true", help="roofline prediction for a device that is not here")
    p.add_argument("--calibration", default=None, help="measured profile of this machine to calibrate --predict with")
    p.add_argument("--quick", action="store_true", help="tiny grid and few repeats (tests, smoke runs)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's default)")
    p.add_argument("--runtime", choices=RUNTIMES, default="eager",
                   help="decoding runtime to measure: eager (default) or compiled (static cache, padded trees, "
                        "torch.compile; default out profiles/<hardware>-<target>-compiled.json)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    return p


def config_from_args(args: argparse.Namespace) -> ProfileConfig:
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    return ProfileConfig(hardware=args.hardware, target=args.target, dtype=args.dtype, device=args.device,
                         space=args.space, out=args.out, predict=args.predict, quick=args.quick,
                         calibration=args.calibration, threads=args.threads, plot=not args.no_plot,
                         cache_dir=str(args.cache_dir) if args.cache_dir else None, runtime=args.runtime)


def run(cfg: ProfileConfig, progress: bool = True) -> tuple[Profile, Path]:
    """Measure or predict, write the profile (and plot); -> (profile, path)."""
    from hwprofile.specs import known_hardware

    local = local_device(pick_device(cfg.device))
    hardware = cfg.hardware or local.hardware
    if hardware not in known_hardware() and hardware != local.hardware:
        raise UserError(f"unknown hardware '{hardware}'; use one of: {', '.join(known_hardware())}")
    if hardware != local.hardware and not cfg.predict:
        raise UserError(f"this machine is '{local.hardware}' ({local.name}), not '{hardware}': run on a {hardware} "
                        f"to measure it, or add --predict for a roofline prediction calibrated here")
    if cfg.predict and cfg.runtime != "eager":
        raise UserError("--predict models the eager runtime only (its roofline has no compiled kernels); measure "
                        "--runtime compiled on the device itself")
    out = writable_file(cfg.out if cfg.out else default_profile_path(hardware, cfg.target,
                                                                        runtime=cfg.runtime))  # before minutes of work
    cfg = replace(cfg, hardware=hardware, out=str(out))
    if cfg.predict:
        from hwprofile.predict import predict_profile

        profile = predict_profile(cfg, hardware, local, out, progress)
    else:
        from hwprofile.measure import measure_profile

        profile = measure_profile(cfg, progress=progress)
    path = profile.save(out)
    logger.info("wrote %s (%.0f s)", path, profile.wall_s)
    if cfg.plot:
        from hwprofile.plot import plot_profile

        plot_profile(profile, path.with_suffix(".png"))
    return profile, path


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    cfg = config_from_args(args)
    profile, path = run(cfg)
    from hwprofile.latency import LatencyModel

    m = LatencyModel(profile)
    kind = f"predicted from {profile.calibrated_from['hardware']}" if profile.predicted else "measured"
    print(f"{profile.hardware} / {profile.target_name} ({profile.dtype}, {profile.runtime}, {kind}): target step "
          f"{m.target_step_ms():.2f} ms, verify 8/32/64 tokens {m.verify_ms(8):.2f}/{m.verify_ms(32):.2f}/"
          f"{m.verify_ms(64):.2f} ms at context {m.default_context}")
    print(f"wrote {path}" + (f" and {path.with_suffix('.png')}" if cfg.plot else ""))
    return 0


if __name__ == "__main__":
    run_cli(main)
