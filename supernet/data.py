"""`python -m supernet.data`: the frozen target's features on training prompts, written as shards.

    python -m supernet.data --target smolvlm-135m --prompts sharegpt:64,images:8 --max-len 256 --out out/data
    python -m supernet.data --target tiny-llava --space tiny --prompts sharegpt:8,images:2 --mode regenerate

Per prompt (TRAIN split of decode.datasets) one sequence is built and run through the target once:

    teacher     chat-templated prompt + the dataset's answer (ShareGPT gpt turn, then the end token);
                image prompts have no answer: the target writes one greedily (--image-answer-tokens)
    regenerate  chat-templated prompt + the target's own greedy answer (up to max-len, capped by
                --max-new-tokens): the draft then learns exactly what the target generates

truncated to --max-len tokens (a prompt whose image would be cut is skipped). A text prompt too
long to leave --min-answer answer tokens (when set; the scales set it) keeps its tail, so every
sequence trains something (held-out data keeps whole prompts: they are what decoding sees). In
regenerate mode, --regen-batch > 1 answers text prompts in left-padded batches (decode/loop/batched.py).
Held-out answers must be the target's exact greedy continuation: there each batched answer is checked
against the sequence's own (unbatched) forward, and one that is not the argmax at every position is
refused and generated again one prompt at a time (counted in the manifest as `regen_refused`).
The forward stores, per token, the target's top-k next-token logits + full logsumexp, the hidden
states the search space needs (the entropy layer is resolved first, on --calib-prompts prompts
spread over the list), image and loss masks, and for sequences with an image the attention entropy
and received attention (zeros on text sequences: they only rank image tokens, and the eager
attention they need makes the forward several times slower) (format: supernet/dataset.py).
Shard i always holds prompts [i*S, (i+1)*S); complete shards are skipped on rerun (resume).
--time-budget-s starts no shard once this run has spent that much time: the folder is then complete with the shards
built (the manifest's `budget` says how many of how many), and a later run builds the rest. A pipeline deadline uses
it to share its time between data and training.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from decode.datasets import HELDOUT_PHOTOS, RESERVE_FROM, PromptItem, parse_prompt_spec
from decode.errors import UserError
from decode.loop.vanilla import vanilla_generate
from decode.prompt import PER_TOKEN, Prompt
from decode.space import SearchSpace, default_space_name
from decode.targets.target import TargetModel
from supernet.dataset import (
    FORMAT,
    MANIFEST,
    bytes_per_token,
    check_target,
    read_manifest,
    read_shard_meta,
    shard_name,
    summarize_shards,
    write_json_atomic,
    write_shard,
)
from supernet.entropy import EntropyChoice, calibrate

logger = logging.getLogger("supernet.data")  # not __main__ under python -m

MODES = ("teacher", "regenerate")


@dataclass(frozen=True)
class DataConfig:
    target: str = "smolvlm-135m"
    prompts: str = "sharegpt:64,images:8"
    split: str = "train"  # train (supernet training) | heldout (acceptance estimation for the search)
    mode: str = "teacher"
    max_len: int = 256  # tokens per sequence (prompt + answer)
    topk: int = 32  # target next-token logits kept per position
    space: str | None = None  # search space (YAML or name): which layers to store; None: the target's default
    shard_size: int = 16  # prompts per shard
    out: str = "out/data"
    image_answer_tokens: int = 64  # teacher mode: greedy answer length for prompts without one (images)
    max_new_tokens: int = 192  # regenerate mode: cap on the target's own answer
    max_prompt_chars: int | None = 2000  # ShareGPT prompts longer than this are not used
    min_answer: int = 0  # answer tokens every text sequence keeps room for (a longer prompt loses its head); 0 = off
    regen_batch: int = 1  # regenerate mode: prompts answered together (left-padded batch; checked on held-out)
    calib_prompts: int = 8  # first prompts whose attention entropy picks the entropy layer
    entropy_layer: int | None = None  # force the entropy layer (hidden-state index) instead of calibrating
    top_tokens: int = 1024  # most frequent next tokens listed in the manifest
    # > 0: no shard starts once this run has spent this many seconds (calibration included); the folder is then
    # complete with the shards built (the rest of the prompts unused; a later run goes on). 0: every prompt
    time_budget_s: float = 0.0
    device: str = "auto"
    dtype: str = "auto"
    cache_dir: str | None = None

    def __post_init__(self) -> None:  # the space is part of the data's identity: resolve the default now
        if self.space is None:
            object.__setattr__(self, "space", default_space_name(self.target))

    def check(self) -> None:
        if self.split not in ("train", "heldout"):
            raise UserError(f"unknown split '{self.split}'; use train or heldout")
        if self.mode not in MODES:
            raise UserError(f"unknown mode '{self.mode}'; use one of: {', '.join(MODES)}")
        if self.max_len < 2:
            raise UserError(f"--max-len must be at least 2 (one trained position), got {self.max_len}")
        if self.min_answer < 0 or self.min_answer >= self.max_len:
            raise UserError(f"--min-answer must be in [0, max-len), got {self.min_answer}")
        for name in ("topk", "shard_size", "image_answer_tokens", "max_new_tokens", "calib_prompts", "top_tokens",
                     "regen_batch"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.time_budget_s < float("inf"):
            raise UserError(f"--time-budget-s must be a number of seconds >= 0 (0: no budget), got "
                            f"{self.time_budget_s}")


# ---------------------------------------------------------------- sequences

def _extend(prompt: Prompt, tokens: list[int], family: str) -> Prompt:
    """The prompt followed by answer tokens, every per-token model input extended to match."""
    n = len(tokens)
    inputs = dict(prompt.model_inputs)
    for key in PER_TOKEN:
        if key in inputs:
            # attention_mask: 1; PaliGemma token_type_ids: 1 marks the causal suffix (HF generate does the same);
            # Gemma 3 token_type_ids / Qwen mm_token_type_ids: 0 = text
            fill = 1 if key == "attention_mask" or (key == "token_type_ids" and family == "paligemma") else 0
            extra = torch.tensor([tokens], dtype=inputs[key].dtype) if key == "input_ids" else \
                torch.full((1, n), fill, dtype=inputs[key].dtype)
            inputs[key] = torch.cat([inputs[key], extra], dim=1)
    return replace(prompt, input_ids=inputs["input_ids"], model_inputs=inputs)


def _truncate(prompt: Prompt, n: int, image_token_id: int | None) -> Prompt | None:
    """The first n tokens, or None when that would cut image tokens (the vision features need them all)."""
    if prompt.length <= n:
        return prompt
    ids = prompt.input_ids[0]
    if image_token_id is not None and bool((ids[n:] == image_token_id).any()):
        return None
    inputs = {k: (v[:, :n] if k in PER_TOKEN else v) for k, v in prompt.model_inputs.items()}
    return replace(prompt, input_ids=inputs["input_ids"], model_inputs=inputs)


def _keep_tail(prompt: Prompt, config: DataConfig) -> Prompt:
    """A text prompt too long to leave `min_answer` answer tokens loses its head (the tail, next to the
    answer, is what the draft conditions on), so that every sequence carries trained positions."""
    if not config.min_answer or prompt.has_image:
        return prompt
    return prompt.tail(config.max_len - config.min_answer)


def answer_budget(prompt: Prompt, item: PromptItem, config: DataConfig) -> int:
    """How many answer tokens the target generates for `item` (0 when the dataset answer is used)."""
    if config.mode == "teacher" and item.answer is not None:
        return 0
    budget = config.max_new_tokens if config.mode == "regenerate" else config.image_answer_tokens
    return max(0, min(budget, config.max_len - prompt.length))


def _answer_tokens(target: TargetModel, prompt: Prompt, item: PromptItem, config: DataConfig) -> list[int]:
    room = config.max_len - prompt.length
    if config.mode == "teacher" and item.answer is not None:
        end = target.tokenizer.eos_token_id  # the turn ends with the token the target stops on
        ids = target.tokenizer(item.answer, add_special_tokens=False)["input_ids"][: max(room, 0)]
        return ids + ([int(end)] if end is not None else [])
    n = answer_budget(prompt, item, config)
    return vanilla_generate(target, prompt, n).tokens if n >= 1 else []


def build_prompt(target: TargetModel, item: PromptItem, config: DataConfig) -> Prompt:
    return _keep_tail(target.build_prompt(item.text, item.image, item.history), config)


def build_sequence(target: TargetModel, item: PromptItem, config: DataConfig,
                   answer: list[int] | None = None) -> tuple[Prompt, int] | None:
    """(prompt + answer truncated to max_len, prompt length) or None when the image does not fit.
    `answer`: the target's answer when already generated (batched regeneration)."""
    prompt = build_prompt(target, item, config)
    tokens = answer if answer is not None else _answer_tokens(target, prompt, item, config)
    full = _extend(prompt, tokens, target.spec.family)
    full = _truncate(full, config.max_len, target.image_token_id)
    return None if full is None else (full, min(prompt.length, full.length))


