"""Inputs of a search: the trained supernet (checked against the target), the space, held-out sequences.

Held-out data: a FeatureData directory built from prompts the supernet never saw (--heldout-data),
or, failing that, the last N sequences of the supernet's training data. supernet.train keeps its
last `val_sequences` out of training, so N up to that number are unseen sequences; they are still
drawn from the TRAIN prompt split (and, in the default prompt lists, are image prompts, listed
last), so tau from them is an approximation of held-out tau, and it is logged as such.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from decode.datasets import conversation_of
from decode.drafts.model import TargetDims
from decode.errors import UserError
from decode.space import TREE_FIELDS, SearchSpace
from decode.targets.compat import check_fingerprint
from decode.targets.target import TargetModel
from supernet import checkpoint as ckpt
from supernet.dataset import FeatureData
from supernet.elastic import DraftSupernet

logger = logging.getLogger(__name__)


def space_from_dict(d: dict) -> SearchSpace:
    """The inverse of SearchSpace.to_dict (as stored in a supernet checkpoint)."""
    lists = {k: tuple(v) for k, v in d.items() if k not in ("name", "feature_layers")}
    return SearchSpace(name=d.get("name", "custom"), feature_layers=tuple(tuple(s) for s in d["feature_layers"]),
                       **lists)


def checkpoint_dir(path: str | Path) -> Path:
    """Accept the checkpoint folder itself or the training output folder that holds checkpoint/."""
    p = Path(path)
    if not (p / ckpt.STATE).is_file() and (p / "checkpoint" / ckpt.STATE).is_file():
        return p / "checkpoint"
    return p


def read_supernet_state(path: str | Path) -> dict:
    return ckpt.read_state(checkpoint_dir(path))


def supernet_digest(state: dict, checkpoint: str | Path, sequences: list[dict] = ()) -> str:
    """A supernet checkpoint's identity (its state and the size and time of its weight files), and optionally
    that of held-out sequences (their tokens): the key of stored tau sweeps and of a fine-tuning run. `checkpoint`
    is either form load_supernet accepts (the checkpoint folder or the training folder above it): both give one key."""
    import hashlib
    import json

    h = hashlib.sha256(json.dumps(state, sort_keys=True, default=str).encode())
    for f in sorted(checkpoint_dir(checkpoint).glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    for s in sequences:
        h.update(s["input_ids"].numpy().tobytes())
        h.update(str(int(s["prompt_len"])).encode())
    return h.hexdigest()


def load_supernet(path: str | Path, target: TargetModel) -> tuple[DraftSupernet, dict]:
    """The trained supernet of a checkpoint, attached to `target` (its device and dtype, eval); -> (supernet, state).

    UserError when the checkpoint was trained for another target (fingerprints differ).
    """
    directory = checkpoint_dir(path)
    state = ckpt.read_state(directory)
    diff = check_fingerprint(state["target"], target.fingerprint().to_dict(), f"supernet '{path}'")
    if diff:
        raise UserError(f"supernet '{path}' was trained for target '{state.get('target_name')}', not '{target.name}' "
                        f"({diff}); pass the matching --target or another --supernet")
    space = space_from_dict(state["space"])
    dims = TargetDims.of(target)
    # hot-token map: any placeholder of the right size; the checkpoint's d2t buffer replaces it on load
    model = DraftSupernet(space, dims, state.get("entropy_layer"), torch.arange(dims.vocab_size))
    ckpt.load_weights(directory, model)
    # the target's dtype, as the exported draft will run (extract() + attach() cast to it): replayed tau
    # then matches real decoding on a bf16 GPU target too; fine-tuning casts to fp32 itself
    model.attach(target).eval()
    return model, state


def check_subspace(space: SearchSpace, supernet: DraftSupernet) -> None:
    """Every choice of `space` must be one the supernet was trained on (its weights cover it)."""
    full, e = supernet.space, supernet.entropy_layer
    for name in ("fusion", "depth", "heads", "ffn", "draft_vocab", "visual_keep", "tree_depth", "top_k",
                 "total_tokens"):
        extra = [v for v in getattr(space, name) if v not in getattr(full, name)]
        if extra and name not in TREE_FIELDS:
            raise UserError(f"search space '{space.name}' has {name} choices {extra} that supernet space "
                            f"'{full.name}' lacks; search a subset of the space the supernet was trained on")
        if extra:  # the tree is not part of the weights: any tree works, but log it
            logger.warning("search space '%s': %s choices %s were not trained for", space.name, name, extra)
    trained = {full.resolve_layers(s, e) for s in full.feature_layers}
    for s in space.feature_layers:
        if space.resolve_layers(s, e) not in trained:
            raise UserError(f"search space '{space.name}': feature layer set {list(s)} is not one the supernet "
                            f"was trained on ({[list(x) for x in full.feature_layers]})")


@dataclass(frozen=True)
class HeldOut:
    sequences: list[dict]
    source: str  # description, written into the study setup and the outputs
    approximate: bool
    directory: str | None = None  # the held-out data folder (None: the tail of the training data)


def heldout_sequences(target: TargetModel, supernet: DraftSupernet, state: dict, heldout_data: str | None,
                      n_last: int, space: SearchSpace) -> HeldOut:
    """Sequences for tau: every sequence of `heldout_data`, or the last `n_last` of the training data."""
    if heldout_data is not None:
        data = FeatureData(heldout_data, target)
        ids = list(range(len(data)))
        # the config's split (the manifest's "split" section of supernet.data says "train" whatever was built)
        split = data.manifest.get("config", {}).get("split", data.manifest.get("split", {}).get("split"))
        source, approx = f"{Path(heldout_data).resolve()} (all {len(ids)}, split {split})", split == "train"
        if approx:
            logger.warning("--heldout-data %s was built from the TRAIN prompt split: its prompts may be ones the "
                           "supernet trained on, so tau may be optimistic", heldout_data)
    else:
        train_dir = Path(state.get("data", ""))
        if not (train_dir / "manifest.json").is_file():
            raise UserError(f"the supernet's training data '{train_dir}' is gone; pass --heldout-data DIR")
        data = FeatureData(train_dir, target)
        if n_last < 1 or n_last >= len(data):
            raise UserError(f"--heldout {n_last}: need 1..{len(data) - 1} of the {len(data)} training sequences")
        ids = list(range(len(data) - n_last, len(data)))
        val = int(state.get("config", {}).get("val_sequences", 0))
        source, approx = f"{train_dir.resolve()} (last {n_last} of {len(data)})", True
        logger.warning("tau is estimated on the last %d training sequences (%s trained on); this is approximate: "
                       "build held-out data and pass --heldout-data", n_last,
                       "none" if n_last <= val else f"{n_last - val}")
    for s in space.feature_layers:
        for layer in space.resolve_layers(s, supernet.entropy_layer):
            data.layer_index(layer)  # UserError when the data lacks a layer the space feeds the draft
    # each labelled with its conversation (decode.datasets.conversation_of): tau intervals resample those whole
    seqs = [{**data[i], "group": conversation_of(data.ids[i])} for i in ids]
    seqs = [s for s in seqs if int(s["input_ids"].numel()) > int(s["prompt_len"]) + 1]
    if not seqs:
        raise UserError(f"no held-out sequence in {data.dir} has an answer to replay (prompts fill max_len?); "
                        "rebuild the data with a larger --max-len")
    if data.manifest.get("content", {}).get("mode") == "teacher":
        approx = True
        logger.warning("held-out data %s holds dataset answers (teacher mode): tau is approximate; --mode regenerate "
                       "makes it exact", data.dir)
    return HeldOut(seqs, source, approx, str(data.dir) if heldout_data is not None else None)


def trial_subset(sequences: list[dict], n: int | None) -> list[dict]:
    """The first `n` held-out sequences with the image share of the whole set (at least one image sequence
    when the set has any and n >= 2), in their order; all of them when n is None or covers the set.

    Trials score on this subset (each trial's tree sweep costs a draft forward per level and cycle); the
    contenders of the final table are re-scored on the whole set (nas/choose.py confirm_rows)."""
    if n is None or n >= len(sequences):
        return list(sequences)
    has_image = [bool(s["image_mask"].any()) for s in sequences]
    image = [i for i, x in enumerate(has_image) if x]
    text = [i for i, x in enumerate(has_image) if not x]
    k = round(n * len(image) / len(sequences))
    k = min(len(image), max(k, 1 if image and n >= 2 else 0), n)
    keep = set(image[:k]) | set(text[: n - k])
    return [s for i, s in enumerate(sequences) if i in keep]
