"""`python -m decode.answers`: the target's own greedy answers to many train-split prompts, cheap, for the corpus.

    python -m decode.answers --target smolvlm-135m --prompts sharegpt:2000 --out out/answers
    python -m decode.corpus --target smolvlm-135m --data out/answers --out out/corpus-lookup

Corpus lookup (decode/drafts/corpus.py) drafts the n-grams a corpus holds, and held-out decoding continues the
target's OWN greedy text: the target's answers are the corpus data that counts most (README: 88.8k positions of
them moved the cpu scale's replayed tau by 0.054 where 443.6k teacher-forced positions moved it by 0.032). A
corpus needs only their tokens, not the hidden states a feature-data folder stores (supernet.data --mode
regenerate), and what pays is their start: on the cpu scale's held-out set, answers cut at 64 tokens gave the
corpus tau 1.892 against 1.896 uncut (128), and the prompt positions around them added nothing. So this writes
answer tokens only (the prompt's last MAX_N tokens, where the answer starts, then the answer), `--max-new-tokens
64` by default, prompts cut to their last `--max-prompt-tokens` tokens (a prompt's prefill costs as much per token
as an answer token), in left-padded batches (decode/loop/batched.py; on 2 cores ~0.35 s per prompt against 1.2 s
for a 128-token fine-tuning answer with its features).

A batch's padding changes the summation order, so an answer may, rarely, differ from the unbatched greedy one at a
near tie: harmless here (a corpus only counts), never used for held-out data (supernet.data checks those).

Output: `manifest.json` and one `chunk-NNNNN.safetensors` file per batch (tokens, offsets; written atomically): an
interrupted run resumes at the first unfinished batch with the same settings and prompts. Batches are cut from
windows of `--window` prompts in the spec's order, each sorted by length (little padding). `--minutes` bounds the
generation time (windows come in the spec's order, so a budget keeps a fair sample of prompts, not the shortest):
the run stops after the batch that spends it, and the manifest says so (`budget_spent`).

Image prompts (`images:N`, train-split photos only) are answered too, one at a time (the batched loop takes text
prompts only; ~2-4 s each on 2 cores), whole, in batches of their own. They are worth it: the held-out image prompts
ask the same eight questions of other photos, and the target answers them in stock phrases. On the 168 held-out
sequences (ShareGPT corpus, lookup n<=3 4x1/4 + corpus 2+1), the target's answers to the 32 train image prompts,
counted 8 times, took the 8 image sequences' tau from 1.719 to 1.915 and the rest's from 1.826 to 1.848. A corpus
that holds the pipeline's data folders gains nothing more from them (cpu scale: +0.001, its data stage's 16 image
sequences hold such answers already), so the scales ask for text prompts only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from decode.cli import add_target_args, run_cli, setup_logging
from decode.errors import UserError

logger = logging.getLogger(__name__)

FORMAT = "vlm-draft-nas/answers-v1"
MANIFEST = "manifest.json"
CONTEXT = 3  # prompt tokens kept before each answer: the corpus's longest n-gram (decode/drafts/corpus.py MAX_N)


@dataclass(frozen=True)
class AnswersConfig:
    target: str = "smolvlm-135m"
    prompts: str = "sharegpt:1000"  # train-split prompts (decode.datasets spec), text and image
    out: str = "answers"
    exclude: tuple[str, ...] = ()  # data or answers folders whose prompts are passed over (their answers exist)
    max_prompt_chars: int = 2000
    max_prompt_tokens: int = 256  # longer prompts keep their last tokens (the part next to the answer)
    max_new_tokens: int = 64
    batch: int = 32  # prompts answered together (left-padded), one file per batch: what an interrupted run can lose
    window: int = 128  # prompts sorted by length together, in the spec's order, before they are cut into batches
    time_budget_s: float = 0.0  # stop after the batch that spends it (0: answer every prompt); a resumed run goes on
    # with what is left of it
    device: str = "auto"
    dtype: str = "auto"
    cache_dir: str | None = None
    threads: int | None = None

    def check(self) -> None:
        for name in ("max_prompt_tokens", "max_new_tokens", "batch", "window", "max_prompt_chars"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.time_budget_s >= 0:
            raise UserError(f"--minutes must be >= 0, got {self.time_budget_s / 60:g}")
        if self.threads is not None and self.threads < 1:
            raise UserError(f"--threads must be >= 1, got {self.threads}")

    def content(self) -> dict:
        """The settings that shape every answer: a resumed run must match them."""
        return {k: getattr(self, k) for k in ("max_prompt_chars", "max_prompt_tokens", "max_new_tokens")}


# ---------------------------------------------------------------------- reading
def read_manifest(folder: str | Path) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is not readable JSON ({err}); delete {folder} and build it again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    return manifest


def is_answers_folder(folder: str | Path) -> bool:
    return read_manifest(folder) is not None


def finished(folder: str | Path, config: "AnswersConfig") -> bool:
    """Whether `folder` holds config's answers already: same settings and prompt spec, and every batch answered or
    the same time budget spent (a rerun would answer nothing)."""
    old = read_manifest(folder)
    if old is None or old.get("content") != config.content() or old["config"].get("prompts") != config.prompts:
        return False
    return all(c.get("complete") for c in old["chunks"]) or \
        (old.get("budget_spent") and old["config"].get("time_budget_s") == config.time_budget_s)


def answer_prompt_ids(folder: str | Path) -> frozenset[str]:
    manifest = read_manifest(folder) or {}
    return frozenset(i for c in manifest.get("chunks", []) if c.get("complete") for i in c["prompt_ids"])


def read_answers(folder: str | Path) -> list[list[int]]:
    """Every finished answer of an answers folder: the prompt's last CONTEXT tokens, then the answer's tokens."""
    from safetensors import SafetensorError, safe_open

    manifest = read_manifest(folder)
    if manifest is None:
        raise UserError(f"{folder} is not an answers folder (no {MANIFEST} of format {FORMAT}); "
                        "build one with python -m decode.answers")
    out: list[list[int]] = []
    for c in manifest["chunks"]:
        if not c.get("complete"):
            continue
        path = Path(folder) / c["file"]
        try:
            with safe_open(str(path), "pt") as f:
                tokens, offsets = f.get_tensor("tokens").tolist(), f.get_tensor("offsets").tolist()
        except (SafetensorError, OSError) as err:
            raise UserError(f"{path} is not a readable answers file ({str(err).splitlines()[0][:100]}); "
                            f"delete {folder} and build it again") from None
        out += [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    return out


# ---------------------------------------------------------------------- building
def _excluded(folders: tuple[str, ...]) -> frozenset[str]:
    from decode.datasets import data_prompt_ids

    ids: frozenset[str] = frozenset()
    for folder in folders:
        if not Path(folder).is_dir():
            raise UserError(f"--exclude {folder} is not a folder (a supernet.data or decode.answers output)")
        ids |= answer_prompt_ids(folder) if is_answers_folder(folder) else data_prompt_ids(folder)
    return ids


def _write_chunk(path: Path, answers: list[list[int]]) -> int:
    import torch
    from safetensors.torch import save_file

    flat = [t for a in answers for t in a]
    offsets = [0]
    for a in answers:
        offsets.append(offsets[-1] + len(a))
    tmp = path.with_name(path.name + ".tmp")
    save_file({"tokens": torch.tensor(flat, dtype=torch.int32), "offsets": torch.tensor(offsets, dtype=torch.int64)},
              str(tmp), metadata={"format": FORMAT})
    tmp.replace(path)
    return len(flat)


def _plan(prompts: list, config: AnswersConfig, old: dict | None) -> tuple[list, list[dict], float]:
    """The batches of an answers run -> (chunks: a batch's (prompt, id) pairs, None for one answered before; their
    manifest entries; the generation seconds of the batches kept).

    A finished batch of an earlier run is kept, whatever its file, while the spec still asks for all its prompts: a
    changed spec (image prompts dropped, more prompts, another exclusion) shifts every window, and what was answered
    stays answered. The rest go in windows of `config.window` prompts in the spec's order (a time budget then keeps a
    fair sample, not the shortest prompts); inside a window similar lengths share a batch (little padding), image
    prompts a batch of their own; each batch is one chunk file. The kept batches' share of the earlier runs' time
    counts against the budget (in proportion to their prompts)."""
    wanted = {pid for _, pid in prompts}
    done = [c for c in (old or {}).get("chunks", []) if c.get("complete")]
    kept = [c for c in done if set(c["prompt_ids"]) <= wanted]
    answered = {pid for c in kept for pid in c["prompt_ids"]}
    rest = [p for p in prompts if p[1] not in answered]
    chunks: list = [None] * len(kept)
    for i in range(0, len(rest), config.window):
        for images in (False, True):
            group = sorted((p for p in rest[i: i + config.window] if p[0].has_image == images),
                           key=lambda p: (p[0].length, p[1]))
            chunks += [group[j: j + config.batch] for j in range(0, len(group), config.batch)]
    used = {c["file"] for c in kept}
    names = (n for n in (f"chunk-{k:05d}.safetensors" for k in itertools.count()) if n not in used)
    planned = kept + [{"file": next(names), "prompt_ids": [pid for _, pid in c], "complete": False}
                      for c in chunks[len(kept):]]
    n_done = sum(len(c["prompt_ids"]) for c in done)
    spent = float((old or {}).get("spent_s", 0.0)) * (len(answered) / n_done if n_done else 0.0)
    return chunks, planned, spent


def build_answers(config: AnswersConfig, target=None) -> Path:
    """Build (or finish) the answers folder config.out; returns it. `target` skips loading config.target."""
    from tqdm import tqdm

    from decode.benchio import write_json
    from decode.datasets import parse_prompt_spec
    from decode.loop.batched import batch_greedy, batchable
    from decode.loop.vanilla import vanilla_generate
    from decode.paths import writable_dir
    from decode.targets.loader import load_target

    config.check()
    out = writable_dir(config.out)
    old = read_manifest(out)
    if old is None and (out / MANIFEST).exists():
        raise UserError(f"--out {out} holds a manifest.json that is not an answers folder's; use another --out")
    exclude = _excluded(config.exclude)
    if target is None:
        target = load_target(config.target, device=config.device, dtype=config.dtype,
                             cache_dir=Path(config.cache_dir) if config.cache_dir else None)
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    digest = target.fingerprint().to_dict()
    if old is not None and old.get("target") != digest:
        raise UserError(f"--out {out} holds answers of another target ({old.get('target_name')}); use another --out")
    if old is not None and old.get("content") != config.content():
        raise UserError(f"--out {out} holds answers made with other settings ({old.get('content')}); "
                        "use another --out or delete it")
    items = parse_prompt_spec(config.prompts, split="train", max_chars=config.max_prompt_chars,
                              cache_dir=Path(config.cache_dir) if config.cache_dir else None, exclude=exclude)
    if not items:
        raise UserError(f"no prompts to answer in '{config.prompts}'; ask for e.g. sharegpt:N or images:N")
    if any(it.image is not None for it in items) and not target.is_vlm:
        raise UserError(f"'{config.prompts}' asks for image prompts, but {target.name} reads no images; "
                        "ask for sharegpt:N only")
    # text prompts cut to their tail (the part next to the answer); an image prompt is whole (its image tokens sit at
    # its start, and it is short)
    built = [(target.build_prompt(it.text, it.image, it.history), it.id) for it in items]
    prompts = [(p if p.has_image else p.tail(config.max_prompt_tokens), pid) for p, pid in built
               if p.has_image or batchable(p)]
    chunks, planned, spent = _plan(prompts, config, old)
    manifest = {"format": FORMAT, "target_name": target.name, "target": digest, "content": config.content(),
                "config": {**asdict(config), "exclude": list(config.exclude)}, "chunks": planned,
                "spent_s": spent, "budget_spent": False, "command": "python -m decode.answers"}
    write_json(out / MANIFEST, manifest)
    for stale in set(out.glob("chunk-*.safetensors")) - {out / c["file"] for c in planned}:  # a dropped batch's
        stale.unlink()  # answers (after the manifest that no longer lists them)
    todo = sum(len(c) for c, m in zip(chunks, planned) if not m["complete"])
    budget = f" (until {config.time_budget_s / 60:g} min are spent)" if config.time_budget_s else ""
    bar = tqdm(total=todo, desc=f"the target's answers{budget}", unit="prompt", disable=todo == 0)
    start, made = time.perf_counter(), 0
    for chunk, entry in zip(chunks, planned):
        if chunk is None:  # a batch answered before
            continue
        if config.time_budget_s and manifest["spent_s"] >= config.time_budget_s:
            manifest["budget_spent"] = True  # the rest stays unanswered; a rerun with the same budget reuses this
            logger.warning("answers: the %.1f-minute budget is spent after %d of %d prompts",
                           config.time_budget_s / 60, sum(len(c["prompt_ids"]) for c in planned if c["complete"]),
                           len(prompts))
            write_json(out / MANIFEST, manifest)
            break
        if chunk[0][0].has_image:  # one at a time: the batched loop takes text prompts only
            got = [vanilla_generate(target, p, config.max_new_tokens).tokens for p, _ in chunk]
        else:
            got = batch_greedy(target, [p for p, _ in chunk], [config.max_new_tokens] * len(chunk))
        answers = [p.input_ids[0, -CONTEXT:].tolist() + a for (p, _), a in zip(chunk, got)]
        made += sum(len(a) for a in got)
        bar.update(len(chunk))
        bar.set_postfix_str(f"{made / (time.perf_counter() - start):.0f} tok/s")
        entry["tokens"] = _write_chunk(out / entry["file"], answers)
        entry["complete"] = True
        manifest["spent_s"] = spent + time.perf_counter() - start
        write_json(out / MANIFEST, manifest)
    bar.close()
    return out


# ---------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    d = AnswersConfig()
    p = argparse.ArgumentParser(prog="python -m decode.answers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--out", type=Path, required=True, help="the answers folder to write (resumed when it exists)")
    p.add_argument("--prompts", default=d.prompts,
                   help=f"train-split prompts, e.g. images:32,sharegpt:2000 (image prompts are answered one at a time; "
                        f"default: {d.prompts})")
    p.add_argument("--exclude", type=Path, action="append", default=[], metavar="DIR",
                   help="a supernet.data or decode.answers folder whose prompts are passed over (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help=f"answer tokens per prompt at most (default: {d.max_new_tokens})")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help=f"longer prompts keep their last tokens (default: {d.max_prompt_tokens})")
    p.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help=f"prompt text longer than this is passed over (default: {d.max_prompt_chars})")
    p.add_argument("--batch", type=int, default=d.batch,
                   help=f"prompts per left-padded batch, one file each (default: {d.batch})")
    p.add_argument("--window", type=int, default=d.window,
                   help=f"prompts sorted by length together before batching (default: {d.window})")
    p.add_argument("--minutes", type=float, default=0.0,
                   help="stop after the batch that spends this much generation time (default: 0, no limit)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    config = AnswersConfig(target=args.target, prompts=args.prompts, out=str(args.out),
                           exclude=tuple(str(e) for e in args.exclude), max_prompt_chars=args.max_prompt_chars,
                           max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                           batch=args.batch, window=args.window, time_budget_s=args.minutes * 60, device=args.device,
                           dtype=args.dtype,
                           cache_dir=str(args.cache_dir) if args.cache_dir else None, threads=args.threads)
    t0 = time.perf_counter()
    out = build_answers(config)
    answers = read_answers(out)
    print(f"{len(answers)} answers, {sum(len(a) - CONTEXT for a in answers)} answer tokens "
          f"({time.perf_counter() - t0:.0f} s) -> {out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