# ---------------------------------------------------------------- features

def stored_layers(space: SearchSpace, num_layers: int, entropy_layer: int) -> tuple[int, ...]:
    """Non-negative hidden-state indices to store: the space's layer sets (entropy resolved), the entropy
    layer and the last hidden state (L), sorted."""
    space.check_target(num_layers)
    wanted = {entropy_layer, num_layers}
    for layer_set in space.feature_layers:
        for layer in space.resolve_layers(layer_set, entropy_layer):
            wanted.add(layer if layer >= 0 else num_layers + 1 + layer)
    return tuple(sorted(wanted))


@torch.no_grad()
def sequence_features(target: TargetModel, full: Prompt, prompt_len: int, layers: tuple[int, ...], topk: int) -> dict:
    """One target forward over a built sequence -> the per-sequence dict (FeatureData's item format)."""
    # attention statistics (eager attention, every layer's probabilities) only serve image-token selection;
    # text sequences skip them (zeros stored), which makes their forward several times cheaper
    has_image = full.has_image
    pre = target.prefill(full, feature_layers=layers, attention_stats=has_image, all_logits=True)
    logits = pre.logits  # (T, V) fp32
    lse = torch.logsumexp(logits, dim=-1)  # (T,)
    top = logits.topk(topk, dim=-1)  # (T, K), sorted by logit
    ids = full.input_ids[0].to(torch.long).cpu()  # (T,)
    t = ids.numel()
    image = torch.zeros(t, dtype=torch.bool)
    image[pre.image_positions.cpu()] = True
    # position t is trained when it and its next token are text; the last position has no next token
    loss = ~image
    loss[:-1] &= ~image[1:]
    loss[-1] = False
    return {
        "input_ids": ids,
        "hidden": {h: pre.hidden[h].float().cpu() for h in layers},  # {h: (T, H)}
        "topk_ids": top.indices.cpu(),  # (T, K) long
        "topk_logits": top.values.cpu(),  # (T, K) fp32
        "lse": lse.cpu(),  # (T,)
        "loss_mask": loss,  # (T,) bool
        "image_mask": image,  # (T,) bool
        "attn_entropy": pre.attn_entropy.T.contiguous().cpu() if has_image else torch.zeros(t, target.num_layers),
        "attn_received": pre.attn_received.cpu() if has_image else torch.zeros(t),  # (T,) fp32
        "prompt_len": torch.tensor(prompt_len, dtype=torch.long),
    }


