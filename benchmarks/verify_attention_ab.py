"""A/B of the target's tree-verification cost: transformers' SDPA (repeat_kv copies the KV cache for grouped
heads whenever a tree has more than one token) against decode.targets.attention's packed grouped-query
attention, interleaved in one process on the same prompt and cache, medians of forward_tree + keep.

    python benchmarks/verify_attention_ab.py --target smolvlm-135m --contexts 20,50 --repeats 14 \
        --out benchmarks/results/verify-attention-ab-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from decode.targets.attention import PACKED_SDPA
from decode.targets.loader import load_target

IMPLEMENTATIONS = {"transformers-sdpa": "sdpa", "packed-gqa": PACKED_SDPA}
TREE_TOKENS = (1, 2, 3, 4, 6, 8, 16)
TEXT = "Write a long story about a robot who learns to paint. "


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smolvlm-135m")
    ap.add_argument("--contexts", default="20,50", help="prompt sizes, as repeats of a 12-token sentence")
    ap.add_argument("--repeats", type=int, default=14, help="timed cycles per tree size (the first 2 dropped)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    results = []
    for reps in map(int, args.contexts.split(",")):
        prompt = target.build_prompt(TEXT * reps)
        times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in IMPLEMENTATIONS for n in TREE_TOKENS}
        target.prefill(prompt)
        for _ in range(args.repeats):
            for name, impl in IMPLEMENTATIONS.items():
                target.model.set_attn_implementation(impl)
                for n in TREE_TOKENS:  # a chain of n tentative tokens, one kept: the context stays put
                    tokens, parents = torch.randint(0, 1000, (n,)), torch.arange(-1, n - 1)
                    t0 = time.perf_counter()
                    target.forward_tree(tokens, parents)
                    target.keep([0])
                    times[name, n].append(time.perf_counter() - t0)
        step = statistics.median(times["transformers-sdpa", 1][2:])
        for (name, n), ts in times.items():
            ms = statistics.median(ts[2:]) * 1e3
            results.append({"context": prompt.length, "attention": name, "tree_tokens": n, "median_ms": round(ms, 2),
                            "vs_sdpa_step": round(ms / (step * 1e3), 3)})
        print(f"context {prompt.length}")
        for name in IMPLEMENTATIONS:
            row = [r for r in results if r["context"] == prompt.length and r["attention"] == name]
            print(f"  {name:18s}", " ".join(f"{r['tree_tokens']}:{r['median_ms']:.1f}ms ({r['vs_sdpa_step']:.2f}x)"
                                            for r in row))
    target.model.set_attn_implementation(PACKED_SDPA)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "device": torch.__config__.show()
                                    .splitlines()[0], "results": results}, indent=1))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
