"""`python -m hwprofile.trace`: where the time of real speculative decoding goes (torch.profiler).

    python -m hwprofile.trace --target smolvlm-135m --draft out/draft-h200 --max-new-tokens 48
    python -m hwprofile.trace --target tiny-llama --draft prompt-lookup --out /tmp/trace.json

Why: a latency profile sums components timed in isolation; when real cycles are much slower than
that sum (hwprofile.validate's MAPE, e.g. 62% on an H200 with eager decoding), the gap is host-side
work between kernels (Python, syncs, small CPU tensor ops, allocations). This runs vanilla decoding
and speculative decoding once each untimed (warm-up), then once each under torch.profiler, and writes
per phase (vanilla, speculative) the wall time, the profiler's total CPU and device time, and the
operators with the most self CPU time. --chrome also writes a Chrome trace for chrome://tracing.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from decode.benchio import command_line
from decode.cli import add_target_args, run_cli, setup_logging
from decode.drafts import make_draft
from decode.errors import UserError
from decode.loop.speculative import speculative_generate
from decode.loop.vanilla import sync_device, vanilla_generate
from decode.runtime.compiled import RUNTIMES
from decode.targets.loader import load_target
from hwprofile.measure import versions

logger = logging.getLogger("hwprofile.trace")
PROMPT = "Write a short story about a robot who learns to paint."


def _summary(prof, wall_s: float, top: int) -> dict:
    """Totals and the top operators by self CPU time (times in ms)."""
    events = prof.key_averages()
    use_device = any(getattr(e, "self_device_time_total", 0) for e in events)
    rows = []
    for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]:
        rows.append({"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                     "cpu_ms": e.cpu_time_total / 1e3,
                     "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3})
    return {
        "wall_ms": wall_s * 1e3,
        "self_cpu_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
        "self_device_ms": sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3 if use_device else None,
        "top_ops": rows,
    }


def trace(target, draft_spec: str, prompt_text: str, max_new_tokens: int, top: int = 25,
          chrome: Path | None = None) -> dict:
    """Profile one vanilla and one speculative generation (each after an untimed warm-up)."""
    draft = make_draft(draft_spec, target)
    prompt = target.build_prompt(prompt_text)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if target.device.type == "cuda" else [])
    out: dict = {}
    for name, run in (("vanilla", lambda: vanilla_generate(target, prompt, max_new_tokens)),
                      ("speculative", lambda: speculative_generate(target, draft, prompt, max_new_tokens))):
        run()  # warm-up: first-use kernels, allocator, lazy imports
        sync_device(target.device)
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            res = run()
            sync_device(target.device)
            wall = time.perf_counter() - t0
        out[name] = {**_summary(prof, wall, top), "new_tokens": len(res.tokens)}
        if name == "speculative":
            out[name].update(tau=res.tau, cycles=res.cycles, draft_ms=res.draft_s * 1e3, verify_ms=res.verify_s * 1e3)
        if chrome is not None:
            prof.export_chrome_trace(str(chrome.with_name(f"{chrome.stem}-{name}{chrome.suffix}")))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hwprofile.trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--draft", required=True, help="checkpoint dir | prompt-lookup | layerskip:K | random:FUSION")
    p.add_argument("--prompt", default=PROMPT, help="the user message")
    p.add_argument("--max-new-tokens", type=int, default=48, help="default: 48")
    p.add_argument("--top", type=int, default=25, help="operators listed per phase (default: 25)")
    p.add_argument("--out", default=None, help="JSON summary (default: print only)")
    p.add_argument("--chrome", default=None, help="also write Chrome traces, e.g. /tmp/trace.json (-vanilla/-speculative)")
    p.add_argument("--runtime", choices=RUNTIMES, default="eager",
                   help="decoding runtime traced: eager (default) or compiled (static cache, padded trees, "
                        "torch.compile; traced after an untimed compiling run)")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    if args.max_new_tokens < 1 or args.top < 1:
        raise UserError("--max-new-tokens and --top must be at least 1")
    target = load_target(args.target, device=args.device, dtype=args.dtype,
                         cache_dir=Path(args.cache_dir) if args.cache_dir else None).use_runtime(args.runtime)
    result = trace(target, args.draft, args.prompt, args.max_new_tokens, args.top,
                   Path(args.chrome) if args.chrome else None)
    for name, r in result.items():
        dev = f", device {r['self_device_ms']:.1f} ms" if r["self_device_ms"] is not None else ""
        print(f"{name}: {r['new_tokens']} tokens, wall {r['wall_ms']:.1f} ms, profiled CPU {r['self_cpu_ms']:.1f} ms{dev}")
        for row in r["top_ops"][:10]:
            print(f"  {row['self_cpu_ms']:9.2f} ms  {row['calls']:6d}x  {row['op']}")
    if args.out:
        doc = {"command": command_line(), "versions": versions(), "target": target.name, "draft": args.draft,
               "runtime": target.runtime,
               "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""), "result": result}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
