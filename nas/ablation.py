"""`python -m nas.ablation`: training recipes compared at equal wall-clock by the held-out tau they buy.

    python -m nas.ablation --data teacher=DIR_A --data regen=DIR_B --heldout-data DIR_H \\
        --variant old:data=teacher,loss=full,max_positions=32,init_from_target=0 \\
        --variant init:data=teacher --budget 300 --out benchmarks/results/ablation-cpu

Each variant trains the same arch (default: the EAGLE-like draft alone, space `eagle`) with
supernet.train for `--budget` seconds of training wall-clock (the LR schedule follows time, so every
run ends its schedule), then scores it on held-out data with the exact greedy replay
(nas.acceptance) for each `--tree`. A variant is `name:key=value,...` over TrainConfig fields, plus
`data=<label>` to pick one of the `--data` directories. Results: `<out>.json` (configs, steps,
scored positions, tau per tree, environment) and a markdown table `<out>.md`; runs already in the
JSON are kept (rerun = resume).

A data-scaling curve is the same comparison at several budgets: `--budgets 120,240,480` trains every
variant once per budget (runs `NAME@120s`, ...; each a whole run with its own LR schedule, not a
snapshot of a longer one) and `--scaling-csv FILE` writes one row per (variant, scored arch, budget):
held-out tau against training wall-clock and scored positions, which `benchmarks/plot_scaling.py`
draws. A supernet variant scores its EAGLE-like subnet and each `--arch` of its space; a variant
trained alone (space `eagle`) its one arch; the ratio of the two EAGLE-like curves is the cost of
weight sharing.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

from decode.arch import DraftArch, TreeSpec
from decode.cli import add_target_args, run_cli, setup_logging
from decode.errors import UserError

logger = logging.getLogger(__name__)

DEFAULT_TREES = ("2x2/4", "4x2/16", "6x8/60")


def parse_tree(text: str) -> TreeSpec:
    """'DEPTHxTOPK/TOTAL' -> TreeSpec."""
    try:
        shape, total = text.split("/")
        depth, top_k = shape.split("x")
        return TreeSpec(tree_depth=int(depth), top_k=int(top_k), total_tokens=int(total))
    except ValueError:
        raise UserError(f"tree '{text}' is not DEPTHxTOPK/TOTAL (e.g. 4x2/16)") from None


def parse_variant(text: str, train_fields: dict) -> tuple[str, dict]:
    """'name:key=value,...' -> (name, {field: typed value}); `data` stays a label."""
    name, _, rest = text.partition(":")
    out: dict = {}
    for part in filter(None, rest.split(",")):
        key, _, value = part.partition("=")
        if key == "data":
            out[key] = value
            continue
        if key not in train_fields:
            raise UserError(f"variant '{name}': unknown setting '{key}'; use TrainConfig fields ({', '.join(train_fields)})")
        kind = type(train_fields[key])
        if kind is type(None):  # optional fields (space): a name or path
            kind = str
        try:
            out[key] = bool(int(value)) if kind is bool else kind(value)
        except ValueError:
            raise UserError(f"variant '{name}': {key}={value!r} is not a {kind.__name__}") from None
    return name, out


def parse_budgets(text: str) -> list[float]:
    """'120,240,480' -> [120.0, 240.0, 480.0] (seconds, each > 0)."""
    try:
        out = [float(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise UserError(f"--budgets {text!r} is not a comma-separated list of seconds (e.g. 120,240,480)") from None
    if not out or min(out) <= 0:
        raise UserError(f"--budgets {text!r}: give one or more training budgets in seconds, each > 0")
    return out


def heldout_tau(ckpt_dir: Path, target, heldout: Path, trees: list[TreeSpec], max_new: int | None,
                extra_archs: dict | None = None, n_seqs: int | None = None) -> dict:
    """Exact greedy replay tau of the checkpoint's EAGLE-like arch (its space's default) for each tree, and
    of each of `extra_archs` ({label: DraftArch}) that the checkpoint's space contains (the others are skipped)."""
    from decode.drafts.neural import NeuralDraft
    from decode.loop.tree import TreePolicy
    from nas.acceptance import estimate_tau
    from nas.loading import load_supernet
    from supernet.dataset import FeatureData

    net, _ = load_supernet(ckpt_dir, target)
    net.eval()
    data = FeatureData(heldout, target)
    seqs = [data[i] for i in range(min(len(data), n_seqs or len(data)))]
    arch = net.space.eagle_like(net.entropy_layer)
    archs = {"eagle-like": arch}
    for label, extra in (extra_archs or {}).items():
        try:
            net.space.validate(extra, net.entropy_layer)
            archs[label] = extra
        except UserError:
            logger.info("arch %s is not in this checkpoint's space; not scored", label)
    out: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for label, a in archs.items():
            for tree in trees:
                draft = NeuralDraft(net.set_active(a.with_tree(tree)), name="subnet")
                acc = estimate_tau(draft, seqs, target.num_layers, TreePolicy(spec=tree), max_new)
                out.setdefault(label, {})[f"{tree.tree_depth}x{tree.top_k}/{tree.total_tokens}"] = round(acc.tau, 4)
    return {"arch": arch.to_dict(), "tau": out["eagle-like"], "tau_by_arch": out, "sequences": len(seqs),
            "archs": {k: a.to_dict() for k, a in archs.items()}}


