"""Draft checkpoints of every kind: what `--draft DIR` loads, from the "kind" in DIR/draft_config.json.

    neural          model.safetensors + the arch (decode.DraftModel)                    (no "kind": neural)
    neural+lookup   a neural draft whose trees are merged with prompt-lookup continuations ("lookup": LookupSpec,
                    "merge": union | switch, decode/drafts/merged.py)
    prompt-lookup   training-free: n-gram lookup only ("lookup": LookupSpec), no weights; with "corpus_depth" > 0 in
                    its lookup settings also a corpus branch, from DIR/corpus.safetensors (decode/drafts/corpus.py)
    layerskip       training-free: the target's first K layers draft a chain ("layerskip": {"layers": K,
                    "tree_depth": D}), no weights
    none            training-free: plain decoding (the search found nothing faster on that hardware)

The search (nas.search) exports whichever kind it predicts fastest; the training-free kinds need no
weights and work with any target, so only the neural kinds check the target fingerprint.
"""

from __future__ import annotations

import json
from pathlib import Path

from decode.arch import TreeSpec
from decode.drafts.base import Draft
from decode.drafts.corpus import CORPUS_NAME, NgramCorpus
from decode.drafts.layerskip import LayerSkipDraft
from decode.drafts.merged import MergedDraft
from decode.drafts.model import CONFIG_NAME, DraftModel
from decode.drafts.neural import NeuralDraft
from decode.drafts.none import NoDraft
from decode.drafts.pack import pack_for_decoding
from decode.drafts.prompt_lookup import LookupSpec, PromptLookupDraft
from decode.errors import UserError

KINDS = ("neural", "neural+lookup", "prompt-lookup", "layerskip", "none")
TRAINING_FREE = ("prompt-lookup", "layerskip", "none")
NEURAL_KINDS = ("neural", "neural+lookup")
FORMAT = "vlm-draft-nas/draft-v1"


def read_config(directory: str | Path) -> dict:
    """DIR/draft_config.json as a dict; UserError (one line) when missing or not a JSON object."""
    file = Path(directory) / CONFIG_NAME
    if not file.is_file():
        raise UserError(f"'{directory}' is not a draft checkpoint (no {CONFIG_NAME})")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{file} is not valid JSON ({err.__class__.__name__}); re-export the draft") from None
    if not isinstance(config, dict):
        raise UserError(f"{file} must hold a JSON object, not {type(config).__name__}; re-export the draft")
    kind = config.get("kind", "neural")
    if kind not in KINDS:
        raise UserError(f"{file}: unknown draft kind {kind!r}; expected one of {', '.join(KINDS)}")
    wrong = [k for k in ("target", "arch", "dims", "lookup", "layerskip", "metadata")
             if k in config and config[k] is not None and not isinstance(config[k], dict)]
    if wrong:
        raise UserError(f"{file}: {', '.join(repr(k) for k in wrong)} must be JSON objects, not "
                        f"{', '.join(type(config[k]).__name__ for k in wrong)}; re-export the draft")
    return config


def lookup_spec(config: dict, where: str) -> LookupSpec:
    raw = config.get("lookup")
    if not isinstance(raw, dict):
        raise UserError(f"{where}: a draft of kind {config.get('kind')!r} needs a \"lookup\" object in {CONFIG_NAME}")
    try:
        return LookupSpec.from_dict(raw)
    except (TypeError, ValueError) as err:
        raise UserError(f"{where}: bad \"lookup\" settings ({err})") from None


def layerskip_settings(config: dict, where: str) -> tuple[int, int]:
    """(K layers, chain depth D) of a layerskip checkpoint's "layerskip" object."""
    raw = config.get("layerskip")
    ok = isinstance(raw, dict) and all(isinstance(raw.get(k), int) and raw[k] >= 1 for k in ("layers", "tree_depth"))
    if not ok:
        raise UserError(f"{where}: a draft of kind 'layerskip' needs \"layerskip\": "
                        f"{{\"layers\": K, \"tree_depth\": D}} with integers >= 1 in {CONFIG_NAME}")
    return raw["layers"], raw["tree_depth"]


def load_corpus(directory: str | Path, spec: LookupSpec, target) -> NgramCorpus | None:
    """DIR/corpus.safetensors when the lookup settings use a corpus branch (None otherwise)."""
    if not spec.uses_corpus:
        return None
    path = Path(directory) / CORPUS_NAME
    if not path.is_file():
        raise UserError(f"{directory}: its lookup has corpus branches or leaf chains but no {CORPUS_NAME}; "
                        "export it again or build one with python -m decode.corpus")
    return NgramCorpus.load(path, vocab_size=target.vocab_size)


def load_draft_dir(directory: str | Path, target, with_lookup: bool = False) -> Draft:
    """The draft a checkpoint directory holds; with_lookup merges lookup into a neural one (DIR+lookup)."""
    config = read_config(directory)
    kind, name = config.get("kind", "neural"), Path(directory).name
    if kind in TRAINING_FREE:  # named after their folder too: a bench may run it beside plain lookup
        if kind == "layerskip":
            k, depth = layerskip_settings(config, str(directory))
            draft = LayerSkipDraft(k, TreeSpec(tree_depth=depth, top_k=1, total_tokens=depth))
        elif kind == "none":
            draft = NoDraft()
        else:
            spec = lookup_spec(config, str(directory))
            draft = PromptLookupDraft(spec=spec, corpus=load_corpus(directory, spec, target))
        draft.name = f"{name}:{kind}"
        return draft
    model = DraftModel.from_pretrained(directory, target)
    pack_for_decoding(model)  # bfloat16 linear weights where the CPU kernel reads them (float32 on disk)
    neural = NeuralDraft(model, name=name)
    if kind == "neural+lookup":
        spec = lookup_spec(config, str(directory))
        return MergedDraft(neural, spec, str(config.get("merge", "union")), load_corpus(directory, spec, target))
    return MergedDraft(neural) if with_lookup else neural


def save_training_free(directory: str | Path, kind: str, target, lookup: LookupSpec | None,
                       metadata: dict | None = None, layerskip: tuple[int, int] | None = None) -> Path:
    """A weightless checkpoint that `--draft DIR` loads: kind prompt-lookup, layerskip ((K layers, chain
    depth)) or none."""
    from dataclasses import asdict

    if kind not in TRAINING_FREE:
        raise ValueError(f"not a training-free kind: {kind}")
    if kind == "layerskip" and layerskip is None:
        raise ValueError("kind layerskip needs layerskip=(K, depth)")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = {"format": FORMAT, "kind": kind, "target_name": target.name,
              "target": target.fingerprint().to_dict(), "metadata": metadata or {}}
    if kind == "prompt-lookup":
        config["lookup"] = asdict(lookup or LookupSpec())
    if kind == "layerskip":
        config["layerskip"] = {"layers": int(layerskip[0]), "tree_depth": int(layerskip[1])}
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
    return out
