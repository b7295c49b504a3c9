"""Draft component tables: the pieces one NeuralDraft forward (and accept) is made of.

A draft forward over n tokens (decode.drafts.model.DraftModel.forward + the scorer) is

    draft_input    embed(tokens) (n, H) [+ in_fc(cat[embed, g]) (n, 2H) -> (n, H) for concat/hybrid]
    draft_layer    per layer: DraftLayer(x, ...) over a cache of ctx committed entries (+ gated
                   cross-attention to a memory of ctx target features) and the cache append
    lm_head        model.logits(h): norm + head rows (scattered into the target vocab for a draft vocab)
    scorer         log_softmax and top-k over the (n, target vocab) logits, as _Scorer/build_tree do
    feat_fc        project_features: (n, f*H) -> (n, H), at level 0 over pending + root, and in accept
    memory_append  accept, cross layers: K/V of the new target feature appended to the memory

Every component is run with the real modules (DraftLayer, DraftKV, DraftModel) at random weights,
packed as a draft loaded for decoding is (decode/drafts/pack.py); costs do not depend on the
values. Shapes come from the search space (heads, ffn, fusion, feature
layer counts, draft vocab) and the grid (widths n, contexts).
"""

from __future__ import annotations

import logging
from itertools import product

import torch

from decode.arch import DraftArch
from decode.drafts.blocks import DraftKV, DraftLayer
from decode.drafts.model import DraftModel, TargetDims
from decode.drafts.pack import pack_for_decoding
from decode.runtime.small_rows import linear
from decode.space import SearchSpace
from decode.targets.target import TargetModel
from hwprofile import census
from hwprofile.config import Grids
from hwprofile.cycle import filler_tokens
from hwprofile.schema import TABLE_AXES
from hwprofile.tables import Table
from hwprofile.timing import Case, Timer, run_cases

logger = logging.getLogger(__name__)
DRAFT_TABLES = ("draft_layer", "feat_fc", "draft_input", "lm_head", "scorer", "memory_append")


def head_vocab(draft_vocab: int | None, vocab_size: int) -> int:
    """Rows a draft's LM head really has (None or >= the target vocab: the target's own head)."""
    return vocab_size if draft_vocab is None or draft_vocab >= vocab_size else int(draft_vocab)


def _probe_model(target: TargetModel, dims: TargetDims, f: int = 1, vocab: int | None = None) -> DraftModel:
    """A minimal DraftModel whose feat_fc / in_fc / head have the asked-for shape."""
    layers = tuple(range(-1, -f - 1, -1))
    arch = DraftArch(fusion="concat", feature_layers=layers, depth=1, heads=(1,), ffn=(8,), draft_vocab=vocab)
    model = DraftModel(arch, dims).attach(target).eval()
    pack_for_decoding(model)  # as a draft loaded for decoding is (bfloat16 linear weights on a CPU)
    return model


class _LayerBench:
    """One DraftLayer with a DraftKV holding ctx committed entries (and a memory of ctx features)."""

    def __init__(self, layer: DraftLayer, dims: TargetDims, heads: int, cross: bool, ctx: int, dev, dtype):
        self.layer = layer  # shared by the contexts: one set of weights per (heads, ffn, cross), as in a draft
        self.theta = dims.rope_theta
        self.kv = DraftKV(1)
        kv_shape = (heads, ctx, dims.head_dim)  # (h, L, d)
        self.kv.append(0, (torch.randn(kv_shape, device=dev, dtype=dtype), torch.randn(kv_shape, device=dev, dtype=dtype)))
        self.kv.commit()
        if cross:
            self.kv.append_memory(0, (torch.randn(kv_shape, device=dev, dtype=dtype),
                                      torch.randn(kv_shape, device=dev, dtype=dtype)))
            self.kv.mem_pos = torch.arange(ctx, device=dev)
        self.committed_mem = self.kv.mem_kv[0]
        self.ctx, self.dev, self.dtype, self.hidden = ctx, dev, dtype, dims.hidden_size

    def case(self, key, n: int) -> Case:
        x = torch.randn(n, self.hidden, device=self.dev, dtype=self.dtype)  # (n, H)
        pos = torch.arange(self.ctx, self.ctx + n, device=self.dev)  # (n,)
        allowed = torch.cat([torch.ones(n, self.ctx, dtype=torch.bool, device=self.dev),
                             torch.ones(n, n, dtype=torch.bool, device=self.dev).tril()], dim=1)  # (n, ctx + n)
        mem_allowed = None
        if self.layer.cross is not None:
            mem_allowed = self.kv.mem_pos[None, :] < pos[:, None]  # (n, m)

        def fn():  # DraftModel.forward's per-layer body
            _, kv = self.layer(x, pos, allowed, self.kv.kv[0], self.theta, self.kv.mem_kv[0], mem_allowed)
            self.kv.append(0, kv)

        return Case(key, fn, reset=self.kv.drop_tentative)

    def memory_case(self, key) -> Case:
        mem = torch.randn(1, self.hidden, device=self.dev, dtype=self.dtype)  # one accepted position's feature
        pos = torch.tensor([self.ctx], device=self.dev)

        def fn():  # DraftModel.add_memory for one layer
            self.kv.append_memory(0, self.layer.cross.memory_kv(mem))
            self.kv.mem_pos = torch.cat([self.kv.mem_pos, pos])

        def reset():
            self.kv.mem_kv[0] = self.committed_mem
            self.kv.mem_pos = self.kv.mem_pos[: self.ctx]

        return Case(key, fn, reset=reset)


