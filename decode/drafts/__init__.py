"""Draft kinds behind one interface (decode.drafts.base.Draft) and the spec parser used by the CLIs.

    DIR             a draft checkpoint of any kind (decode/drafts/kinds.py: neural, neural+lookup,
                    prompt-lookup, none)
    DIR+lookup      a neural checkpoint whose trees are merged with prompt-lookup continuations
    prompt-lookup   n-gram lookup in the prompt and output so far (prompt-lookup:D[:M[:K[:W]]]: branch length
                    D, n-grams up to M, K branches, W after a match shorter than M; default 8:3:1:0)
    layerskip:K     the target's first K layers + final norm + LM head
    random:FUSION   a randomly initialised neural draft (concat|cross|hybrid), for tests and demos
"""

from __future__ import annotations

from pathlib import Path

from decode.arch import FUSIONS, DraftArch
from decode.drafts.base import Draft
from decode.drafts.kinds import load_draft_dir
from decode.drafts.layerskip import LayerSkipDraft
from decode.drafts.merged import MergedDraft
from decode.drafts.model import DraftModel, TargetDims
from decode.drafts.neural import NeuralDraft
from decode.drafts.none import NoDraft
from decode.drafts.pack import pack_for_decoding
from decode.drafts.prompt_lookup import LookupSpec, PromptLookupDraft
from decode.errors import UserError

__all__ = ["Draft", "LayerSkipDraft", "LookupSpec", "MergedDraft", "NeuralDraft", "NoDraft", "PromptLookupDraft",
           "make_draft", "random_arch"]

_SPEC_HELP = ("use a draft checkpoint directory (DIR+lookup merges prompt lookup into a neural one), prompt-lookup, "
              "layerskip:K or random:concat|cross|hybrid[+lookup]")


def random_arch(target, fusion: str = "concat", **overrides) -> DraftArch:
    """A one-layer draft shaped like one target layer (EAGLE-like defaults)."""
    cfg = target.text_config
    base = dict(fusion=fusion, feature_layers=(-1,), depth=1, heads=(int(cfg.num_attention_heads),),
                ffn=(int(cfg.intermediate_size),))
    base.update(overrides)
    return DraftArch(**base)


def make_draft(spec: str, target, seed: int = 0) -> Draft:
    spec = spec.strip()
    if spec.endswith("+lookup") and spec != "+lookup":
        base = make_draft(spec[: -len("+lookup")], target, seed)
        if isinstance(base, MergedDraft):
            return base  # the checkpoint already merges lookup
        if not isinstance(base, NeuralDraft):
            raise UserError(f"bad draft '{spec}': +lookup merges prompt lookup into a neural draft only")
        return MergedDraft(base)
    if spec == "prompt-lookup":
        return PromptLookupDraft()
    if spec.startswith("prompt-lookup:"):  # prompt-lookup:D[:M[:K[:W]]] branch length, max n-gram, branches,
        try:                                # branch length after a shorter match
            vals = [int(v) for v in spec.split(":")[1:]]
            if len(vals) > 4:
                raise ValueError(spec)
            d, m, k, w = vals[0], (vals[1:2] or [3])[0], (vals[2:3] or [1])[0], (vals[3:4] or [0])[0]
            return PromptLookupDraft(spec=LookupSpec(max_ngram=m, tree_depth=d, top_k=k, total_tokens=d * k,
                                                     weak_depth=w))
        except (ValueError, UserError):
            raise UserError(f"bad draft '{spec}': use prompt-lookup:D[:M[:K[:W]]] (branch length D, n-grams up to M, "
                            "K branches, integers >= 1; W: branch length after a match shorter than M, "
                            "0 <= W <= D)") from None
    if spec.startswith("layerskip:"):
        try:
            k = int(spec.split(":", 1)[1])
        except ValueError:
            raise UserError(f"bad draft '{spec}': layerskip:K needs an integer K") from None
        if not 1 <= k < target.num_layers:
            raise UserError(f"bad draft '{spec}': K must be in 1..{target.num_layers - 1} for this target")
        return LayerSkipDraft(k)
    if spec.startswith("random:"):
        fusion = spec.split(":", 1)[1]
        if fusion not in FUSIONS:
            raise UserError(f"bad draft '{spec}': {_SPEC_HELP}")
        import torch

        torch.manual_seed(seed)
        model = DraftModel(random_arch(target, fusion), TargetDims.of(target)).attach(target, init_head=True).eval()
        pack_for_decoding(model)  # as a loaded checkpoint is
        return NeuralDraft(model, name=spec)
    if Path(spec).is_dir():
        return load_draft_dir(spec, target)
    raise UserError(f"unknown draft '{spec}': {_SPEC_HELP}")
