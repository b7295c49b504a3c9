"""How wide the search's tau interval is on parts of a held-out set: a prompt-lookup draft (prompt + corpus lookup
folder) replayed exactly on subsets of a run's held-out sequences by prompt source, and with answers cut shorter.

    python benchmarks/heldout_interval.py --run ~/.cache/vlm-draft-nas/runs/smolvlm-135m-cpu \
        --draft out/nas-cpu-o/draft --out benchmarks/results/heldout-interval-cpu.json

Each row gives the replayed tau and its bootstrap 95% half-width twice: sequences resampled one by one, and
conversations resampled whole (decode.datasets.conversation_of, as the search's table does). Subsets: everything;
the first messages and photo questions only (the set before chat prompts); one chat message per conversation part
(the first picks of decode.datasets.chat_prompts); and the whole set with answers cut at 16, 32 and 48 tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lookup_replay_ab import draft_parts  # noqa: E402

from decode.benchio import environment, write_json  # noqa: E402
from decode.cli import run_cli  # noqa: E402
from decode.errors import UserError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="a pipeline run folder (heldout/ in it)")
    p.add_argument("--draft", type=Path, required=True, help="a prompt-lookup draft folder (e.g. OUT/draft)")
    p.add_argument("--profile", type=Path, default=Path("profiles/cpu-smolvlm-135m.json"))
    p.add_argument("--target", default="smolvlm-135m")
    p.add_argument("--out", type=Path, required=True, help="the JSON to write")
    args = p.parse_args(argv)
    from decode.datasets import chat_prompts, conversation_of
    from decode.targets.loader import load_target
    from hwprofile.latency import LatencyModel
    from nas.kinds import KindScorer
    from supernet.dataset import FeatureData

    if not (args.run / "heldout").is_dir():
        raise UserError(f"--run {args.run} has no heldout/ folder")
    target = load_target(args.target, device="cpu", dtype="float32")
    data = FeatureData(args.run / "heldout", target)
    spec, corpus = draft_parts(args.draft)
    latency = LatencyModel.load(args.profile)
    # the chat prompts as the folder was built (its message length cap); every part's first pick comes first
    chats = chat_prompts("heldout", max_chars=data.manifest.get("config", {}).get("max_prompt_chars"))
    firsts = {c.id for c in chats[:len({c.id.split(":")[1] for c in chats})]}
    every = range(len(data))
    subsets = {"all": list(every),
               "first messages and photos": [i for i in every if not data.ids[i].startswith("chat:")],
               "one chat message per part": [i for i in every if not data.ids[i].startswith("chat:")
                                             or data.ids[i] in firsts]}
    rows = []
    for name, idx, cut in [*((n, i, None) for n, i in subsets.items()),
                           *((f"all, answers cut at {m}", subsets["all"], m) for m in (16, 32, 48))]:
        seqs = [{**data[i], "group": conversation_of(data.ids[i])} for i in idx]
        seqs = [s for s in seqs if s["input_ids"].numel() > int(s["prompt_len"]) + 1]
        scorer = KindScorer(seqs, latency, 512.0, corpus=corpus, corpus_ms=0.01)
        rep = scorer.replay_lookup(spec, max_new_tokens=cut)
        (lo, hi), (slo, shi) = rep.tau_interval(groups=scorer.groups), rep.tau_interval()
        rows.append({"subset": name, "sequences": len(seqs), "conversations": len(set(scorer.groups)),
                     "tau": round(rep.acceptance.tau, 4), "half_width_conversations": round((hi - lo) / 2, 4),
                     "half_width_sequences": round((shi - slo) / 2, 4)})
        print(f"{name:34s} {len(seqs):4d} seqs {rows[-1]['conversations']:4d} conversations  tau {rows[-1]['tau']:.3f}"
              f"  +-{rows[-1]['half_width_conversations']:.4f} (conversations) +-{rows[-1]['half_width_sequences']:.4f}"
              " (sequences)")
    write_json(args.out, {"run": str(args.run), "draft": str(args.draft), "lookup": vars(spec), "rows": rows,
                          "environment": environment(torch.device("cpu"))})
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
