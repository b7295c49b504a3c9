"""The draft's level steps compiled or eager, on the compiled runtime, side by side in one process.

    python benchmarks/draft_levels_ab.py --target smolvlm-135m --draft out/nas-cpu-scale3/draft \
        --prompts sharegpt:10,images:3 --out benchmarks/results/draft-levels-ab-cpu.json

Three methods interleaved prompt by prompt: vanilla decoding on the compiled runtime, and the same draft with its
level steps compiled (decode/runtime/draft_step.py: static buffers, one graph per level bucket) and eager (its
DraftKV, each level at its own shape). Reports per method the pooled tokens/s, speed-up over compiled vanilla,
drafting time per prompt (SpecResult.draft_s) and token identity; JSON to --out. A VM's speed drifts by 20-40%
within an hour: only the ratios inside one run compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from decode.benchio import Method, make_policy, warm_up
from decode.datasets import parse_prompt_spec
from decode.drafts import make_draft
from decode.loop.sampling import SamplingConfig
from decode.targets.loader import load_target


def _levels(draft, compiled: bool) -> None:
    getattr(draft, "neural", draft).compile_levels = compiled  # a merged draft's neural part


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smolvlm-135m")
    ap.add_argument("--draft", required=True, help="a neural (or neural+lookup) draft spec, as decode.bench --drafts")
    ap.add_argument("--prompts", default="sharegpt:10,images:3")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target).use_runtime("compiled")
    draft = make_draft(args.draft, target)
    policy = make_policy(draft, None, {})
    sampling = SamplingConfig()
    items = parse_prompt_spec(args.prompts)
    prompts = [target.build_prompt(i.text, i.image, i.history) for i in items]
    arms = {"vanilla@compiled": None, "levels-compiled": True, "levels-eager": False}
    methods = {name: Method.vanilla("compiled") if flag is None else Method(name, draft, policy, runtime="compiled")
               for name, flag in arms.items()}
    longest = max(prompts, key=lambda p: p.length)
    t0 = time.perf_counter()
    for name, flag in arms.items():  # each arm's graphs (and kernel choices) made before any timed run
        if flag is not None:
            _levels(draft, flag)
        warm_up(target, longest, [methods[name]], args.max_new_tokens, sampling)
    print(f"warm-up {time.perf_counter() - t0:.0f} s")
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    with tqdm(total=len(prompts) * len(arms) * args.repeats, desc="draft-levels A/B", unit="run") as bar:
        for item, prompt in zip(items, prompts):
            per: dict[str, list] = {name: [] for name in arms}
            for rep in range(args.repeats):
                order = list(arms)[rep % len(arms):] + list(arms)[: rep % len(arms)]
                for name in order:
                    if arms[name] is not None:
                        _levels(draft, arms[name])
                    per[name].append(methods[name].generate(target, prompt, args.max_new_tokens, sampling))
                    bar.update(1)
            ref = per["vanilla@compiled"][0].tokens
            for name, results in per.items():
                best = min(results, key=lambda r: r.decode_s + r.prefill_s)
                runs[name].append({"prompt": item.id, "tokens": len(best.tokens),
                                   "seconds": statistics.median(r.decode_s + r.prefill_s for r in results),
                                   "draft_s": statistics.median(getattr(r, "draft_s", 0.0) for r in results),
                                   "tau": getattr(best, "tau", 1.0), "identical": best.tokens == ref})
    van = sum(r["seconds"] for r in runs["vanilla@compiled"])
    summary = []
    for name, rows in runs.items():
        secs = sum(r["seconds"] for r in rows)
        summary.append({"method": name, "tokens_per_s": round(sum(r["tokens"] for r in rows) / secs, 2),
                        "speedup": round(van / secs, 3),
                        "median_speedup": round(statistics.median(
                            v["seconds"] / r["seconds"] for v, r in zip(runs["vanilla@compiled"], rows)), 3),
                        "draft_ms_per_prompt": round(1e3 * statistics.median(r["draft_s"] for r in rows), 1),
                        "tau": round(statistics.mean(r["tau"] for r in rows), 3),
                        "identical_rate": sum(r["identical"] for r in rows) / len(rows)})
        print(f"{name:18s} {summary[-1]['tokens_per_s']:6.2f} tok/s  {summary[-1]['speedup']:.3f}x  "
              f"draft {summary[-1]['draft_ms_per_prompt']:.0f} ms/prompt  tau {summary[-1]['tau']:.2f}  "
              f"identical {summary[-1]['identical_rate']:.0%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "policy": str(policy),
                                    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "summary": summary,
                                    "per_prompt": runs}, indent=1))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
