"""`python -m hwprofile.validate`: check a measured profile against real draft cycles on this machine.

    python -m hwprofile.validate --profile profiles/cpu-smolvlm-135m.json --samples 20
    python -m hwprofile.validate --profile profiles/cpu-tiny-llama.json --samples 3 --prompts fixed

Draws (arch, tree) samples from the profile's search space, runs real cycles (random-weight
NeuralDraft on the profile's target, a real prompt: propose, forward_tree, verify, keep, accept),
and prints predicted vs measured per sample and the MAPE. Writes JSON (default: next to the profile,
<profile>.validate.json). Predicted profiles, or profiles of another device or target, are refused.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
from pathlib import Path

import pandas as pd
import torch

from decode.benchio import command_line
from decode.cli import run_cli, setup_logging
from decode.errors import UserError
from decode.paths import writable_file
from decode.targets.loader import load_target
from hwprofile.measure import load_average, versions
from hwprofile.schema import Profile
from hwprofile.validation import ValidateConfig, local_device_for, validate_profile

logger = logging.getLogger("hwprofile.validate")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hwprofile.validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, help="a measured profile JSON of this machine")
    p.add_argument("--samples", type=int, default=20, help="(arch, tree) samples from the search space (default: 20)")
    p.add_argument("--cycles", type=int, default=5, help="timed cycles per sample and pass (default: 5)")
    p.add_argument("--passes", type=int, default=2, help="rounds over all samples, spreading load bursts (default: 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed cycles per sample (default: 2)")
    p.add_argument("--prompts", default="sharegpt", choices=("sharegpt", "images", "fixed"),
                   help="held-out ShareGPT prompts (default), bundled photos, or a few fixed texts")
    p.add_argument("--seed", type=int, default=0, help="sampling seed for archs and draft weights")
    p.add_argument("--out", default=None, help="JSON output (default: <profile>.validate.json)")
    p.add_argument("--cache-dir", default=None, help="where embedded targets and datasets are cached")
    p.add_argument("-v", "--verbose", action="store_true", help="log per-sample results")
    return p


def default_out(profile_path: str) -> Path:
    p = Path(profile_path)
    return p.with_name(p.stem + ".validate.json")


def table(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame([{
        "fusion": r["arch"]["fusion"], "depth": r["arch"]["depth"], "vocab": r["arch"]["draft_vocab"] or "full",
        "tree": f"{r['arch']['tree_depth']}x{r['arch']['top_k']}", "N": r["tree_tokens"], "ctx": round(r["context"]),
        "tau": round(r["tau"], 2), "measured_ms": round(r["measured_ms"], 2), "predicted_ms": round(r["predicted_ms"], 2),
        "err_%": round(r["error_pct"], 1),
    } for r in rows])
    df.index.name = "sample"
    return df


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    cfg = ValidateConfig(profile=args.profile, samples=args.samples, warmup=args.warmup, cycles=args.cycles, passes=args.passes,
                         prompts=args.prompts, seed=args.seed, out=args.out, cache_dir=args.cache_dir)
    cfg.check()
    profile = Profile.load(cfg.profile)
    out = writable_file(cfg.out if cfg.out else default_out(cfg.profile))  # before minutes of real cycles
    local = local_device_for(profile)
    threads = profile.device.get("torch_threads")
    if profile.device.get("kind") == "cpu" and threads:
        torch.set_num_threads(int(threads))  # time with the thread count the profile was measured with
    target = load_target(profile.target_name, device=local.kind, dtype=profile.dtype, cache_dir=cfg.cache_dir)
    target.use_runtime(profile.runtime)  # real cycles on the runtime the profile measured
    if target.fingerprint().to_dict() != profile.target["fingerprint"]:
        raise UserError(f"target '{profile.target_name}' here differs from the one profiled (fingerprint mismatch); "
                        "re-profile it with python -m hwprofile.profile")
    load_before = load_average()
    result = validate_profile(profile, target, cfg)
    doc = {"config": cfg.to_dict(), "profile": str(cfg.profile), "hardware": profile.hardware,
           "device": local.to_dict(), "versions": versions(local), "target": profile.target_name,
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "command": command_line(),
           "load_avg": {"before": load_before, "after": load_average(), "profile": profile.load_avg}, **result}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    s = result["summary"]
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(table(result["rows"]).to_string())
    print(f"MAPE {s['mape_pct']:.1f}% (median {s['median_ape_pct']:.1f}%, IQR {s['ape_p25_pct']:.1f}-"
          f"{s['ape_p75_pct']:.1f}%, max {s['max_ape_pct']:.1f}%, bias {s['mean_signed_error_pct']:+.1f}%); "
          f"by phase: propose {s['propose_mape_pct']:.1f}%, verify {s['verify_mape_pct']:.1f}%, "
          f"accept {s['accept_mape_pct']:.1f}%")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