@torch.no_grad()
def measure_draft(target: TargetModel, space: SearchSpace, grids: Grids, timer: Timer, progress: bool = True,
                  with_census: bool = True, timed: bool = True) -> dict[str, Table]:
    """draft_layer, draft_input, feat_fc, lm_head, scorer and memory_append tables (timed=False: census only)."""
    dims, dev, dtype = TargetDims.of(target), target.device, target.dtype
    torch.manual_seed(0)
    cases: list[Case] = []
    benches: list[_LayerBench] = []  # keep every bench alive until its cases are timed
    for heads, ffn, cross in product(space.heads, space.ffn, (0, 1)):
        layer = DraftLayer(dims.hidden_size, heads, dims.head_dim, ffn, bool(cross), dims.rms_eps).to(dev, dtype).eval()
        pack_for_decoding(layer)
        for ctx in grids.contexts:
            bench = _LayerBench(layer, dims, heads, bool(cross), ctx, dev, dtype)
            benches.append(bench)
            cases += [bench.case(("draft_layer", heads, ffn, cross, n, ctx), n) for n in grids.widths]
            if cross and ffn == min(space.ffn):
                cases.append(bench.memory_case(("memory_append", heads, ctx)))
    f_choices = sorted({len(s) for s in space.feature_layers})
    vocabs = sorted({head_vocab(v, target.vocab_size) for v in space.draft_vocab})
    k = min(max(space.top_k), target.vocab_size)
    for f in f_choices:
        model = _probe_model(target, dims, f=f)
        for n in grids.widths:
            feats = torch.randn(n, f * dims.hidden_size, device=dev, dtype=dtype)  # (n, f*H)
            cases.append(Case(("feat_fc", f, n), lambda m=model, x=feats: m.project_features(x)))
    base = _probe_model(target, dims)
    for n in grids.widths:
        toks = filler_tokens(target, n).to(dev)
        g = torch.randn(n, dims.hidden_size, device=dev, dtype=dtype)
        cases.append(Case(("draft_input", 0, n), lambda t=toks: base.embed(t)))
        cases.append(Case(("draft_input", 1, n),  # DraftModel.forward's input fusion
                          lambda t=toks, g=g: linear(torch.cat([base.embed(t), g.to(dtype)], -1), base.in_fc.weight)))
    for vocab in vocabs:
        model = _probe_model(target, dims, vocab=None if vocab >= target.vocab_size else vocab)
        for n in grids.widths:
            h = torch.randn(n, dims.hidden_size, device=dev, dtype=dtype)
            cases.append(Case(("lm_head", vocab, n), lambda m=model, h=h: m.logits(h)))
    for n in grids.widths:
        logits = torch.randn(n, target.vocab_size, device=dev)  # (n, V) fp32, as model.logits returns
        cases.append(Case(("scorer", n), lambda x=logits: torch.log_softmax(x.float(), dim=-1).topk(k, dim=-1)))
    stats = run_cases(cases, timer, grids.components, "draft components", progress) if timed else {}
    tables = {name: Table(TABLE_AXES[name]) for name in DRAFT_TABLES}
    for case in cases:
        c = census.count(case.fn, case.setup, case.reset) if with_census else None
        tables[case.key[0]].put(case.key[1:], stats[case.key] if timed else 0.0, c)
    for t in tables.values():
        t.check_complete()
    return tables
