"""`python -m decode.corpus`: a corpus-lookup draft, built in a minute with no training and no model forward.

    python -m decode.corpus --target smolvlm-135m --out out/corpus-lookup
    python -m decode.corpus --target smolvlm-135m --data ~/.cache/vlm-draft-nas/runs/smolvlm-135m-cpu/finetune-data \
        --out out/corpus-lookup-own
    python -m decode.run --target smolvlm-135m --draft out/corpus-lookup --prompt "..." --compare

Tokenises the train-split ShareGPT answers (the offline copy the project prepares; held-out prompts are never
read) with the target's tokenizer, adds every position of any feature-data folders given with --data, paired with
the token the target itself predicted there (the shards' stored top-1: a distilled corpus, what the target would
say; a regenerated folder holds the target's own answers, which count OWN_WEIGHT times, as do the answers of a
decode.answers folder, also taken by --data), counts the two most frequent next tokens of every 1..3-gram
(decode/drafts/corpus.py) and writes a draft folder: draft_config.json of kind prompt-lookup with corpus branches,
and corpus.safetensors. `--draft DIR` then drafts each cycle a prompt-lookup
trie and a corpus branch in one tree; the target verifies both, so the output is the target's own, token for token.
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

# 2- and 3-grams seen once are dropped: for the cpu scale's corpus that kept 0.94M of 2.35M n-grams (23 MB against 56)
# and moved the best corpus lookup's replayed tau on its 168 held-out sequences from 1.876 to 1.870
MIN_COUNT = 2
# each position of a folder of the target's own answers (supernet.data --mode regenerate) counts this many times:
# on the cpu scale's held-out sequences 1 / 2 / 4 / 8 / 16 gave tau 1.870 / 1.886 / 1.889 / 1.894 / 1.890
# (decode/drafts/corpus.py, "Weights")
OWN_WEIGHT = 8


def train_answer_items(cache_dir: Path | None = None) -> list:
    """The train-split ShareGPT prompts (PromptItem) that have an answer, in file order."""
    from decode.datasets import load_sharegpt, sharegpt_split_of

    split = sharegpt_split_of(cache_dir)
    return [it for it in load_sharegpt(cache_dir) if split(it.id) == "train" and it.answer]


def train_answer_count(cache_dir: Path | None = None) -> int:
    """How many ShareGPT train answers a corpus of all of them counts (its first source's label)."""
    return len(train_answer_items(cache_dir))


def sharegpt_label(n: int) -> str:
    """The corpus source label of n ShareGPT train answers."""
    return f"sharegpt train answers ({n})"


def sharegpt_answers(tokenizer, n: int | None, cache_dir: Path | None = None, max_chars: int = 4000) -> list[list[int]]:
    """Token ids of the answers of the first n (None: all) train-split ShareGPT conversations."""
    from tqdm import tqdm

    items = train_answer_items(cache_dir)
    items = items if n is None else items[:n]
    return [tokenizer(it.answer[:max_chars], add_special_tokens=False)["input_ids"]
            for it in tqdm(items, desc="tokenising ShareGPT answers", unit="answer", leave=False)]


def data_items(folder: str | Path) -> list[tuple[list[int], list[int]] | list[int]]:
    """Corpus items of a feature-data folder's shards: per sequence (input_ids, the target's top-1 after each position;
    -1 at image positions), or its answer tokens (from prompt_len on) where the shards hold no top-k; of an answers
    folder (decode.answers): each answer with the prompt's last tokens before it."""
    from safetensors import SafetensorError, safe_open

    from decode.answers import is_answers_folder, read_answers

    if is_answers_folder(folder):  # decode.answers: the target's answers as plain token sequences
        return list(read_answers(folder))
    shards = sorted(Path(folder).glob("shard-*.safetensors"))
    if not shards:
        raise UserError(f"--data {folder}: no shard-*.safetensors there (a supernet.data or decode.answers output "
                        "folder)")
    out: list = []
    for shard in shards:
        try:
            with safe_open(str(shard), "pt") as f:
                names = set(f.keys())
                ids, offsets, prompt_len = (f.get_tensor(k).tolist() for k in ("input_ids", "offsets", "prompt_len"))
                top1 = f.get_slice("topk_ids")[:, 0:1].reshape(-1) if "topk_ids" in names else None  # (T,)
                if top1 is not None and "image_mask" in names:
                    top1 = top1.masked_fill(f.get_tensor("image_mask").bool(), -1)
        except (SafetensorError, OSError) as err:
            raise UserError(f"{shard} is not a readable data shard ({str(err).splitlines()[0][:100]})") from None
        if top1 is None:
            out += [ids[offsets[j] + prompt_len[j]: offsets[j + 1]] for j in range(len(prompt_len))]
        else:
            nexts = top1.tolist()
            out += [(ids[a:b], nexts[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    return out


def data_weight(folder: str | Path, own_weight: int = OWN_WEIGHT) -> int:
    """How many times a feature-data folder's positions count: own_weight for the target's own answers (a folder
    built in regenerate mode, or by decode.answers), 1 for teacher-forced data (its manifest's mode)."""
    from decode.answers import is_answers_folder

    if is_answers_folder(folder):
        return own_weight
    try:
        mode = json.loads((Path(folder) / "manifest.json").read_text()).get("content", {}).get("mode")
    except (OSError, ValueError, AttributeError):
        mode = None  # no readable manifest: counted once (data_items names a folder without shards)
    return own_weight if mode == "regenerate" else 1


def source_sequences(folder: str | Path) -> int:
    """How many corpus items data_items(folder) gives: from its manifest where that says (an answers folder's
    finished answers, a feature-data folder's sequences), else by reading them."""
    from decode.answers import answer_prompt_ids, is_answers_folder

    if is_answers_folder(folder):
        return len(answer_prompt_ids(folder))
    try:
        shards = json.loads((Path(folder) / "manifest.json").read_text())["shards"]
        return sum(int(s["sequences"]) for s in shards if s.get("complete", True))
    except (OSError, ValueError, KeyError, TypeError):
        return len(data_items(folder))


def label_end(weight: int) -> str:
    """How a data folder's entry in CorpusInfo.sources ends: 'sequences)', or 'sequences xW)' when counted W times."""
    return "sequences)" if weight == 1 else f"sequences x{weight})"


def source_label(folder: str | Path, sequences: int, weight: int) -> str:
    """A data folder's entry in CorpusInfo.sources: '<folder> (N sequences)', '<folder> (N sequences xW)'."""
    return f"{folder} ({sequences} {label_end(weight)}"


def build_corpus(target, sharegpt: int | None = None, data: list[Path] | tuple = (), max_n: int = MAX_N,
                 cache_dir: Path | None = None, min_count: int = MIN_COUNT,
                 own_weight: int = OWN_WEIGHT) -> NgramCorpus:
    """The corpus of `target`'s tokens: the first `sharegpt` train-split ShareGPT answers (None: all; 0: none) and the
    distilled positions (data_items) of the feature-data folders in `data`, the target's own answers counted
    `own_weight` times (data_weight)."""
    seqs, weights, sources = [], [], []  # NgramCorpus.build refuses weights < 1 (main says which flag)
    if sharegpt != 0:
        seqs += sharegpt_answers(target.tokenizer, sharegpt, cache_dir)
        weights += [1] * len(seqs)
        sources.append(sharegpt_label(len(seqs)))
    for folder in data:
        more, w = data_items(folder), data_weight(folder, own_weight)
        seqs += more
        weights += [w] * len(more)
        sources.append(source_label(folder, len(more), w))
    if not seqs:
        raise UserError("no corpus: pass --sharegpt N > 0 or --data DIR")
    return NgramCorpus.build(seqs, target.vocab_size, max_n, tuple(sources),
                             target.fingerprint().to_dict().get("weights_digest", ""), min_count, weights)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode.corpus", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--out", type=Path, required=True, help="the draft folder to write")
    p.add_argument("--sharegpt", type=int, default=None, metavar="N",
                   help="train-split ShareGPT answers to count (default: all; 0: none)")
    p.add_argument("--data", type=Path, action="append", default=[], metavar="DIR",
                   help="a feature-data folder whose positions join the corpus, each with the target's own next "
                        "token there (repeatable)")
    p.add_argument("--min-count", type=int, default=MIN_COUNT,
                   help=f"keep 2- and 3-grams seen at least this often (default: {MIN_COUNT}; 1: all)")
    p.add_argument("--own-weight", type=int, default=OWN_WEIGHT, metavar="W",
                   help="count each position of a --data folder of the target's own answers (built with "
                        f"supernet.data --mode regenerate) W times (default: {OWN_WEIGHT}; 1: like the rest)")
    p.add_argument("--max-n", type=int, default=MAX_N, help=f"longest n-gram counted, 1..{MAX_N} (default: {MAX_N})")
    # the defaults are what the cpu-scale search chose on its profile (README, "Measured so far")
    p.add_argument("--corpus-depth", type=int, default=2, help="tokens in the corpus branch (default: 2)")
    p.add_argument("--corpus-second", type=int, default=1,
                   help="tokens in the second corpus branch (the runner-up first token; 0: none; default: 1)")
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
    if args.min_count < 1:
        raise UserError(f"--min-count must be >= 1, got {args.min_count}")
    if args.own_weight < 1:
        raise UserError(f"--own-weight must be >= 1, got {args.own_weight}")
    spec = LookupSpec(max_ngram=args.max_ngram, tree_depth=args.lookup_depth, top_k=1, total_tokens=args.lookup_depth,
                      corpus_depth=args.corpus_depth, corpus_second=args.corpus_second)
    for folder in args.data:
        if not folder.is_dir():
            raise UserError(f"--data {folder} is not a folder")
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out} is a file; pass a folder")
    from decode.drafts.kinds import save_training_free
    from decode.targets.loader import load_target

    t0 = time.perf_counter()
    target = load_target(args.target, device="cpu", dtype="float32", cache_dir=args.cache_dir)
    corpus = build_corpus(target, args.sharegpt, args.data, args.max_n, args.cache_dir, args.min_count,
                          args.own_weight)
    meta = {"corpus": corpus.info.to_dict(), "command": "python -m decode.corpus", "lookup": asdict(spec)}
    save_training_free(args.out, "prompt-lookup", target, spec, metadata=meta)
    corpus.save(args.out / CORPUS_NAME)
    print(f"corpus of {corpus.info.tokens} tokens from {corpus.info.sequences} sequences, {corpus.keys.size} n-grams "
          f"({time.perf_counter() - t0:.0f} s) -> {args.out}")
    print(json.dumps({"draft": str(args.out), "lookup": asdict(spec)}))
    return 0


if __name__ == "__main__":
    run_cli(main)
