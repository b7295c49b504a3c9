"""Two versions of the native few-row kernel (decode/runtime/rows_kernel.cpp) side by side in one process: the one
at a git revision and the working tree's, each built here, alternated tree by tree through the default target's
verification forwards (forward_tree + keep of 1-16 tokens). Kernel-only timings (every linear weight of the target
once, M input rows) come first; the model-level medians say what a decoding step and a verify gain.

    python benchmarks/native_kernel_ab.py --base HEAD --out benchmarks/results/native-kernel-ab-cpu.json

Both versions must give bitwise the same values (the kernel's contract: a row's result does not depend on the
other rows, the thread count or the version); the script checks that before timing and stops if not.
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

from decode.runtime import native_rows, small_rows
from decode.targets.loader import load_target

SIZES = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16)
TEXT = "Write a long story about a robot who learns to paint. "


def _use(lib) -> None:
    """Route native_rows.rows_linear (and so every few-row product small_rows makes) through `lib`."""
    native_rows._library = lambda: lib


def _median_ms(times: dict) -> dict:
    return {key: statistics.median(v[2:]) * 1e3 for key, v in times.items()}  # the first two rounds warm up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision of the reference kernel (default HEAD)")
    ap.add_argument("--target", default="smolvlm-135m")
    ap.add_argument("--context", type=int, default=24, help="prompt size, as repeats of a 12-token sentence")
    ap.add_argument("--repeats", type=int, default=14, help="timed rounds (the first 2 dropped)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if native_rows.unavailable_reason():
        raise SystemExit(f"error: the native kernel cannot be built here: {native_rows.unavailable_reason()}")
    small_rows.MODE = "native"  # every few-row product through the kernel under test
    work = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
    base_src = work / "base.cpp"
    base_src.write_text(subprocess.run(["git", "show", f"{args.base}:decode/runtime/rows_kernel.cpp"], check=True,
                                       capture_output=True, text=True).stdout)
    libs = {}
    for name, source, out in ((f"base ({args.base})", base_src, work / "base.so"),
                              ("working tree", native_rows.SOURCE, work / "new.so")):
        native_rows._build(out, source=source)
        libs[name] = native_rows.load(out)
    target = load_target(args.target)
    # what a decoding step streams: every linear layer of the language model, then its LM head
    weights = [m.weight.detach() for m in target.decoder.modules() if isinstance(m, torch.nn.Linear)]
    weights.append(target.lm_head.weight.detach())
    for rows in SIZES:  # same bits from both versions, on the largest weight (the LM head)
        x = torch.randn(rows, target.hidden_size)
        outs = []
        for lib in libs.values():
            _use(lib)
            outs.append(native_rows.rows_linear(x, target.lm_head.weight.detach()))
        if not torch.equal(*outs):
            raise SystemExit(f"error: the two kernels differ at {rows} rows; a kernel change must keep every bit")
    xs = {(m, w.shape[1]): torch.randn(m, w.shape[1]) for m in SIZES for w in weights}
    kernel = {(name, m): [] for name in libs for m in SIZES}
    for _ in range(args.repeats):
        for m in SIZES:
            for name, lib in libs.items():
                _use(lib)
                s = time.perf_counter()
                for w in weights:
                    native_rows.rows_linear(xs[m, w.shape[1]], w)
                kernel[name, m].append(time.perf_counter() - s)
    prompt = target.build_prompt(TEXT * args.context)
    target.prefill(prompt, reserve=args.repeats * len(SIZES) * len(libs) + 2 * max(SIZES))
    model = {(name, n): [] for name in libs for n in SIZES}
    for _ in range(args.repeats):
        for n in SIZES:
            for name, lib in libs.items():
                _use(lib)
                tokens, parents = torch.randint(0, 1000, (n,)), torch.tensor([-1] + [0] * (n - 1))
                s = time.perf_counter()
                target.forward_tree(tokens, parents)
                target.keep([0])
                model[name, n].append(time.perf_counter() - s)
    kernel_ms, forward_ms = _median_ms(kernel), _median_ms(model)
    results = []
    for name in libs:
        step = forward_ms[name, 1]
        for n in SIZES:
            results.append({"kernel": name, "rows": n, "kernel_ms": round(kernel_ms[name, n], 2),
                            "forward_ms": round(forward_ms[name, n], 2),
                            "forward_vs_own_step": round(forward_ms[name, n] / step, 3)})
        print(f"{name:18s} kernel " + " ".join(f"{n}:{kernel_ms[name, n]:.1f}" for n in SIZES))
        print(f"{'':18s} forward " + " ".join(f"{n}:{forward_ms[name, n]:.1f}({forward_ms[name, n] / step:.2f})"
                                             for n in SIZES))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "context": prompt.length,
                                    "weights": len(weights), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                    "results": results}, indent=1))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
