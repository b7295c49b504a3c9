"""`python -m decode.run`: answer one prompt with vanilla or speculative decoding.

    python -m decode.run --target smollm2-135m --vanilla --prompt "What is the capital of France?" --max-new-tokens 16
    python -m decode.run --target smollm2-135m --draft layerskip:12 --prompt "Count to twenty." --compare --json
    python -m decode.run --target smolvlm-135m --draft out/draft-h200 --image skimage:astronaut --prompt "Describe the image."

--draft is a draft checkpoint directory, prompt-lookup, layerskip:K or random:concat|cross|hybrid.
--compare also runs vanilla decoding in this process (one warm-up of each, then both interleaved
--repeats times) and reports medians, the speed-up and whether the greedy outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import sys

from decode.benchio import Method, check_tree_args, identical, make_policy, measure, warm_up
from decode.cli import add_target_args, run_cli, setup_logging
from decode.errors import UserError
from decode.loop.sampling import SamplingConfig
from decode.loop.vanilla import check_max_new_tokens
from decode.runtime.compiled import RUNTIMES
from decode.targets.loader import load_target


def add_tree_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("draft tree (default: dynamic, with the draft's own tree depth/top-k/total tokens)")
    g.add_argument("--tree", default=None, metavar="dynamic|chain|static:B1,B2,..",
                   help="tree shape: EAGLE-2 dynamic, a chain, or a static branching list")
    g.add_argument("--tree-depth", type=int, default=None, help="draft levels")
    g.add_argument("--top-k", type=int, default=None, help="children per expanded node")
    g.add_argument("--total-tokens", type=int, default=None, help="draft nodes kept for verification")
    g.add_argument("--candidates", choices=("topk", "sample"), default="topk",
                   help="pick children by top-k (default) or sample them (chain/static trees only)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1.0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")


def tree_overrides(args: argparse.Namespace) -> dict[str, int | None]:
    return {"tree_depth": args.tree_depth, "top_k": args.top_k, "total_tokens": args.total_tokens}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--image", default=None, help="image file (PNG/JPEG) or skimage:NAME for a bundled photo (VLM targets)")
    p.add_argument("--draft", default=None, help="checkpoint dir | prompt-lookup | layerskip:K | random:FUSION")
    p.add_argument("--vanilla", action="store_true", help="plain autoregressive decoding (the default without --draft)")
    p.add_argument("--compare", action="store_true", help="also run vanilla decoding, interleaved, and report the speed-up")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each method with --compare (default: 3)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="upper bound on generated tokens (default: 64)")
    p.add_argument("--runtime", choices=RUNTIMES, default="eager",
                   help="eager (default) or compiled: a static KV cache, trees padded to fixed sizes and "
                        "torch.compile'd target forwards, compiled in an untimed warm-up generation first")
    add_sampling_args(p)
    add_tree_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    return p


def check_args(args: argparse.Namespace) -> SamplingConfig:
    """Everything that can be checked before a model is loaded; UserError on bad input."""
    if args.draft is not None and args.vanilla:
        raise UserError("--vanilla and --draft exclude each other; drop one (use --compare to run both)")
    if args.draft is None:
        if args.compare:
            raise UserError("--compare needs a --draft to compare with vanilla decoding")
        given = [f for f, v in (("--tree", args.tree), *((f"--{k.replace('_', '-')}", v)
                                                         for k, v in tree_overrides(args).items())) if v is not None]
        if given or args.candidates != "topk":
            raise UserError(f"{', '.join(given) or '--candidates'}: tree options need a --draft")
    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")
    check_max_new_tokens(args.max_new_tokens)
    check_tree_args(args.tree, tree_overrides(args), args.candidates)
    return SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    sampling = check_args(args)
    target = load_target(args.target, device=args.device, dtype=args.dtype, cache_dir=args.cache_dir)
    methods = [Method.vanilla(args.runtime)]
    if args.draft is not None:
        from decode.drafts import make_draft

        draft = make_draft(args.draft, target)
        spec = Method(draft.name, draft, make_policy(draft, args.tree, tree_overrides(args), args.candidates),
                      runtime=args.runtime)
        methods = [methods[0], spec] if args.compare else [spec]
    prompt = target.build_prompt(args.prompt, args.image)
    repeats = args.repeats if args.compare else 1
    if args.compare or args.runtime == "compiled":  # compiling belongs to no timed run
        warm_up(target, prompt, methods, args.max_new_tokens, sampling)
    runs = measure(target, prompt, methods, args.max_new_tokens, sampling, repeats)
    main_m = runs[methods[-1].name]
    result = main_m.first
    out = {
        "target": target.name, "mode": "speculative" if args.draft else "vanilla", **methods[-1].describe(),
        "text": result.text, **main_m.to_row(), "decode_ms": result.decode_s * 1e3,
        "prompt_tokens": prompt.length, "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
        "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed},
    }
    out.pop("method")
    if args.compare:
        van = runs[methods[0].name]
        out.update(vanilla_tokens_per_s=van.tokens_per_s, vanilla_wall_ms=van.wall_s * 1e3,
                   vanilla_new_tokens=van.new_tokens, speedup=main_m.tokens_per_s / van.tokens_per_s,
                   identical=identical(result, van.first, sampling))
    if args.json:
        print(json.dumps(out))
    else:
        print(result.text)
        print(summary_line(out), file=sys.stderr)
    return 0


def summary_line(out: dict) -> str:
    parts = [f"{out['new_tokens']} new tokens", f"{out['tokens_per_s']:.1f} tokens/s"]
    if out["mode"] == "speculative":
        parts.insert(1, f"tau {out['tau']:.2f}")
        parts.append(f"draft {out['draft_ms']:.0f} ms, verify {out['verify_ms']:.0f} ms")
    if "speedup" in out:
        same = {True: "identical", False: "DIFFERENT from vanilla", None: "sampled"}[out["identical"]]
        parts.append(f"vanilla {out['vanilla_tokens_per_s']:.1f} tokens/s, speedup {out['speedup']:.2f}x "
                     f"(median of {out['repeats']}), output {same}")
    parts.append(f"prefill {out['prefill_ms']:.0f} ms, {out['prompt_tokens']} prompt tokens")
    return "[" + ", ".join(parts) + "]"


if __name__ == "__main__":
    run_cli(main)
