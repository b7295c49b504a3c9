"""`python -m decode.corpus`: a corpus-lookup draft, built in a minute with no training and no model forward.

    python -m decode.corpus --target smolvlm-135m --out out/corpus-lookup
    python -m decode.corpus --target smolvlm-135m --data ~/.cache/vlm-draft-nas/runs/smolvlm-135m-cpu/finetune-data \
        --out out/corpus-lookup-own
    python -m decode.run --target smolvlm-135m --draft out/corpus-lookup --prompt "..." --compare

Tokenises the train-split ShareGPT answers (the offline copy the project prepares; held-out prompts are never
read) with the target's tokenizer, adds the answers of any feature-data folders given with --data (the target's
own answers when the folder was regenerated: they teach its phrasing best), counts the most frequent next token of
every 1..3-gram (decode/drafts/corpus.py) and writes a draft folder: draft_config.json of kind prompt-lookup with a
corpus branch, and corpus.safetensors. `--draft DIR` then drafts each cycle a prompt-lookup trie and a corpus
branch in one tree; the target verifies both, so the output is the target's own, token for token.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from decode.cli import add_target_args, run_cli, setup_logging
from decode.drafts.corpus import CORPUS_NAME, MAX_N, NgramCorpus
from decode.drafts.prompt_lookup import LookupSpec
from decode.errors import UserError


def sharegpt_answers(tokenizer, n: int | None, cache_dir: Path | None = None, max_chars: int = 4000) -> list[list[int]]:
    """Token ids of the answers of the first n (None: all) train-split ShareGPT conversations."""
    from tqdm import tqdm

    from decode.datasets import load_sharegpt, split_of

    items = [it for it in load_sharegpt(cache_dir) if split_of(it.id) == "train" and it.answer]
    items = items if n is None else items[:n]
    return [tokenizer(it.answer[:max_chars], add_special_tokens=False)["input_ids"]
            for it in tqdm(items, desc="tokenising ShareGPT answers", unit="answer", leave=False)]


def data_answers(folder: str | Path) -> list[list[int]]:
    """The answer tokens (positions from prompt_len on) of every sequence of a feature-data folder's shards."""
    from safetensors import SafetensorError, safe_open

    shards = sorted(Path(folder).glob("shard-*.safetensors"))
    if not shards:
        raise UserError(f"--data {folder}: no shard-*.safetensors there (a supernet.data output folder)")
    out = []
    for shard in shards:
        try:
            with safe_open(str(shard), "pt") as f:
                ids, offsets, prompt_len = (f.get_tensor(k).tolist() for k in ("input_ids", "offsets", "prompt_len"))
        except (SafetensorError, OSError) as err:
            raise UserError(f"{shard} is not a readable data shard ({str(err).splitlines()[0][:100]})") from None
        out += [ids[offsets[j] + prompt_len[j]: offsets[j + 1]] for j in range(len(prompt_len))]
    return out


def build_corpus(target, sharegpt: int | None = None, data: list[Path] | tuple = (), max_n: int = MAX_N,
                 cache_dir: Path | None = None) -> NgramCorpus:
    """The corpus of `target`'s tokens: the first `sharegpt` train-split ShareGPT answers (None: all; 0: none) and the
    answers of the feature-data folders in `data`."""
    seqs, sources = [], []
    if sharegpt != 0:
        seqs += sharegpt_answers(target.tokenizer, sharegpt, cache_dir)
        sources.append(f"sharegpt train answers ({len(seqs)})")
    for folder in data:
        more = data_answers(folder)
        seqs += more
        sources.append(f"{folder} ({len(more)} answers)")
    if not seqs:
        raise UserError("no corpus: pass --sharegpt N > 0 or --data DIR")
    return NgramCorpus.build(seqs, target.vocab_size, max_n, tuple(sources),
                             target.fingerprint().to_dict().get("weights_digest", ""))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode.corpus", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--out", type=Path, required=True, help="the draft folder to write")
    p.add_argument("--sharegpt", type=int, default=None, metavar="N",
                   help="train-split ShareGPT answers to count (default: all; 0: none)")
    p.add_argument("--data", type=Path, action="append", default=[], metavar="DIR",
                   help="a feature-data folder whose answers join the corpus (repeatable)")
    p.add_argument("--max-n", type=int, default=MAX_N, help=f"longest n-gram counted, 1..{MAX_N} (default: {MAX_N})")
    p.add_argument("--corpus-depth", type=int, default=4, help="tokens in the corpus branch (default: 4)")
    p.add_argument("--lookup-depth", type=int, default=4, help="prompt-lookup branch length (default: 4)")
    p.add_argument("--max-ngram", type=int, default=2, help="prompt lookup's longest n-gram (default: 2)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    if args.sharegpt is not None and args.sharegpt < 0:
        raise UserError(f"--sharegpt must be >= 0, got {args.sharegpt}")
    if args.corpus_depth < 1:
        raise UserError(f"--corpus-depth must be >= 1, got {args.corpus_depth}")
    spec = LookupSpec(max_ngram=args.max_ngram, tree_depth=args.lookup_depth, top_k=1, total_tokens=args.lookup_depth,
                      corpus_depth=args.corpus_depth)
    for folder in args.data:
        if not folder.is_dir():
            raise UserError(f"--data {folder} is not a folder")
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out} is a file; pass a folder")
    from decode.drafts.kinds import save_training_free
    from decode.targets.loader import load_target

    t0 = time.perf_counter()
    target = load_target(args.target, device="cpu", dtype="float32", cache_dir=args.cache_dir)
    corpus = build_corpus(target, args.sharegpt, args.data, args.max_n, args.cache_dir)
    meta = {"corpus": corpus.info.to_dict(), "command": "python -m decode.corpus", "lookup": asdict(spec)}
    save_training_free(args.out, "prompt-lookup", target, spec, metadata=meta)
    corpus.save(args.out / CORPUS_NAME)
    print(f"corpus of {corpus.info.tokens} tokens from {corpus.info.sequences} answers, {corpus.keys.size} n-grams "
          f"({time.perf_counter() - t0:.0f} s) -> {args.out}")
    print(json.dumps({"draft": str(args.out), "lookup": asdict(spec)}))
    return 0


if __name__ == "__main__":
    run_cli(main)
