"""Fine-tune one subnet of a pipeline run's supernet on chosen data folders and replay its held-out tau.

    python benchmarks/finetune_data_probe.py --run ~/.cache/vlm-draft-nas/runs/smolvlm-135m-cpu \
        --arch benchmarks/results/nas-cpu-scale-2026-12-04-finetune6000/draft_config.json \
        --data data,finetune-data --steps 6000

--data: folders read together (supernet.dataset.MixedData), relative to --run or absolute. Prints one JSON line:
the fine-tuning info, its wall-clock and the exact greedy tau of each --trees tree on the run's held-out data.
The README's "Fine-tuning on the target's own answers" table was made with it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from decode.arch import DraftArch, TreeSpec
from decode.drafts.neural import NeuralDraft
from decode.loop.tree import TreePolicy
from decode.targets.loader import load_target
from nas.acceptance import estimate_tau
from nas.finetune import FinetuneConfig, finetune_subnet
from nas.loading import load_supernet
from supernet.dataset import FeatureData, MixedData


def parse_tree(text: str) -> TreeSpec:
    depth, rest = text.split("x")
    top_k, total = rest.split("/")
    return TreeSpec(int(depth), int(top_k), int(total))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a pipeline run folder (data/, supernet/, heldout/ ...)")
    p.add_argument("--arch", required=True, help="a draft_config.json whose arch is fine-tuned")
    p.add_argument("--data", default="data", help="comma-separated data folders (default: data)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--trees", default="1x1/1", help="comma-separated DEPTHxTOPK/TOTAL trees to replay")
    p.add_argument("--heldout", type=int, default=None, help="first N held-out sequences (default: all)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run = Path(args.run).expanduser()
    target = load_target(json.loads((run / "pipeline.json").read_text())["target"])
    net, state = load_supernet(run / "supernet", target)
    arch = DraftArch.from_dict(json.loads(Path(args.arch).read_text())["arch"])
    parts = [FeatureData(d if Path(d).is_absolute() else run / d, target) for d in args.data.split(",")]
    data = MixedData(parts)
    t0 = time.perf_counter()
    info = finetune_subnet(net, arch, data, list(range(len(data))), FinetuneConfig.like_training(args.steps, state,
                                                                                                  args.lr))
    seconds = time.perf_counter() - t0
    held = FeatureData(run / "heldout", target)
    seqs = [held[i] for i in range(min(len(held), args.heldout or len(held)))]
    taus = {}
    with torch.no_grad():
        for text in args.trees.split(","):
            tree = parse_tree(text)
            draft = NeuralDraft(net.set_active(arch.with_tree(tree)))
            taus[text] = round(estimate_tau(draft, seqs, target.num_layers, TreePolicy(spec=tree)).tau, 4)
    print(json.dumps({"data": args.data, "steps": args.steps, "seconds": round(seconds, 1), "info": info,
                      "sequences": len(seqs), "tau": taus}))


if __name__ == "__main__":
    main()
