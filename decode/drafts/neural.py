"""NeuralDraft: runs a DraftModel inside the speculative loop.

Draft position j is fed (token x_j, target feature of position j-1). Pairs whose inputs are exact
(prompt tokens, accepted tokens, the root) are *committed* to the draft cache; tree nodes beyond
the root are tentative, fed with their parent's draft hidden as feature, and dropped after each
proposal. Committed pairs wait in `pending` until the next proposal feeds them together with the
root in one forward (the root's output starts the tree).

visual_keep < 1: only the image tokens that receive the most attention from the target at
prefill stay in the draft's view (its cache and its cross-attention memory).

On the compiled runtime (target.runtime == "compiled") the draft's cache lives in pre-allocated buffers
(StaticDraftKV) and each tree level runs through a compiled graph of its bucket
(decode/runtime/draft_step.py); `compile_levels = False` keeps the eager level forward there (A/B runs).
"""

from __future__ import annotations

import math

import torch

from decode.drafts.base import ModelDraft, TentativeSlots
from decode.drafts.model import DraftModel
from decode.drafts.static_kv import StaticDraftKV
from decode.runtime.compiled import GRAIN
from decode.runtime.draft_step import DraftStepRunner


class NeuralDraft(ModelDraft):
    def __init__(self, model: DraftModel, name: str = "neural"):
        self.model = model
        self.name = name
        arch = getattr(model, "active", model.arch)  # a supernet runs its active subnet
        self.feature_layers = arch.feature_layers
        self.visual_keep = arch.visual_keep
        self.attention_stats = arch.visual_keep < 1.0
        self.default_tree = arch.tree
        self.compile_levels = True  # on the compiled runtime: compiled level steps (False: eager ones, for A/B)
        self.runner: DraftStepRunner | None = None  # made on the first compiled-runtime generation, then kept
        self._static: StaticDraftKV | None = None

    def networks(self) -> tuple[torch.nn.Module, ...]:
        return (self.model,)

    # ------------------------------------------------------------------ state
    def _feats(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """{layer: (m, H)} -> (m, F*H) in feature_layers order."""
        return torch.cat([hidden[layer] for layer in self.feature_layers], dim=-1)

    def _new_cache(self, target):
        """A DraftKV (eager), or on the compiled runtime buffers as long as the target's static cache plus a grain
        for tentative nodes: one allocation (and one set of graphs) for every prompt that fits."""
        # target None: the search's replay (nas.acceptance), which has no target to follow
        self.static_levels = target is not None and target.runtime == "compiled" and self.compile_levels
        if not self.static_levels:
            return self.model.new_cache()
        if self.runner is None:
            self.runner = DraftStepRunner(self.model, target.device)
        capacity = target.static.max_len + GRAIN
        if self._static is not None and self._static.capacity >= capacity:
            self._static.reset()
        else:
            self._static = StaticDraftKV(len(self.model.active_layers()), capacity)
        return self._static

    def warm(self, policy, widest=None, root_rows=None) -> list[int]:
        if not getattr(self, "static_levels", False):
            return []
        return self.runner.warm(self.cache, widest or policy.widest_level(), root_rows or 0)

    @torch.no_grad()
    def start(self, target, prompt, prefill) -> None:
        self.cache = self._new_cache(target)
        feats = self._feats(prefill.hidden)  # (T, F*H)
        t = feats.shape[0]
        keep = torch.ones(t, dtype=torch.bool)
        img = prefill.image_positions.cpu()
        if img.numel() and self.visual_keep < 1.0:
            n_keep = max(1, math.ceil(self.visual_keep * img.numel()))
            score = prefill.attn_received.cpu()[img]
            keep[img] = False
            keep[img[score.topk(n_keep).indices]] = True
        pos = keep.nonzero().flatten().to(feats.device)  # positions the draft sees
        prev = torch.cat([feats.new_zeros(1, feats.shape[1]), feats[:-1]])  # feature of position j-1
        self.pending_tokens = prompt.input_ids[0].to(feats.device)[pos]
        self.pending_feats = prev[pos]
        self.pending_pos = pos
        if self.model.uses_cross:  # a concat-only draft has no cross memory: no projection to waste
            self.model.add_memory(self.cache, self.model.project_features(feats[pos]), pos)
        self.root_feat = feats[-1]  # the root (first generated token) pairs with the last prompt feature
        self.root_pos = t
        self.root_fed = False  # set when a proposal feeds the root (and the pending pairs) to the draft

    @torch.no_grad()
    def accept(self, path_tokens, path_hidden, bonus) -> None:
        feats = self._feats(path_hidden)  # (m, F*H): target features at root, a1 .. a_{m-1}
        m = feats.shape[0]
        pos = torch.arange(self.root_pos, self.root_pos + m, device=feats.device)
        # root already committed; a_i at root_pos + i pairs with the feature of its predecessor
        tokens = torch.tensor(path_tokens[1:], dtype=torch.long, device=feats.device)
        if self.root_fed:
            self.pending_tokens, self.pending_feats, self.pending_pos = tokens, feats[:-1], pos[1:]
        else:  # no tree was drafted this cycle (a merged draft's lookup-only cycle): the root joins the queue too
            root = torch.tensor(path_tokens[:1], dtype=torch.long, device=feats.device)
            self.pending_tokens = torch.cat([self.pending_tokens, root, tokens])
            self.pending_feats = torch.cat([self.pending_feats, self.root_feat[None], feats[:-1]])
            self.pending_pos = torch.cat([self.pending_pos, pos[:1], pos[1:]])
        self.root_fed = False
        if self.model.uses_cross:
            self.model.add_memory(self.cache, self.model.project_features(feats), pos)
        self.root_feat = feats[-1]
        self.root_pos = self.root_pos + m

    # ------------------------------------------------------------------ tree scoring
    def _device(self) -> torch.device:
        return self.model.feat_fc.weight.device

    def _begin(self, root: int, capacity: int, device: torch.device) -> None:
        self.slots = TentativeSlots(root_committed=True, capacity=capacity, device=device)
        self.hidden_of = torch.zeros(capacity, self.model.dims.hidden_size, device=device,
                                     dtype=self.model.act_dtype)  # node -> its draft hidden
        self.first_level = True  # a proposal's first call feeds the root

    def _node_logits(self, nodes, tokens, parents) -> torch.Tensor:
        model, cache = self.model, self.cache
        dev = self.root_feat.device
        tokens = tokens.to(dev)
        if self.first_level:
            self.first_level = False
            # pending committed pairs + the root, causal among themselves, all committed
            toks = torch.cat([self.pending_tokens, tokens])
            g = model.project_features(torch.cat([self.pending_feats, self.root_feat[None]]))
            pos = torch.cat([self.pending_pos, torch.tensor([self.root_pos], device=dev)])
            n, past = toks.numel(), cache.length
            allowed = torch.cat([torch.ones(n, past, dtype=torch.bool, device=dev),
                                 torch.ones(n, n, dtype=torch.bool, device=dev).tril()], dim=1)
            hidden, logits = self._level(toks, g, pos, allowed, last_only=True)
            cache.commit()
            self.root_fed = True
            self.hidden_of[0] = hidden[-1]
            return logits
        nodes, parents = nodes.to(dev), parents.to(dev)
        tent_mask, q_depths, _ = self.slots.add(nodes, parents)
        g = self.hidden_of[parents]  # (n, H): each parent's draft hidden (EAGLE)
        pos = self.root_pos + q_depths
        allowed = torch.cat([torch.ones(nodes.numel(), cache.committed, dtype=torch.bool, device=dev), tent_mask],
                            dim=1)
        hidden, logits = self._level(tokens, g, pos, allowed)
        self.hidden_of[nodes] = hidden.to(self.hidden_of.dtype)
        return logits

    def _level(self, tokens, g, pos, allowed, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One level: hidden (n, H) and logits (n, V) (or (1, V) of the last row), its entries appended to the cache."""
        if self.static_levels:
            return self.runner.step(tokens, g, pos, allowed, self.cache, last_only)
        hidden = self.model(tokens, g, pos, allowed, self.cache)
        return hidden, self.model.logits(hidden[-1:] if last_only else hidden)

    def _end(self) -> None:
        self.cache.drop_tentative()
        self.pending_tokens = self.pending_tokens[:0]
        self.pending_feats = self.pending_feats[:0]
        self.pending_pos = self.pending_pos[:0]

