"""A search's merged designs with and without corpus chains under the neural leaves, replayed exactly, paired.

    python benchmarks/leaf_chains_ab.py --search out/nas-h200-i \
        --out benchmarks/results/leaf-chains-ab-h200-cpu-scale.json

For every neural + lookup row of the search's kinds table (kinds.json): the row's design without leaf chains (a)
against the same design with them (b: the row's own chains, or, for a row without, the best of nas.kinds.LEAF_CHAINS
on the search's profile), on the search's whole held-out set and profile. The fine-tuned rows use the search's
fine-tuning checkpoint (OUT/finetune, reused as the search left it); the supernet rows the stored tree sweeps. Reports
each side's tau and predicted speed-up, the tau gain with a paired bootstrap 95% interval and how many sequences need
fewer / more target forwards.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode.benchio import environment, write_json  # noqa: E402
from decode.cli import run_cli  # noqa: E402
from decode.errors import UserError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--search", type=Path, required=True, help="a nas.search --out folder (summary.json, kinds.json)")
    p.add_argument("--out", type=Path, required=True, help="the JSON to write")
    args = p.parse_args(argv)
    from decode.arch import DraftArch
    from decode.drafts.prompt_lookup import LookupSpec
    from nas.kinds import KindScorer, paired_tau_gain
    from nas.objective import SweepTau
    from nas.search import (
        SearchConfig,
        ensure_finetune_data,
        finetune_best,
        finetune_budget_s,
        finetune_steps,
        out_dir,
        prepare_inputs,
        sweep_key,
        sweep_store,
    )

    if not (args.search / "summary.json").is_file() or not (args.search / "kinds.json").is_file():
        raise UserError(f"--search {args.search} has no summary.json or kinds.json: give a finished nas.search --out")
    summary = json.loads((args.search / "summary.json").read_text())
    known = {f.name for f in fields(SearchConfig)}
    cfg = SearchConfig(**{k: v for k, v in summary["config"].items() if k in known})
    rows = [r for r in json.loads((args.search / "kinds.json").read_text())["rows"] if r["kind"] == "neural+lookup"]
    if not rows:
        raise UserError(f"{args.search}/kinds.json has no neural + lookup row to compare")
    inp = prepare_inputs(cfg)
    if inp.corpus is None:
        raise UserError(f"the search {args.search} had no corpus: leaf chains draft from one")
    every = inp.held.sequences
    latency = inp.profile.latency
    context = float(cfg.context or 512)
    scorer = KindScorer(every, latency, context, corpus=inp.corpus)
    tuned = None
    out = []
    for row in rows:
        arch, spec = DraftArch.from_json(row["arch"]), LookupSpec(**row["lookup"])
        if row.get("tuned"):
            if tuned is None:
                steps = finetune_steps(cfg, inp.defaults)
                hardware = summary["setup"].get("hardware") or cfg.hardware
                best = DraftArch.from_json(summary["best"]["arch"])  # what the search fine-tuned: its checkpoint's
                ensure_finetune_data(inp)
                tuned, _ = finetune_best(inp, best, steps, ckpt_dir=out_dir(cfg, hardware, inp.target.name) /
                                         "finetune", time_budget_s=finetune_budget_s(cfg, inp.defaults))
            sweep = SweepTau(tuned, every, inp.target.num_layers, 1).sweep(arch)
        else:
            sweep = SweepTau(inp.supernet, every, inp.target.num_layers, 1, store=sweep_store(cfg, inp),
                             store_key=sweep_key(inp, every)).sweep(arch)
        plain = replace(spec, leaf_depth=0, leaf_count=0)
        a = scorer.neural(arch, sweep, plain, rule=row["merge"])
        b = scorer.best_leaf_chains(a, sweep) if not spec.leaf_depth else scorer.neural(arch, sweep, spec,
                                                                                        rule=row["merge"])
        spec_b = LookupSpec(**b["lookup"])
        gain = paired_tau_gain(scorer.replay_neural(arch, sweep, plain, rule=row["merge"]),
                               scorer.replay_neural(arch, sweep, spec_b, rule=row["merge"]))
        out.append({"label": row["label"], "a": a, "b": b, **gain})
        print(f"{row['label']}: without leaf chains tau {a['tau']:.4f}, {a['speedup']:.3f}x; with "
              f"{spec_b.leaf_depth}-token chains under {spec_b.leaf_count} leaves tau {b['tau']:.4f}, "
              f"{b['speedup']:.3f}x; gain {gain['tau_gain']:+.4f} {gain['tau_gain_ci95']}")
    write_json(args.out, {"search": str(args.search), "profile": inp.profile.describe(), "sequences": len(every),
                          "rows": out, "environment": environment(torch.device("cpu"))})
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
