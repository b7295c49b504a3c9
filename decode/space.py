"""SearchSpace: the choices for every DraftArch field, read from configs/space/*.yaml.

    fusion          list of fusion kinds
    feature_layers  list of candidate layer sets; an entry may hold the string "entropy", the
                    intermediate layer chosen by attention entropy (resolved from the training data)
    depth           list of draft depths
    heads, ffn      per-layer choices (every layer picks independently)
    draft_vocab     list of LM-head sizes (null = the full vocabulary)
    visual_keep     list of image-token keep ratios
    tree_depth, top_k, total_tokens   tree choices

`sample(rng)`, `largest()`, `smallest()`, `size()`, `validate(arch)`; the supernet is sized by
`largest()`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from configs import config_dir
from decode.arch import FUSIONS, DraftArch, max_tree_nodes
from decode.errors import UserError

ENTROPY = "entropy"
_LISTS = ("fusion", "feature_layers", "depth", "heads", "ffn", "draft_vocab", "visual_keep",
          "tree_depth", "top_k", "total_tokens")
TREE_FIELDS = ("tree_depth", "top_k", "total_tokens")  # how a draft is run, not part of its weights


def weights_part(space: dict) -> dict:
    """A space's to_dict (as saved in checkpoints) without its tree choices, which are not part of the weights."""
    return {k: v for k, v in space.items() if k not in TREE_FIELDS}


def default_space_name(target: str) -> str:
    """The space a target gets when none is named: `tiny` for the tiny-* test targets, else `default`."""
    return "tiny" if Path(str(target)).name.startswith("tiny-") else "default"


