"""A/B of the target's decoding step and tree-verification cost under four rules for its few-row CPU linear
layers (decode.runtime.small_rows), interleaved in one process on the same prompt and cache: medians of
forward_tree + keep for chains of 1-16 tentative tokens.

- `torch`: F.linear everywhere (MKL: a one-core GEMV for one row, a transposed-weight GEMM for more);
- `cold` (auto before 2026-12-04): F.linear or W @ x^T per shape, whichever was faster timed over clones of the
  weight streamed from memory;
- `auto` (today's default): the same timing with the native kernel (decode/runtime/native_rows.py) as a third
  candidate;
- `native`: the native kernel for every 1-16 row product.

    python benchmarks/linear_kernels_ab.py --target smolvlm-135m --repeats 14 --out benchmarks/results/linear-kernels-ab-cpu.json

Choices are measured in this process (the machine's kernel table is neither read nor written). A VM's speed drifts
by 20-30% over minutes, so only rules timed side by side in one run compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from decode.runtime import kernel_table, native_rows, small_rows
from decode.targets.loader import load_target

TREE_TOKENS = (1, 2, 3, 4, 6, 8, 16)
TEXT = "Write a long story about a robot who learns to paint. "


def _measured(target, native: bool) -> dict:
    """The auto choices for every linear shape of the target's tree forwards, with or without the native kernel."""
    real = native_rows.available
    small_rows.MODE, small_rows._CHOICE = "auto", {}
    if not native:
        native_rows.available = lambda: False
    try:
        for n in TREE_TOKENS:
            small_rows.measure_linears(target.model, n)
    finally:
        native_rows.available = real
    return dict(small_rows._CHOICE)


def _rules(target) -> dict[str, tuple[str, dict]]:
    """rule -> (small_rows.MODE, choice table)."""
    return {"torch": ("off", {}), "cold": ("auto", _measured(target, native=False)),
            "auto": ("auto", _measured(target, native=True)), "native": ("native", {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smolvlm-135m")
    ap.add_argument("--context", type=int, default=40, help="prompt size, as repeats of a 12-token sentence")
    ap.add_argument("--repeats", type=int, default=14, help="timed cycles per tree size and rule (the first 2 dropped)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ[kernel_table.ENV] = "off"  # choices of this process only
    small_rows._TABLE_KEY = None
    target = load_target(args.target)
    if not native_rows.available():
        raise SystemExit(f"error: the native kernel is not available here ({native_rows.unavailable_reason()})")
    rules = _rules(target)
    prompt = target.build_prompt(TEXT * args.context)
    target.prefill(prompt)
    times: dict[tuple[str, int], list[float]] = {(r, n): [] for r in rules for n in TREE_TOKENS}
    for _ in range(args.repeats):
        for rule, (mode, table) in rules.items():
            small_rows.MODE, small_rows._CHOICE = mode, table
            for n in TREE_TOKENS:  # a chain of n tentative tokens, one kept: the context grows by one
                tokens, parents = torch.randint(0, 1000, (n,)), torch.arange(-1, n - 1)
                t0 = time.perf_counter()
                target.forward_tree(tokens, parents)
                target.keep([0])
                times[rule, n].append(time.perf_counter() - t0)
    results = []
    for rule in rules:
        step = statistics.median(times[rule, 1][2:])
        for n in TREE_TOKENS:
            ms = statistics.median(times[rule, n][2:]) * 1e3
            results.append({"rule": rule, "tree_tokens": n, "median_ms": round(ms, 2),
                            "vs_own_step": round(ms / (step * 1e3), 3),
                            "vs_torch_step": round(ms / (statistics.median(times["torch", 1][2:]) * 1e3), 3)})
        print(f"{rule:6s}", " ".join(f"{r['tree_tokens']}:{r['median_ms']:.1f}ms ({r['vs_own_step']:.2f}x)"
                                     for r in results if r["rule"] == rule))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "config": vars(args) | {"out": str(args.out)}, "context": prompt.length,
        "device": torch.__config__.show().splitlines()[0],
        "choices": {rule: {f"{r}x{i}->{o}": v for (r, i, o), v in sorted(table.items())}
                    for rule, (_, table) in rules.items()},
        "results": results}, indent=1))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
