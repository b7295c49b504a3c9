"""Two training-free lookup drafts (prompt + corpus lookup folders) replayed exactly on one held-out set, paired.

    python benchmarks/lookup_replay_ab.py --run ~/.cache/vlm-draft-nas/runs/smolvlm-135m-cpu \
        --a out/nas-cpu-fresh-w8 --b out/nas-cpu-d/draft --out benchmarks/results/lookup-replay-ab-cpu-answers.json

A 13-prompt bench cannot resolve a few percent of tau (its prompts hold ~750 tokens); the search's held-out set
(168 sequences at the demo and cpu scales) can, and the replay of a lookup draft is exact (tested equal to real
decoding). This replays both drafts' specs and corpora over the run's held-out sequences and reports each one's tau
and predicted speed-up on the run's CPU profile, the difference with a paired bootstrap 95% interval (sequences
resampled together), and how many sequences each wins (fewer target forwards).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode.benchio import environment, write_json  # noqa: E402
from decode.cli import run_cli  # noqa: E402
from decode.errors import UserError  # noqa: E402


def draft_parts(folder: Path):
    from decode.drafts.corpus import NgramCorpus, corpus_file
    from decode.drafts.prompt_lookup import LookupSpec

    path = folder / "draft_config.json"
    if not path.is_file():
        raise UserError(f"{folder} has no draft_config.json (a prompt-lookup draft folder, e.g. OUT/draft)")
    cfg = json.loads(path.read_text())
    if cfg.get("kind") != "prompt-lookup":
        raise UserError(f"{folder} is a {cfg.get('kind')} draft; this compares prompt-lookup drafts")
    corpus = corpus_file(folder)
    return LookupSpec(**cfg["lookup"]), NgramCorpus.load(corpus) if corpus.is_file() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="a pipeline run folder (heldout/ and profiles/ in it)")
    p.add_argument("--a", type=Path, required=True, help="the baseline draft folder")
    p.add_argument("--b", type=Path, required=True, help="the draft folder compared with it")
    p.add_argument("--target", default="smolvlm-135m")
    p.add_argument("--out", type=Path, required=True, help="the JSON to write")
    args = p.parse_args(argv)
    from decode.targets.loader import load_target
    from hwprofile.latency import LatencyModel
    from nas.kinds import KindScorer, paired_tau_gain
    from supernet.dataset import FeatureData

    profiles = [args.run / "profiles" / f"cpu-{args.target}.json"]  # the eager runtime's, as nas.search prices
    if not (args.run / "heldout").is_dir() or not profiles[0].is_file():
        raise UserError(f"--run {args.run} has no heldout/ folder or no {profiles[0]}")
    target = load_target(args.target, device="cpu", dtype="float32")
    data = FeatureData(args.run / "heldout", target)
    seqs = [data[i] for i in range(len(data))]
    latency = LatencyModel.load(profiles[0])
    rows, replays = {}, {}
    for name, folder in (("a", args.a), ("b", args.b)):
        spec, corpus = draft_parts(folder)
        scorer = KindScorer(seqs, latency, 512.0, corpus=corpus, corpus_ms=0.01)
        rows[name] = {"draft": str(folder), **scorer.lookup(spec)}
        replays[name] = scorer.replay_lookup(spec)
    result = {"run": str(args.run), "profile": str(profiles[0]), "sequences": len(seqs), "a": rows["a"],
              "b": rows["b"], **paired_tau_gain(replays["a"], replays["b"]),
              "environment": environment(torch.device("cpu"))}
    write_json(args.out, result)
    for k in ("a", "b"):
        print(f"{k}: {rows[k]['draft']}: tau {rows[k]['tau']:.4f} {rows[k]['tau_ci95']}, "
              f"predicted {rows[k]['speedup']:.3f}x")
    print(f"b - a: tau {result['tau_gain']:+.4f}, paired 95% CI {result['tau_gain_ci95']}; b better on "
          f"{result['sequences_b_better']}, worse on {result['sequences_b_worse']} of {len(seqs)} -> {args.out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