@dataclass(frozen=True)
class SearchSpace:
    fusion: tuple[str, ...]
    feature_layers: tuple[tuple[int | str, ...], ...]
    depth: tuple[int, ...]
    heads: tuple[int, ...]
    ffn: tuple[int, ...]
    draft_vocab: tuple[int | None, ...]
    visual_keep: tuple[float, ...]
    tree_depth: tuple[int, ...]
    top_k: tuple[int, ...]
    total_tokens: tuple[int, ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        for f in _LISTS:
            v = getattr(self, f)
            if not v:
                raise UserError(f"search space '{self.name}': '{f}' has no choices")
        bad = set(self.fusion) - set(FUSIONS)
        if bad:
            raise UserError(f"search space '{self.name}': unknown fusion {sorted(bad)}; use {', '.join(FUSIONS)}")
        for name in ("depth", "heads", "ffn", "tree_depth", "top_k", "total_tokens"):
            if min(getattr(self, name)) < 1:
                raise UserError(f"search space '{self.name}': every '{name}' choice must be >= 1")
        if any(v is not None and v < 2 for v in self.draft_vocab):
            raise UserError(f"search space '{self.name}': draft_vocab choices must be >= 2 or null")
        if any(not 0 < v <= 1 for v in self.visual_keep):
            raise UserError(f"search space '{self.name}': visual_keep choices must be in (0, 1]")

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path | None = None) -> "SearchSpace":
        """A YAML file, or a name under configs/space/ (default: default)."""
        p = Path(path) if path is not None else config_dir("space") / "default.yaml"
        if not p.is_file():
            named = config_dir("space") / f"{path}.yaml"
            if not named.is_file():
                known = ", ".join(sorted(f.stem for f in config_dir("space").glob("*.yaml")))
                raise UserError(f"search space '{path}' not found; give a YAML file or one of: {known}")
            p = named
        raw = yaml.safe_load(p.read_text()) or {}
        unknown = set(raw) - set(_LISTS)
        if unknown:
            raise UserError(f"search space {p}: unknown keys {sorted(unknown)}; known: {', '.join(_LISTS)}")
        missing = set(_LISTS) - set(raw)
        if missing:
            raise UserError(f"search space {p}: missing keys {sorted(missing)}")
        sets = tuple(tuple(s) if isinstance(s, (list, tuple)) else (s,) for s in raw["feature_layers"])
        return cls(name=p.stem, **{k: tuple(raw[k]) for k in _LISTS if k != "feature_layers"}, feature_layers=sets)

    def to_dict(self) -> dict:
        return {f.name: ([list(v) for v in getattr(self, f.name)] if f.name == "feature_layers"
                         else list(getattr(self, f.name)) if isinstance(getattr(self, f.name), tuple)
                         else getattr(self, f.name)) for f in fields(self)}

    def weights_dict(self) -> dict:
        """to_dict without the tree choices: two spaces with equal weights_dict train the same supernet."""
        return weights_part(self.to_dict())

    # ------------------------------------------------------------------ binding to a target
    def check_target(self, num_layers: int, vocab_size: int | None = None) -> None:
        """Every choice must be realisable on this target (layer indices exist, vocab fits)."""
        for s in self.feature_layers:
            for layer in s:
                if layer == ENTROPY:
                    continue
                if not isinstance(layer, int) or not -(num_layers + 1) <= layer <= num_layers:
                    raise UserError(f"search space '{self.name}': feature layer {layer!r} out of range for a "
                                    f"{num_layers}-layer target (use -{num_layers + 1}..{num_layers} or 'entropy')")
        if vocab_size is not None and any(v is not None and v > vocab_size for v in self.draft_vocab):
            raise UserError(f"search space '{self.name}': a draft_vocab choice exceeds the target vocabulary ({vocab_size})")

    def resolve_layers(self, layers: tuple[int | str, ...], entropy_layer: int | None) -> tuple[int, ...]:
        out = []
        for layer in layers:
            if layer == ENTROPY:
                if entropy_layer is None:
                    raise UserError("this feature-layer choice needs the entropy-chosen layer; build data first (supernet.data)")
                layer = entropy_layer
            if layer not in out:
                out.append(layer)
        return tuple(out)

    # ------------------------------------------------------------------ the verbs
    def _arch(self, fusion, layers, depth, heads, ffn, vocab, keep, td, k, total, entropy_layer) -> DraftArch:
        total = min(total, max_tree_nodes(td, k))
        return DraftArch(fusion=fusion, feature_layers=self.resolve_layers(layers, entropy_layer), depth=depth,
                         heads=tuple(heads), ffn=tuple(ffn), draft_vocab=vocab, visual_keep=keep,
                         tree_depth=td, top_k=k, total_tokens=total)

    def sample(self, rng: random.Random, entropy_layer: int | None = None) -> DraftArch:
        depth = rng.choice(self.depth)
        return self._arch(
            rng.choice(self.fusion), rng.choice(self.feature_layers), depth,
            [rng.choice(self.heads) for _ in range(depth)], [rng.choice(self.ffn) for _ in range(depth)],
            rng.choice(self.draft_vocab), rng.choice(self.visual_keep), rng.choice(self.tree_depth),
            rng.choice(self.top_k), rng.choice(self.total_tokens), entropy_layer)

    def largest(self, entropy_layer: int | None = None) -> DraftArch:
        """Every dimension at its maximum (the supernet's shape); hybrid fusion, the widest layer set."""
        depth = max(self.depth)
        fusion = "hybrid" if "hybrid" in self.fusion else self.fusion[-1]
        layers = max(self.feature_layers, key=len)
        vocab = None if None in self.draft_vocab else max(self.draft_vocab)
        return self._arch(fusion, layers, depth, [max(self.heads)] * depth, [max(self.ffn)] * depth, vocab,
                          max(self.visual_keep), max(self.tree_depth), max(self.top_k), max(self.total_tokens),
                          entropy_layer)

    def smallest(self, entropy_layer: int | None = None) -> DraftArch:
        depth = min(self.depth)
        fusion = "concat" if "concat" in self.fusion else self.fusion[0]
        layers = min(self.feature_layers, key=len)
        vocab = min((v for v in self.draft_vocab if v is not None), default=None)
        return self._arch(fusion, layers, depth, [min(self.heads)] * depth, [min(self.ffn)] * depth, vocab,
                          min(self.visual_keep), min(self.tree_depth), min(self.top_k), min(self.total_tokens),
                          entropy_layer)

    def eagle_like(self, entropy_layer: int | None = None) -> DraftArch:
        """The EAGLE-1/2 draft as far as the space allows: concat fusion over the last hidden state, one layer
        of the largest heads/FFN, full vocabulary, every image token, a mid-sized tree (median choices). The
        reference every search result is compared with, and a sandwich role of supernet training (eagle_role)."""
        def median(values):
            ordered = sorted(values)
            return ordered[(len(ordered) - 1) // 2]
        last = [s for s in self.feature_layers if tuple(s) == (-1,)]
        depth = 1 if 1 in self.depth else min(self.depth)
        return self._arch("concat" if "concat" in self.fusion else self.fusion[0],
                          last[0] if last else self.feature_layers[0], depth,
                          [max(self.heads)] * depth, [max(self.ffn)] * depth,
                          None if None in self.draft_vocab else max(self.draft_vocab),
                          1.0 if 1.0 in self.visual_keep else max(self.visual_keep),
                          median(self.tree_depth), median(self.top_k), median(self.total_tokens), entropy_layer)

    def size(self) -> int:
        """Number of distinct archs (per-layer heads/ffn choices counted per depth)."""
        per_layer = len(self.heads) * len(self.ffn)
        layers = sum(per_layer**d for d in self.depth)
        rest = [len(self.fusion), len(self.feature_layers), len(self.draft_vocab), len(self.visual_keep),
                len(self.tree_depth), len(self.top_k), len(self.total_tokens)]
        return layers * math.prod(rest)

    def validate(self, arch: DraftArch, entropy_layer: int | None = None, trees: bool = True) -> None:
        """UserError naming the first field of `arch` that this space cannot produce (trees False: its network only;
        any tree runs on the weights a supernet trained for this space)."""
        layer_sets = {self.resolve_layers(s, entropy_layer) if ENTROPY not in s or entropy_layer is not None else None
                      for s in self.feature_layers}
        checks = [
            ("fusion", arch.fusion in self.fusion),
            ("feature_layers", arch.feature_layers in layer_sets),
            ("depth", arch.depth in self.depth),
            ("heads", all(h in self.heads for h in arch.heads)),
            ("ffn", all(f in self.ffn for f in arch.ffn)),
            ("draft_vocab", arch.draft_vocab in self.draft_vocab),
            ("visual_keep", arch.visual_keep in self.visual_keep),
            ("tree_depth", arch.tree_depth in self.tree_depth),
            ("top_k", arch.top_k in self.top_k),
            ("total_tokens", arch.total_tokens in self.total_tokens
             or arch.total_tokens == max_tree_nodes(arch.tree_depth, arch.top_k)),
        ]
        for name, ok in checks:
            if not ok and (trees or name not in TREE_FIELDS):
                raise UserError(f"arch field {name}={getattr(arch, name)!r} is not in search space '{self.name}' "
                                f"(choices: {getattr(self, name)!r})")