def _train_log_summary(log: Path) -> dict:
    with log.open() as f:
        rows = list(csv.DictReader(f))
    steps = {r["step"] for r in rows}
    positions = sum(int(r.get("positions") or 0) for r in rows if r["role"] == "largest")
    last = [r for r in rows if r["role"] == "largest"][-20:]
    return {"steps": len(steps), "scored_positions": positions,
            "train_acc0_last20": round(sum(float(r["acc0"]) for r in last) / max(1, len(last)), 4),
            "elapsed_s": float(rows[-1]["elapsed_s"]) if rows else 0.0}


def run(args: argparse.Namespace) -> dict:
    from decode.benchio import environment
    from decode.targets.loader import load_target
    from supernet.train import TrainConfig, train

    train_fields = {f.name: f.default for f in fields(TrainConfig) if f.name not in ("target", "data", "out")}
    data = dict(d.split("=", 1) for d in args.data)
    trees = [parse_tree(t) for t in (args.tree or DEFAULT_TREES)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result_file = out.with_suffix(".json")
    results = json.loads(result_file.read_text()) if result_file.is_file() else {"runs": {}}
    cache = str(args.cache_dir) if args.cache_dir else None
    target = load_target(args.target, device=args.device, dtype=args.dtype, cache_dir=args.cache_dir)
    extra = {}
    for item in args.arch or []:
        label, _, file = item.partition("=")
        try:
            raw = json.loads(Path(file).read_text())
        except (OSError, ValueError) as err:
            raise UserError(f"--arch {item}: cannot read an arch JSON from '{file}' ({err.__class__.__name__})") from None
        extra[label] = DraftArch.from_dict(raw.get("arch", raw))
    results.update(command=" ".join(["python -m nas.ablation", *args.argv]), budget_s=args.budget,
                   heldout=str(args.heldout_data), environment=environment(target.device))
    budgets = parse_budgets(args.budgets) if args.budgets else [args.budget]
    jobs = [(parse_variant(text, train_fields), b) for text in args.variant for b in budgets]
    for (base, settings), budget in jobs:
        settings = dict(settings)  # the data label is popped below; every budget of the variant needs it
        name = base if len(budgets) == 1 else f"{base}@{budget:g}s"
        if name in results["runs"]:
            logger.warning("variant %s: kept from %s", name, result_file)
            continue
        label = settings.pop("data", next(iter(data)))
        if label not in data:
            raise UserError(f"variant '{name}': no --data labelled '{label}' (have: {', '.join(data)})")
        run_dir = Path(args.work) / name
        cfg = TrainConfig(target=args.target, data=data[label], out=str(run_dir), space=args.space, scale="demo",
                          steps=100_000, time_budget_s=budget, threads=args.threads, device=args.device,
                          dtype=args.dtype, cache_dir=cache, val_sequences=0, ckpt_every=100_000)
        cfg = replace(cfg, **{**dict(warmup=20, n_random=0, reorder_at=0, unroll=2, seqs_per_step=4), **settings})
        done = run_dir / "ablation-trained.json"  # training finished earlier (a crash in scoring reruns only that)
        t0 = time.perf_counter()
        if done.is_file():
            ck, wall = run_dir / "checkpoint", json.loads(done.read_text())["wall_s"]
        else:
            ck = train(cfg)
            wall = time.perf_counter() - t0
            done.write_text(json.dumps({"wall_s": wall}))
        summary = {"variant": base, "budget_s": budget, "data": label, "data_dir": data[label], "train": asdict(cfg),
                   "wall_s": round(wall, 1), **_train_log_summary(run_dir / "train_log.csv"),
                   **heldout_tau(ck, target, Path(args.heldout_data), trees, args.max_new_tokens, extra,
                                 args.heldout_sequences)}
        summary["positions_per_s"] = round(summary["scored_positions"] / max(summary["elapsed_s"], 1e-9), 1)
        results["runs"][name] = summary
        result_file.write_text(json.dumps(results, indent=1) + "\n")
        logger.warning("variant %s: %s", name, summary["tau"])
    out.with_suffix(".md").write_text(table(results))
    if args.scaling_csv:
        write_scaling_csv(results, Path(args.scaling_csv))
    return results


def arch_taus(run: dict) -> dict[str, dict[str, float]]:
    """{arch label: {tree: tau}} of one run (runs recorded before --arch existed have the EAGLE-like one only)."""
    return run.get("tau_by_arch", {"eagle-like": run["tau"]})


def scaling_rows(results: dict) -> list[dict]:
    """One row per (run, scored arch): the curve `VARIANT: ARCH`, training seconds, scored positions, and
    tau per tree as `tau_<depth>x<topk>_<total>` columns (the shape benchmarks/plot_scaling.py reads)."""
    rows = []
    for name, r in results["runs"].items():
        for label, taus in arch_taus(r).items():
            row = {"curve": f"{r.get('variant', name)}: {label}", "data": r["data"], "budget_s": r.get("budget_s", ""),
                   "train_s": r["elapsed_s"], "steps": r["steps"], "scored_positions": r["scored_positions"]}
            row.update({"tau_" + t.replace("/", "_"): v for t, v in taus.items()})
            row["source"] = f"nas.ablation run {name}"
            rows.append(row)
    return rows


def write_scaling_csv(results: dict, path: Path) -> None:
    rows = scaling_rows(results)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    cols = [c for c in cols if c != "source"] + ["source"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    logger.warning("scaling curve: %d rows -> %s (plot: python benchmarks/plot_scaling.py %s)", len(rows), path, path)


def table(results: dict) -> str:
    """Markdown: one line per run and scored arch (the EAGLE-like arch first, then each --arch)."""
    runs = results["runs"]
    trees = sorted({t for r in runs.values() for t in r["tau"]}, key=lambda t: (len(t), t))
    head = "| variant | arch | data | train s | steps | scored positions | positions/s | train acc | " + " | ".join(
        f"tau {t}" for t in trees) + " |"
    lines = [head, "|" + "---|" * (8 + len(trees))]
    for name, r in runs.items():
        for label, taus in arch_taus(r).items():
            lines.append(f"| {name} | {label} | {r['data']} | {r['elapsed_s']:.0f} | {r['steps']} | {r['scored_positions']} | "
                         f"{r['positions_per_s']} | {r['train_acc0_last20']:.3f} | "
                         + " | ".join(f"{taus.get(t, float('nan')):.3f}" for t in trees) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nas.ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--data", action="append", required=True, help="LABEL=DIR training data (supernet.data); repeat")
    p.add_argument("--heldout-data", required=True, help="held-out data (supernet.data --split heldout, regenerate)")
    p.add_argument("--variant", action="append", required=True, help="NAME:key=value,... (see above); repeat")
    p.add_argument("--budget", type=float, default=300.0, help="training seconds per variant (default: 300)")
    p.add_argument("--budgets", help="B1,B2,...: train every variant once per budget (seconds), for a scaling curve")
    p.add_argument("--scaling-csv", help="write the scaling curve (tau against training time) to this CSV")
    p.add_argument("--heldout-sequences", type=int, default=None,
                   help="score the first N held-out sequences only (default: all)")
    p.add_argument("--space", default="eagle", help="search space of the trained network (default: eagle)")
    p.add_argument("--tree", action="append", help=f"DEPTHxTOPK/TOTAL trees to score (default: {' '.join(DEFAULT_TREES)})")
    p.add_argument("--arch", action="append",
                   help="LABEL=FILE: also score this arch (JSON, or a draft_config.json) where the trained space has it")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on replayed tokens per held-out sequence")
    p.add_argument("--threads", type=int, default=1, help="torch threads for training (default: 1)")
    p.add_argument("--work", default="out/ablation", help="run folders (default: out/ablation)")
    p.add_argument("--out", default="benchmarks/results/ablation", help="result stem: <out>.json and <out>.md")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    import sys

    args = build_parser().parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    setup_logging(args.verbose)
    if args.budget <= 0:
        raise UserError(f"--budget must be > 0 seconds, got {args.budget}")
    if args.budgets:
        parse_budgets(args.budgets)  # bad lists fail before the target loads
    if args.heldout_sequences is not None and args.heldout_sequences < 1:
        raise UserError(f"--heldout-sequences must be >= 1, got {args.heldout_sequences}")
    results = run(args)
    print(table(results))
    return 0


if __name__ == "__main__":
    run_cli(main)