def features_on_the_fly(target: TargetModel, item: PromptItem, config: DataConfig) -> dict | None:
    """The per-sequence dict straight from the frozen target (None if the prompt is skipped); equals
    what build_data stores for `item` (hidden states there rounded to bf16). `config.entropy_layer`
    must be set: FeatureData(dir).config carries the one the data was built with."""
    if config.entropy_layer is None:
        raise UserError("features_on_the_fly needs config.entropy_layer (take FeatureData(dir).config, or run "
                        "supernet.data.calibrate_entropy first)")
    layers = stored_layers(SearchSpace.load(config.space), target.num_layers, config.entropy_layer)
    seq = build_sequence(target, item, config)
    return None if seq is None else sequence_features(target, *seq, layers, config.topk)


def calibration_items(items: list[PromptItem], n: int) -> list[PromptItem]:
    """n prompts spread evenly over the list (centres of n equal parts), so image prompts, listed last, take part."""
    n = min(n, len(items))
    return [items[(2 * i + 1) * len(items) // (2 * n)] for i in range(n)]


def calibrate_entropy(target: TargetModel, items: list[PromptItem], config: DataConfig,
                      built: dict[str, tuple[Prompt, int] | None] | None = None) -> EntropyChoice:
    """The entropy layer from config.calib_prompts of `items`; the sequences built are kept in `built`."""
    from tqdm import tqdm

    built = {} if built is None else built
    entropies = []
    for item in tqdm(calibration_items(items, config.calib_prompts), desc="entropy calibration", unit="prompt",
                     disable=None):
        if item.id not in built:
            built[item.id] = build_sequence(target, item, config)
        if built[item.id] is not None:
            entropies.append(target.prefill(built[item.id][0], attention_stats=True).attn_entropy.cpu())  # (L, T)
    if not entropies:
        raise UserError("no calibration sequence could be built (every image was cut by --max-len); raise --max-len")
    return calibrate(entropies)


# ---------------------------------------------------------------- the build

def load_prompts(config: DataConfig, is_vlm: bool, target_name: str) -> list[PromptItem]:
    cache = Path(config.cache_dir) if config.cache_dir else None
    items = parse_prompt_spec(config.prompts, split=config.split, max_chars=config.max_prompt_chars, cache_dir=cache)
    if not is_vlm and any(p.image for p in items):
        logger.warning("target %s is text-only: skipping %d image prompt(s)", target_name,
                       sum(bool(p.image) for p in items))
        items = [p for p in items if p.image is None]
    if not items:
        raise UserError(f"no prompts to build data from (spec '{config.prompts}'); ask for sharegpt:N")
    return items


def _resolve_entropy(target: TargetModel, items: list[PromptItem], config: DataConfig, old: dict | None,
                     built: dict) -> dict:
    """The manifest's entropy entry: forced by config, kept from an existing manifest, or calibrated."""
    if config.entropy_layer is not None:
        h = config.entropy_layer if config.entropy_layer >= 0 else target.num_layers + 1 + config.entropy_layer
        if not 0 <= h <= target.num_layers:
            raise UserError(f"--entropy-layer {config.entropy_layer} out of range for a {target.num_layers}-layer "
                            "target")
        if old is not None and old.get("entropy", {}).get("layer") == h:
            return old["entropy"]
        return {"layer": h, "source": "config"}
    if old is not None and old.get("entropy"):
        logger.info("entropy layer %d from the existing manifest", old["entropy"]["layer"])
        return old["entropy"]  # the layer the existing shards were built with
    return {**calibrate_entropy(target, items, config, built).to_dict(), "source": "calibration"}


def _plan_shards(out: Path, groups: list[list[PromptItem]], content_hash: str, fp_key: str) -> list[dict]:
    """Manifest entries of the shards; a shard is complete when its file holds these prompts, built alike."""
    shards = []
    for j, group in enumerate(groups):
        ids = [p.id for p in group]
        meta = read_shard_meta(out / shard_name(j))
        if meta is not None and meta.get("fingerprint") not in (None, fp_key):
            raise UserError(f"{out / shard_name(j)} was built for another target; use another --out")
        ok = meta is not None and meta.get("format") == FORMAT and meta.get("content") == content_hash \
            and meta.get("fingerprint") == fp_key and json.loads(meta.get("prompt_ids", "[]")) == ids
        entry = {"file": shard_name(j), "prompt_ids": ids, "complete": ok}
        if ok:
            entry.update(sequence_ids=json.loads(meta["sequence_ids"]), skipped=json.loads(meta["skipped"]),
                         regen_refused=json.loads(meta.get("regen_refused", "[]")),
                         sequences=int(meta["sequences"]), tokens=int(meta["tokens"]))
        shards.append(entry)
    return shards


def is_greedy_fixed_point(features: dict) -> bool:
    """Whether every answer token of a built sequence is the target's argmax after its prefix, as computed
    by the sequence's own forward (features: sequence_features' dict): what a batched answer must pass to be
    held-out data, whose replayed tau is exact only on the target's greedy continuation."""
    ids, p = features["input_ids"], int(features["prompt_len"])
    return bool(torch.equal(features["topk_ids"][p - 1:-1, 0], ids[p:])) if p >= 1 else False


def _build_shard(target: TargetModel, out: Path, entry: dict, group: list[PromptItem], config: DataConfig,
                 layers: tuple[int, ...], meta: dict[str, str], built: dict, bar) -> None:
    """Features of one shard's prompts, written atomically; `entry` (its manifest row) is completed."""
    seqs, ids, skipped, refused = [], [], {}, []
    answers = regenerate_batched(target, [p for p in group if p.id not in built], config)
    for item in group:
        bar.set_postfix_str(item.id[:24])
        seq = built.pop(item.id) if item.id in built else build_sequence(target, item, config, answers.get(item.id))
        if seq is None:
            skipped[item.id] = f"image cut by max_len {config.max_len}"
            logger.warning("skipping %s: its image tokens do not fit in --max-len %d", item.id, config.max_len)
        else:
            features = sequence_features(target, *seq, layers, config.topk)
            if config.split == "heldout" and item.id in answers and not is_greedy_fixed_point(features):
                # a padded batch flipped a near-tied argmax: the one-at-a-time answer is the reference
                refused.append(item.id)
                logger.warning("held-out %s: the batched answer is not the target's greedy continuation; "
                               "generating it alone", item.id)
                features = sequence_features(target, *build_sequence(target, item, config), layers, config.topk)
            seqs.append(features)
            ids.append(item.id)
        bar.update(1)
    tokens = sum(int(s["input_ids"].numel()) for s in seqs)
    write_shard(out / entry["file"], seqs, {**meta, "prompt_ids": json.dumps(entry["prompt_ids"]),
                                            "sequence_ids": json.dumps(ids), "skipped": json.dumps(skipped),
                                            "sequences": str(len(seqs)), "tokens": str(tokens),
                                            "regen_refused": json.dumps(refused)})
    entry.update(complete=True, sequence_ids=ids, skipped=skipped, sequences=len(seqs), tokens=tokens,
                 regen_refused=refused)


def _budget_spent(config: DataConfig, seconds: float, shards: list[dict]) -> bool:
    """No new shard once `seconds` reach config.time_budget_s (> 0), provided one shard is complete."""
    return 0 < config.time_budget_s <= seconds and any(s["complete"] for s in shards)


def regenerate_batched(target: TargetModel, items: list[PromptItem], config: DataConfig) -> dict[str, list[int]]:
    """{prompt id: the target's answer} for the text prompts of `items`, in left-padded batches of
    config.regen_batch sorted by length (regenerate mode, regen_batch > 1; else empty)."""
    from decode.loop.batched import batch_greedy, batchable

    if config.mode != "regenerate" or config.regen_batch <= 1:
        return {}
    todo = []
    for item in items:
        prompt = build_prompt(target, item, config)
        n = answer_budget(prompt, item, config)
        if batchable(prompt) and n >= 1:
            todo.append((prompt.length, item.id, prompt, n))
    todo.sort(key=lambda x: x[0])  # similar lengths together: less padding
    out: dict[str, list[int]] = {}
    for i in range(0, len(todo), config.regen_batch):
        chunk = todo[i: i + config.regen_batch]
        for (_, pid, _, _), answer in zip(chunk, batch_greedy(target, [c[2] for c in chunk], [c[3] for c in chunk])):
            out[pid] = answer
    return out


def build_data(config: DataConfig, target: TargetModel | None = None) -> Path:
    """Build (or finish) the data directory config.out; returns it. `target` skips loading config.target."""
    from tqdm import tqdm

    from decode.benchio import environment
    from decode.paths import writable_dir
    from decode.targets.loader import load_target

    config.check()
    out = writable_dir(config.out)  # before the target loads and minutes of feature extraction
    old = read_manifest(out)
    if target is None:
        target = load_target(config.target, device=config.device, dtype=config.dtype,
                             cache_dir=Path(config.cache_dir) if config.cache_dir else None)
    fp = target.fingerprint().to_dict()
    if old is not None:
        check_target(old, fp, target.name, out)
    if config.topk > target.vocab_size:
        raise UserError(f"--topk {config.topk} exceeds the target vocabulary ({target.vocab_size})")
    space = SearchSpace.load(config.space)
    space.check_target(target.num_layers)
    items = load_prompts(config, target.is_vlm, target.name)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    built: dict[str, tuple[Prompt, int] | None] = {}  # sequences built during calibration, reused below
    entropy = _resolve_entropy(target, items, config, old, built)
    layers = stored_layers(space, target.num_layers, int(entropy["layer"]))
    # the settings that shape every shard: a rerun must match them (the prompt list may change: per-shard check)
    content = {"mode": config.mode, "max_len": config.max_len, "topk": config.topk, "layers": list(layers),
               "entropy_layer": int(entropy["layer"]), "image_answer_tokens": config.image_answer_tokens,
               "max_new_tokens": config.max_new_tokens, "min_answer": config.min_answer, "dtype": str(target.dtype).removeprefix("torch."),
               "format": FORMAT}
    before = (old or {}).get("content", {})
    if old is not None and before != content:
        diff = ", ".join(f"{k}={before.get(k)!r} (now {v!r})" for k, v in content.items() if before.get(k) != v)
        raise UserError(f"{out} was built with other settings: {diff}; rerun with those or use another --out")
    meta = {"content": hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16],
            "fingerprint": f"{fp['config_hash']}:{fp['weights_digest']}"}
    groups = [items[i: i + config.shard_size] for i in range(0, len(items), config.shard_size)]  # fixed assignment
    shards = _plan_shards(out, groups, meta["content"], meta["fingerprint"])
    for extra in sorted(set(out.glob("shard-*.safetensors")) - {out / s["file"] for s in shards}):
        extra.unlink()  # the prompt list got shorter: a shard past its end holds prompts no longer asked for
    manifest = {"format": FORMAT, "config": asdict(config), "content": content,
                "target": {"name": target.name, "fingerprint": fp, "dtype": content["dtype"], "is_vlm": target.is_vlm,
                           "image_token_id": target.image_token_id},
                "layers": list(layers), "entropy": entropy,
                "split": {"split": config.split, "rule": "decode.datasets.split_of", "heldout_fraction": 0.02,
                          "reserve_from": RESERVE_FROM, "heldout_photos": list(HELDOUT_PHOTOS)},
                "shards": shards, "complete": False, "environment": environment(target.device),
                "runs": (old or {}).get("runs", [])}
    write_json_atomic(out / MANIFEST, manifest)

    todo = [j for j, s in enumerate(shards) if not s["complete"]]
    n_todo = sum(len(groups[j]) for j in todo)
    lens = [s[0].length for s in built.values() if s is not None]  # calibration sequences, when there were any
    mean_len = round(sum(lens) / len(lens)) if lens else config.max_len
    bpt = bytes_per_token(len(layers), target.hidden_size, config.topk, target.num_layers)
    if todo:
        logger.info("data: %d prompts in %d shards (%d to build) -> %s; about %.1f MB to write (%d B/token x ~%d "
                    "tokens; at most %.1f MB)", len(items), len(groups), len(todo), out, bpt * mean_len * n_todo / 1e6,
                    bpt, mean_len * n_todo, bpt * config.max_len * n_todo / 1e6)
    else:
        logger.info("data: all %d shards in %s are complete; nothing to build", len(groups), out)
    with tqdm(total=len(items), initial=len(items) - n_todo, desc="features", unit="prompt", disable=None) as bar:
        for j in todo:
            # the last shard may end past the budget: under a deadline training takes what the clock leaves, and a
            # guess of the next shard's time misleads (the first shard, holding the photos, takes 2-3x a text one)
            if _budget_spent(config, time.perf_counter() - start, shards):
                break
            _build_shard(target, out, shards[j], groups[j], config, layers, meta, built, bar)
            write_json_atomic(out / MANIFEST, manifest)  # a partial run is readable (complete shards only)

    seconds = time.perf_counter() - start
    done = [j for j in todo if shards[j]["complete"]]
    new_tokens = sum(shards[j]["tokens"] for j in done)
    run = {"date": manifest["environment"]["date"], "seconds": round(seconds, 2), "shards_built": len(done),
           "new_tokens": new_tokens, "tokens_per_s": round(new_tokens / seconds, 1) if seconds > 0 else None,
           "torch_threads": torch.get_num_threads()}
    if len(done) < len(todo):  # the time budget ran out: the folder is what was built; the rest of the prompts unused
        kept = [s for s in shards if s["complete"]]
        manifest["budget"] = {"time_budget_s": config.time_budget_s, "shards": len(kept), "of": len(shards),
                              "prompts_unused": sum(len(s["prompt_ids"]) for s in shards if not s["complete"])}
        logger.warning("data: the %.0f-s time budget is spent after %d of %d shards; %d prompts unused (a later "
                       "run builds them)", config.time_budget_s, len(kept), len(shards),
                       manifest["budget"]["prompts_unused"])
        shards = manifest["shards"] = kept
        run["stopped_by_budget"] = True
    manifest.update(summarize_shards(out, shards, target.vocab_size, target.num_layers, config.top_tokens),
                    complete=True, skipped={k: v for s in shards for k, v in s["skipped"].items()},
                    regen_refused=[k for s in shards for k in s.get("regen_refused", [])],
                    bytes=sum((out / s["file"]).stat().st_size for s in shards),
                    runs=manifest["runs"] + [run])  # one entry per invocation (resumes included)
    write_json_atomic(out / MANIFEST, manifest)
    return out


# ---------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    from decode.cli import add_target_args

    d = DataConfig()
    p = argparse.ArgumentParser(prog="python -m supernet.data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--scale", default=None,
                   help="take prompts/mode/max-len/topk from configs/scale/<scale>.yaml (explicit flags win)")
    p.add_argument("--split", choices=("train", "heldout"), default=d.split,
                   help=f"prompt split: train for supernet.train, heldout for nas.search (default: {d.split})")
    p.add_argument("--prompts", default=None,
                   help="prompt spec: sharegpt:N, images:N, chat:N (held-out split: later messages after the "
                        f"exchange before them) (default: {d.prompts})")
    p.add_argument("--mode", choices=MODES, default=None,
                   help=f"answers: the dataset's or the target's own (default: {d.mode})")
    p.add_argument("--max-len", type=int, default=None, help=f"tokens per sequence (default: {d.max_len})")
    p.add_argument("--topk", type=int, default=None, help=f"target logits kept per token (default: {d.topk})")
    p.add_argument("--space", default=None,
                   help="search space (YAML or name): which layers to store (default: tiny for tiny-* targets, "
                        "else default)")
    p.add_argument("--shard-size", type=int, default=None, help=f"prompts per shard (default: {d.shard_size})")
    p.add_argument("--out", default=d.out, help=f"data directory (default: {d.out})")
    p.add_argument("--image-answer-tokens", type=int, default=d.image_answer_tokens,
                   help=f"teacher mode: greedy answer length for image prompts (default: {d.image_answer_tokens})")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"regenerate mode: cap on the target's answer (default: {d.max_new_tokens})")
    p.add_argument("--min-answer", type=int, default=None,
                   help="answer tokens each text sequence keeps room for; a longer prompt loses its head "
                        "(default: 0 = off)")
    p.add_argument("--regen-batch", type=int, default=None,
                   help="regenerate mode: prompts answered per left-padded batch; on --split heldout each batched "
                        "answer is checked against the target's own forward (default: 1)")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help=f"ShareGPT prompts longer than this are not used (default: {d.max_prompt_chars})")
    p.add_argument("--calib-prompts", type=int, default=d.calib_prompts,
                   help=f"prompts whose attention entropy picks the entropy layer (default: {d.calib_prompts})")
    p.add_argument("--entropy-layer", type=int, default=None, help="use this hidden-state index instead of calibrating")
    p.add_argument("--time-budget-s", type=float, default=0.0,
                   help="start no shard once this run has spent this many seconds; the folder is then complete "
                        "with the shards built, and a later run goes on (default: 0 = every prompt)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (default: torch's choice; 1 is far faster on a busy machine)")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    return p


