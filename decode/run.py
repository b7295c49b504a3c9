"""`python -m decode.run`: generate an answer from a target (vanilla decoding for now).

    python -m decode.run --target smollm2-135m --vanilla --prompt "What is the capital of France?" --max-new-tokens 16
    python -m decode.run --target smolvlm-135m --image skimage:astronaut --prompt "Describe the image." --json
"""

from __future__ import annotations

import argparse
import json
import sys

from decode.cli import add_target_args, run_cli, setup_logging
from decode.loader import load_target
from decode.sampling import SamplingConfig
from decode.vanilla import check_max_new_tokens, vanilla_generate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--image", default=None, help="image file (PNG/JPEG) or skimage:NAME for a bundled photo (VLM targets)")
    p.add_argument("--vanilla", action="store_true", help="plain autoregressive decoding (the default until a draft is given)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="upper bound on generated tokens (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1.0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    check_max_new_tokens(args.max_new_tokens)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    target = load_target(args.target, device=args.device, dtype=args.dtype, cache_dir=args.cache_dir)
    prompt = target.build_prompt(args.prompt, args.image)
    result = vanilla_generate(target, prompt, args.max_new_tokens, sampling)
    if args.json:
        out = {
            "target": target.name,
            "mode": "vanilla",
            "text": result.text,
            "new_tokens": result.new_tokens,
            "tokens_per_s": round(result.tokens_per_s, 3),
            "prefill_ms": round(result.prefill_s * 1e3, 3),
            "decode_ms": round(result.decode_s * 1e3, 3),
            "prompt_tokens": prompt.length,
            "device": str(target.device),
            "dtype": str(target.dtype).replace("torch.", ""),
            "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed},
        }
        print(json.dumps(out))
    else:
        print(result.text)
        print(f"[{result.new_tokens} new tokens, {result.tokens_per_s:.1f} tokens/s, "
              f"prefill {result.prefill_s * 1e3:.0f} ms, {prompt.length} prompt tokens]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_cli(main)
