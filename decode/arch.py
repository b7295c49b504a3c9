"""DraftArch: one draft design (a point of the search space), frozen and JSON round-trippable.

Fields
    fusion          how target features enter the draft:
                    "concat"  EAGLE-style: input = fc([token embedding; target features])
                    "cross"   DREAM-style: draft layers cross-attend (tanh-gated) to target features
                    "hybrid"  both
    feature_layers  target layers whose hidden states feed the draft (HF numbering, negative from the end)
    depth           draft decoder layers
    heads, ffn      per-layer attention heads (head_dim = the target's) and FFN width
    draft_vocab     rows of the draft LM head (hot tokens, with a draft->target id map); None = full vocab
    visual_keep     fraction of image tokens whose features the draft sees (top by target attention)
    tree_depth, top_k, total_tokens
                    the draft tree: levels, children per expanded node, draft nodes kept for verification
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace

from decode.errors import UserError

FUSIONS = ("concat", "cross", "hybrid")


def max_tree_nodes(depth: int, top_k: int) -> int:
    """Most draft nodes an EAGLE-2 dynamic tree of `depth` levels can hold: top_k at level 1, then
    top_k * top_k new candidates per level (top_k expanded nodes with top_k children each)."""
    return top_k + (depth - 1) * top_k * top_k


@dataclass(frozen=True)
class TreeSpec:
    """Shape of the draft tree; the verify forward sees total_tokens + 1 tokens (the root too)."""

    tree_depth: int = 5
    top_k: int = 4
    total_tokens: int = 24

    def __post_init__(self) -> None:
        for name in ("tree_depth", "top_k", "total_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise UserError(f"tree parameter {name} must be an integer >= 1, got {v!r}")


@dataclass(frozen=True)
class DraftArch:
    fusion: str = "concat"
    feature_layers: tuple[int, ...] = (-1,)
    depth: int = 1
    heads: tuple[int, ...] = (4,)
    ffn: tuple[int, ...] = (1536,)
    draft_vocab: int | None = None
    visual_keep: float = 1.0
    tree_depth: int = 5
    top_k: int = 4
    total_tokens: int = 24

    def __post_init__(self) -> None:
        # normalise lists from JSON/YAML into tuples so equal archs hash equal
        for name in ("feature_layers", "heads", "ffn"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        if self.fusion not in FUSIONS:
            raise UserError(f"fusion must be one of {', '.join(FUSIONS)}, got '{self.fusion}'")
        if not self.feature_layers or len(set(self.feature_layers)) != len(self.feature_layers):
            raise UserError(f"feature_layers must be a non-empty list of distinct layers, got {list(self.feature_layers)}")
        if self.depth < 1:
            raise UserError(f"depth must be >= 1, got {self.depth}")
        if len(self.heads) != self.depth or len(self.ffn) != self.depth:
            raise UserError(f"heads and ffn need one entry per layer (depth {self.depth}), got {list(self.heads)} and {list(self.ffn)}")
        if min(self.heads) < 1 or min(self.ffn) < 1:
            raise UserError(f"heads and ffn entries must be >= 1, got {list(self.heads)} and {list(self.ffn)}")
        if self.draft_vocab is not None and self.draft_vocab < 2:
            raise UserError(f"draft_vocab must be >= 2 or null (full vocabulary), got {self.draft_vocab}")
        if not 0 < self.visual_keep <= 1:
            raise UserError(f"visual_keep must be in (0, 1], got {self.visual_keep}")
        self.tree  # validates the tree fields

    @property
    def tree(self) -> TreeSpec:
        return TreeSpec(self.tree_depth, self.top_k, self.total_tokens)

    def with_tree(self, tree: TreeSpec) -> "DraftArch":
        return replace(self, tree_depth=tree.tree_depth, top_k=tree.top_k, total_tokens=tree.total_tokens)

    def to_dict(self) -> dict:
        d = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftArch":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise UserError(f"unknown DraftArch fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "DraftArch":
        return cls.from_dict(json.loads(text))

    @property
    def uses_concat(self) -> bool:
        return self.fusion in ("concat", "hybrid")

    @property
    def uses_cross(self) -> bool:
        return self.fusion in ("cross", "hybrid")