def main(argv: list[str] | None = None) -> int:
    from decode.cli import setup_logging

    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    logging.getLogger("supernet").setLevel(logging.INFO)  # the size estimate and the entropy layer
    if args.threads < 0:
        raise UserError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = {}
    if args.scale:
        from supernet.train import scale_defaults

        preset = scale_defaults(args.scale, "data")
    d = DataConfig()
    pick = {k: getattr(args, k) if getattr(args, k) is not None else preset.get(k, getattr(d, k))
            for k in ("prompts", "mode", "max_len", "topk", "max_new_tokens", "min_answer", "regen_batch", "shard_size")}
    pick["max_prompt_chars"] = args.max_prompt_chars if args.max_prompt_chars is not None \
        else preset.get("max_prompt_chars", d.max_prompt_chars)
    from supernet.train import scale_space

    space = args.space or (scale_space(args.scale, args.target) if args.scale else default_space_name(args.target))
    config = DataConfig(target=args.target, split=args.split, **pick, space=space, out=args.out,
                        image_answer_tokens=args.image_answer_tokens,
                        calib_prompts=args.calib_prompts, entropy_layer=args.entropy_layer,
                        time_budget_s=args.time_budget_s, device=args.device,
                        dtype=args.dtype, cache_dir=str(args.cache_dir) if args.cache_dir else None)
    out = build_data(config)
    m = read_manifest(out)
    c, run = m["counts"], m["runs"][-1]
    print(f"{m['target']['name']}: {c['sequences']} sequences, {c['tokens']} tokens ({c['loss_tokens']} trained), "
          f"{m['bytes'] / 1e6:.1f} MB in {out}; entropy layer {m['entropy']['layer']}; layers {m['layers']}; "
          f"this run: {run['shards_built']} shards, {run['seconds']:.1f} s ({run['tokens_per_s']} tokens/s)")
    return 0


if __name__ == "__main__":
    from decode.cli import run_cli

    run_cli(main)
