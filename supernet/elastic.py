"""DraftSupernet: one weight-sharing network that contains every draft of a SearchSpace.

It is a decode.DraftModel of the space's largest shape (hybrid fusion, so both the concat fc and
the cross-attention modules exist) whose blocks can run a *leading slice* of their weights:

    heads   q/k/v rows and o columns of the first h heads (head_dim fixed to the target's)
    ffn     gate/up rows and down columns of the first f channels
    depth   the first `depth` layers
    vocab   the first draft_vocab rows of the hot-token head (rows ordered by token frequency);
            draft_vocab null = the target's own LM head (shared, frozen)
    layers  feat_fc has one column block per candidate feature layer (the union over the space);
            a subnet uses the blocks of its layers, in its order
    fusion  concat uses in_fc, cross uses the cross-attention, hybrid both

Verbs (once-for-all style): set_active(arch), sample(rng), extract(arch) -> decode.DraftModel with
copied weights; reorder_by_importance() sorts heads and FFN channels so the leading slices keep
the most important ones.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from decode.arch import DraftArch
from decode.drafts.blocks import CrossAttention, DraftLayer, SelfAttention, SwiGLU
from decode.drafts.model import DraftModel, TargetDims
from decode.errors import UserError
from decode.runtime.small_rows import linear
from decode.space import SearchSpace
from decode.targets.capture import normalize_layer
from supernet.grad_slices import part


class _HeadSlice:
    """Mixin: projections use the first `heads` heads of the max-size weights."""

    def set_heads(self, heads: int) -> None:
        self.heads = heads

    def w(self, name: str) -> torch.Tensor:
        full = getattr(self, name).weight
        n = self.heads * self.head_dim
        return part(full, (slice(None), slice(0, n)) if name == "o_proj" else (slice(0, n),))


class ElasticSelfAttention(_HeadSlice, SelfAttention):
    pass


class ElasticCrossAttention(_HeadSlice, CrossAttention):
    pass


class ElasticSwiGLU(SwiGLU):
    def __init__(self, hidden: int, ffn: int):
        super().__init__(hidden, ffn)
        self.width = ffn

    def w(self, name: str) -> torch.Tensor:
        full = getattr(self, name).weight
        return part(full, (slice(None), slice(0, self.width)) if name == "down_proj" else (slice(0, self.width),))


class ElasticDraftLayer(DraftLayer):
    attn_cls = ElasticSelfAttention
    cross_cls = ElasticCrossAttention
    mlp_cls = ElasticSwiGLU


def _ordered_union(sets: list[tuple[int, ...]]) -> tuple[int, ...]:
    out: list[int] = []
    for s in sets:
        out += [layer for layer in s if layer not in out]
    return tuple(out)


class DraftSupernet(DraftModel):
    layer_cls = ElasticDraftLayer

    def __init__(self, space: SearchSpace, dims: TargetDims, entropy_layer: int | None = None,
                 hot_tokens: torch.Tensor | None = None):
        space.check_target(dims.num_layers, dims.vocab_size)
        self.space, self.entropy_layer = space, entropy_layer
        # candidate layers in canonical (non-negative) numbering so that -1 and L are one block
        sets = [tuple(normalize_layer(x, dims.num_layers) for x in space.resolve_layers(s, entropy_layer))
                for s in space.feature_layers]
        union = _ordered_union(sets)
        reduced = [v for v in space.draft_vocab if v is not None]
        max_vocab = max(reduced) if reduced else None
        d2t = None
        if max_vocab is not None:
            hot = hot_tokens if hot_tokens is not None else torch.arange(dims.vocab_size)
            if hot.numel() < max_vocab:
                raise UserError(f"need {max_vocab} hot tokens for the largest draft_vocab, got {hot.numel()}")
            d2t = hot[:max_vocab]
        largest = space.largest(entropy_layer)
        shape = DraftArch(fusion="hybrid", feature_layers=union, depth=largest.depth, heads=largest.heads,
                          ffn=largest.ffn, draft_vocab=max_vocab)
        super().__init__(shape, dims, d2t=d2t)
        self.union = union
        # training-only head regressing the entropy-chosen intermediate feature (never exported)
        self.aux_proj = nn.Linear(dims.hidden_size, dims.hidden_size, bias=False)
        self.set_active(largest)

    # ------------------------------------------------------------------ the three verbs
    def set_active(self, arch: DraftArch) -> "DraftSupernet":
        self.space.validate(arch, self.entropy_layer, trees=False)  # the tree is not part of the weights
        self.active = arch
        self._cols = torch.cat([torch.arange(h * self.dims.hidden_size, (h + 1) * self.dims.hidden_size)
                                for h in (self.union.index(normalize_layer(x, self.dims.num_layers))
                                          for x in arch.feature_layers)])
        for i, layer in enumerate(self.layers[: arch.depth]):
            layer.attn.set_heads(arch.heads[i])
            layer.cross.set_heads(arch.heads[i])
            layer.mlp.width = arch.ffn[i]
        return self

    def sample(self, rng: random.Random) -> DraftArch:
        return self.space.sample(rng, self.entropy_layer)

    def extract(self, arch: DraftArch, target=None) -> DraftModel:
        """A standalone DraftModel of `arch` whose weights are copies of the active slices."""
        self.space.validate(arch, self.entropy_layer, trees=False)
        vd = arch.draft_vocab
        own = vd is not None and vd < self.dims.vocab_size
        sub = DraftModel(arch, self.dims, d2t=self.d2t[:vd].clone() if own else None)
        mine = self.state_dict()
        cols = self.set_active(arch)._cols
        with torch.no_grad():
            for name, t in sub.state_dict().items():
                if name == "d2t":  # set by the constructor (hot-token prefix, or identity for full vocab)
                    continue
                src = mine[name]
                if name == "feat_fc.weight":
                    src = src[:, cols]
                t.copy_(src[tuple(slice(0, n) for n in t.shape)])  # the leading block of every dim
        sub.to(self.feat_fc.weight.dtype)
        return sub.attach(target) if target is not None else sub

    # ------------------------------------------------------------------ active-subnet forward parts
    @property
    def uses_concat(self) -> bool:
        return self.active.uses_concat

    @property
    def uses_cross(self) -> bool:
        return self.active.uses_cross

    def active_layers(self) -> list[DraftLayer]:
        return list(self.layers[: self.active.depth])

    def project_features(self, feats: torch.Tensor) -> torch.Tensor:
        """(n, F*H) features in the active arch's layer order -> (n, H) through its column blocks."""
        w = part(self.feat_fc.weight, (1, self._cols))  # (H, F*H): the active layers' column blocks
        return linear(feats.to(w.dtype), w, self.feat_fc.bias)

    def head_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._own_active_head():
            return None
        vd = self.active.draft_vocab
        return part(self.head.weight, (slice(0, vd),)), self.d2t[:vd]

    def _own_active_head(self) -> bool:
        vd = self.active.draft_vocab
        return vd is not None and vd < self.dims.vocab_size

    def gather_head(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the active head: from the hot-token head itself where the subnet drafts a reduced vocabulary (its
        row ids index the leading draft_vocab rows), so that the backward adds into the head's gradient in place."""
        if not self._own_active_head():  # the target's own (frozen) LM head
            return weight[ids]
        return part(self.head.weight, (0, ids))

    # ------------------------------------------------------------------ importance ordering
    @torch.no_grad()
    def reorder_by_importance(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Sort heads and FFN channels by weight magnitude so leading slices keep the important ones.

        A permutation of heads (q/k/v rows, o columns, per head block) or of FFN channels (gate/up
        rows, down columns) leaves the largest subnet's function unchanged. AdamW moments of the
        permuted weights are permuted the same way.
        """
        d = self.dims.head_dim

        def permute(param: nn.Parameter, index: torch.Tensor, dim: int) -> None:
            param.data = param.data.index_select(dim, index)
            state = optimizer.state.get(param, {}) if optimizer is not None else {}
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == param.shape:
                    state[key] = value.index_select(dim, index)

        for layer in self.layers:
            for attn in (layer.attn, layer.cross):
                if attn is None:
                    continue
                score = attn.o_proj.weight.view(attn.o_proj.weight.shape[0], -1, d).norm(dim=(0, 2))  # (heads,)
                order = score.argsort(descending=True)
                rows = (order[:, None] * d + torch.arange(d, device=order.device)).flatten()
                for name in ("q_proj", "k_proj", "v_proj"):
                    permute(getattr(attn, name).weight, rows, 0)
                permute(attn.o_proj.weight, rows, 1)
            score = layer.mlp.down_proj.weight.norm(dim=0)  # (ffn,)
            order = score.argsort(descending=True)
            permute(layer.mlp.gate_proj.weight, order, 0)
            permute(layer.mlp.up_proj.weight, order, 0)
            permute(layer.mlp.down_proj.weight, order, 1)
