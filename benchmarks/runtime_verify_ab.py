"""Tree-verification cost on both runtimes, side by side in one process: medians of forward_tree + keep for
chains of 1-16 tentative tokens on the eager runtime (a growing cache, each tree at its own size) and on the
compiled one (static cache, trees padded to buckets, torch.compile'd forwards), on the same prompt.

    python benchmarks/runtime_verify_ab.py --target smolvlm-135m --out benchmarks/results/runtime-verify-ab-cpu.json
    python benchmarks/runtime_verify_ab.py --variants eager,eager:bfloat16 --out /tmp/dtype-ab.json  # dtypes

--variants lists RUNTIME[:DTYPE] (default eager,compiled in float32); the first is the reference ("vs_first_step").

What a speculative method gains on a runtime is set by verify(n) / step there: a verify that costs 1.5 steps
eats a tau of 1.5 whole. A VM's speed drifts by 20-30% over minutes, so the runtimes alternate cycle by cycle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from decode.runtime.compiled import bucket
from decode.targets.loader import load_target

TREE_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)
TEXT = "Write a long story about a robot who learns to paint. "


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smolvlm-135m")
    ap.add_argument("--context", type=int, default=24, help="prompt size, as repeats of a 12-token sentence")
    ap.add_argument("--repeats", type=int, default=12, help="timed cycles per tree size and runtime (first 2 dropped)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="eager,compiled", help="RUNTIME[:DTYPE],... (dtype default float32)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    targets = {}
    for v in args.variants.split(","):
        runtime, _, dtype = v.strip().partition(":")
        targets[v.strip()] = load_target(args.target, dtype=dtype or "float32").use_runtime(runtime)
    first = next(iter(targets))
    prompt = targets[first].build_prompt(TEXT * args.context)
    room = args.repeats * len(TREE_TOKENS) + 2 * max(TREE_TOKENS)
    for t in targets.values():
        t.prefill(prompt, reserve=room)
    for name, t in targets.items():
        if t.runtime == "compiled":
            t0 = time.perf_counter()
            t.warm_buckets(max(TREE_TOKENS))
            print(f"{name}: buckets up to {bucket(max(TREE_TOKENS))} in {time.perf_counter() - t0:.0f} s")
    times: dict[tuple[str, int], list[float]] = {(r, n): [] for r in targets for n in TREE_TOKENS}
    for _ in range(args.repeats):
        for name, t in targets.items():
            for n in TREE_TOKENS:  # a chain of n tentative tokens, one kept: the context grows by one
                tokens, parents = torch.randint(0, 1000, (n,)), torch.arange(-1, n - 1)
                s = time.perf_counter()
                t.forward_tree(tokens, parents)
                t.keep([0])
                times[name, n].append(time.perf_counter() - s)
    results = []
    first_step = statistics.median(times[first, 1][2:])
    for name in targets:
        step = statistics.median(times[name, 1][2:])
        for n in TREE_TOKENS:
            ms = statistics.median(times[name, n][2:]) * 1e3
            t = targets[name]
            results.append({"variant": name, "runtime": t.runtime, "dtype": str(t.dtype).removeprefix("torch."),
                            "tree_tokens": n, "bucket": bucket(n) if t.runtime == "compiled" else n,
                            "median_ms": round(ms, 2), "vs_own_step": round(ms / (step * 1e3), 3),
                            "vs_first_step": round(ms / (first_step * 1e3), 3)})
        print(f"{name:16s}", " ".join(f"{r['tree_tokens']}:{r['median_ms']:.1f}ms ({r['vs_own_step']:.2f}x)"
                                       for r in results if r["variant"] == name))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "context": prompt.length,
                                    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}, indent=1))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
