"""Extract the largest, smallest and a middle subnet from a trained supernet, plus untrained (random)
drafts of the same archs, as standalone draft directories for `decode.bench`.

    python benchmarks/extract_demo_drafts.py --supernet out/supernet-smolvlm-135m-demo/checkpoint \
        --target smolvlm-135m --out out/drafts-demo
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from decode.arch import DraftArch
from decode.drafts.model import DraftModel, TargetDims
from decode.space import SearchSpace
from decode.targets.loader import load_target
from supernet import checkpoint as ckpt
from supernet.dataset import FeatureData
from supernet.elastic import DraftSupernet

MIDDLE = dict(fusion="concat", depth=2, heads=(6, 6), ffn=(768, 768), draft_vocab=16384, visual_keep=0.5,
              tree_depth=4, top_k=2, total_tokens=8)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--supernet", required=True)
    p.add_argument("--target", default="smolvlm-135m")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    target = load_target(args.target)
    state = ckpt.read_state(args.supernet)
    space = SearchSpace(**{k: (tuple(tuple(x) for x in v) if k == "feature_layers" else tuple(v) if isinstance(v, list)
                               else v) for k, v in state["space"].items()})
    data = FeatureData(state["data"], target)
    reduced = [v for v in space.draft_vocab if v is not None]
    model = DraftSupernet(space, TargetDims.of(target), state["entropy_layer"],
                          data.hot_tokens(max(reduced)) if reduced else None).attach(target)
    ckpt.load_weights(args.supernet, model)
    e = state["entropy_layer"]
    archs = {"largest": space.largest(e), "smallest": space.smallest(e),
             "middle": DraftArch(feature_layers=(-1, e), **MIDDLE)}
    for name, arch in archs.items():
        sub = model.extract(arch, target)
        sub.save_pretrained(Path(args.out) / f"{name}-trained", target, metadata={"source": args.supernet, "role": name})
        torch.manual_seed(0)
        rnd = DraftModel(arch, TargetDims.of(target), d2t=sub.d2t.clone() if sub.own_head else None)
        rnd.attach(target, init_head=True).save_pretrained(Path(args.out) / f"{name}-random", target,
                                                          metadata={"role": name, "untrained": True})
        print(name, arch.to_json())


if __name__ == "__main__":
    main()
