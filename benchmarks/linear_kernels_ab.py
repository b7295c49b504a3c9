"""A/B of the target's decoding step and tree-verification cost under three rules for its few-row CPU linear
layers (decode.runtime.small_rows), interleaved in one process on the same prompt and cache: medians of
forward_tree + keep for chains of 1-16 tentative tokens.

- `torch`: F.linear everywhere (MKL: a one-core GEMV for one row, a transposed-weight GEMM for more);
- `hot`: the rule before 2026-12-03: W @ x^T for 2-16 rows where it won when timed over one weight again and
  again (the weight stays in cache), inputs taken in whatever layout they came;
- `cold` (today's `auto`): W @ x^T for 1-16 rows where it wins when timed over clones of the weight streamed
  from memory, one row as two identical columns, inputs made contiguous.

    python benchmarks/linear_kernels_ab.py --target smolvlm-135m --repeats 14 --out benchmarks/results/linear-kernels-ab-cpu.json

A VM's speed drifts by 20-30% over minutes, so only rules timed side by side in one run compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from decode.runtime import small_rows
from decode.targets.loader import load_target

TREE_TOKENS = (1, 2, 3, 4, 6, 8, 16)
TEXT = "Write a long story about a robot who learns to paint. "


def _hot_product(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight @ x2.T).T  # the previous rule's product: the input's layout as it came


def _rules(target, measure_reps: int) -> dict[str, tuple[str, dict, object]]:
    """rule -> (small_rows.MODE, choice table, product) for every linear shape of the target's tree forwards."""
    small_rows.MODE = "auto"
    for n in TREE_TOKENS:  # today's choice, measured as decoding measures it
        small_rows.measure_linears(target.model, n)
    cold = dict(small_rows._CHOICE)
    hot = {}
    real_bytes = small_rows.COLD_BYTES
    small_rows.COLD_BYTES = 0  # one weight, timed again and again: the previous measurement
    try:
        for rows, n_in, n_out in cold:
            hot[rows, n_in, n_out] = rows >= 2 and small_rows._measure(rows, torch.randn(n_out, n_in), measure_reps)
    finally:
        small_rows.COLD_BYTES = real_bytes
    return {"torch": ("off", {}, small_rows._rows_product), "hot": ("auto", hot, _hot_product),
            "cold": ("auto", cold, small_rows._rows_product)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smolvlm-135m")
    ap.add_argument("--context", type=int, default=40, help="prompt size, as repeats of a 12-token sentence")
    ap.add_argument("--repeats", type=int, default=14, help="timed cycles per tree size and rule (the first 2 dropped)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    rules = _rules(target, measure_reps=7)
    prompt = target.build_prompt(TEXT * args.context)
    target.prefill(prompt)
    real_product = small_rows._rows_product
    times: dict[tuple[str, int], list[float]] = {(r, n): [] for r in rules for n in TREE_TOKENS}
    try:
        for _ in range(args.repeats):
            for rule, (mode, table, product) in rules.items():
                small_rows.MODE, small_rows._CHOICE, small_rows._rows_product = mode, table, product
                for n in TREE_TOKENS:  # a chain of n tentative tokens, one kept: the context grows by one
                    tokens, parents = torch.randint(0, 1000, (n,)), torch.arange(-1, n - 1)
                    t0 = time.perf_counter()
                    target.forward_tree(tokens, parents)
                    target.keep([0])
                    times[rule, n].append(time.perf_counter() - t0)
    finally:
        small_rows._rows_product = real_product
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
                    for rule, (_, table, _) in rules.items()},
        "results": results}, indent=1))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
