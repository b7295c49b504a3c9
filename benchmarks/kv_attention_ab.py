"""A/B of a decoding forward's cost: the eager KV cache and native attention kernel of a git revision (transformers'
DynamicCache, which copies the whole cache with torch.cat on every forward, and that revision's
attention_kernel.cpp) against the working tree's (decode/targets/kv_cache.py's in-place RoomyLayer and its kernel),
alternated round by round in one process over the same synthetic prompt: a decoding step and verifications of
4 / 6 / 8 tree tokens (forward_tree + greedy verification + keep), medians.

    python benchmarks/kv_attention_ab.py --base f2c2263 --contexts 150,300,600,1200 --rounds 40 \
        --out benchmarks/results/kv-attention-ab-cpu.json

Both attention kernels must agree with each other to float tolerance, and each bit for bit with a query computed
alone (the kernel's contract); the script checks that on the first context before timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from decode.runtime import native_attention, native_rows
from decode.targets import kv_cache
from decode.targets.loader import load_target
from hwprofile.bench_target import FEATURES, _ContextCaches
from hwprofile.cycle import filler_tokens, verify_shape_tree, verify_tree

TREE_TOKENS = (4, 6, 8)


def _base_library(rev: str, work: Path):
    """The native library built with `rev`'s attention kernel beside the working tree's row kernel."""
    src = work / "attention_base.cpp"
    src.write_text(subprocess.run(["git", "show", f"{rev}:decode/runtime/attention_kernel.cpp"], check=True,
                                  capture_output=True, text=True).stdout)
    out = work / "base.so"
    native_rows._build(out, source=(native_rows.SOURCE, src))
    return native_rows.load(out)


def _check(libs: dict, ctx: int) -> None:
    """Each kernel: a query alone gets its bits in a call of 8; the two kernels agree to float tolerance."""
    g = torch.Generator().manual_seed(0)
    n, keys = 8, ctx + 8
    q, k, v = torch.randn(1, 9, n, 64, generator=g), torch.randn(1, 3, keys, 64, generator=g), \
        torch.randn(1, 3, keys, 64, generator=g)
    mask = torch.zeros(1, 1, n, keys)
    outs = []
    for lib in libs.values():
        out = native_attention.tree_attention(q, k, v, mask, 0.125, lib=lib)
        alone = native_attention.tree_attention(q[:, :, -1:], k, v, mask[:, :, -1:], 0.125, lib=lib)
        if not torch.equal(alone[0, 0], out[0, -1]):
            raise SystemExit("error: a kernel computes a query differently alone and in a call of 8")
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=2e-6, rtol=1e-5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision of the reference attention kernel")
    ap.add_argument("--target", default="smolvlm-135m")
    ap.add_argument("--contexts", default="150,300,600,1200", help="committed tokens before the step or tree")
    ap.add_argument("--rounds", type=int, default=40, help="alternating rounds per context")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if native_rows.unavailable_reason():
        raise SystemExit(f"error: the native kernels cannot be built here: {native_rows.unavailable_reason()}")
    libs = {"base": _base_library(args.base, Path(tempfile.mkdtemp(prefix="kv-attn-ab-"))),
            "working tree": native_rows._library()}
    contexts = [int(c) for c in args.contexts.split(",")]
    _check(libs, contexts[0])
    cache_on = {"base": False, "working tree": True}  # DynamicCache for the base, RoomyLayer for the working tree
    target = load_target(args.target, device="cpu", dtype="float32")
    token = int(filler_tokens(target, 1, offset=7)[0])
    trees = {n: verify_shape_tree(target, n) for n in TREE_TOKENS}
    cases = {"step": lambda: int(target.step(token).logits[-1].argmax())}
    cases |= {f"verify {n}": (lambda tree=tree: verify_tree(target, tree, FEATURES)) for n, tree in trees.items()}
    rows = []
    for ctx in contexts:
        caches = {}
        for name, lib in libs.items():
            kv_cache.ENABLED = cache_on[name]
            native_rows._library = lambda lib=lib: lib
            caches[name] = _ContextCaches(target, (ctx,))
        times = {(name, case): [] for name in libs for case in cases}
        for rnd in range(args.rounds):
            for name in (list(libs) if rnd % 2 else list(libs)[::-1]):
                native_rows._library = lambda lib=libs[name]: lib
                for case, fn in cases.items():
                    caches[name].use(ctx)
                    t0 = time.perf_counter()
                    fn()
                    times[(name, case)].append(time.perf_counter() - t0)
                    caches[name].crop_to(ctx)
        for case in cases:
            base, new = (statistics.median(times[(name, case)]) * 1e3 for name in libs)
            rows.append({"context": ctx, "case": case, "base_ms": base, "working_ms": new, "change": new / base - 1})
            print(f"context {ctx:5d} {case:9s} base {base:7.2f} ms  working tree {new:7.2f} ms  {new / base - 1:+.1%}",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"base": args.base, "target": args.target, "threads": args.threads,
                                    "rounds": args.rounds, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
