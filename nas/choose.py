"""The last stage of a search: every kind of draft side by side on this hardware's profile, and the choice.

Rows (nas/kinds.py prices each on the same held-out replay and profile):
    vanilla          1.00x, always there
    prompt-lookup    the best LookupSpec of the grid
    layerskip        the target's first K layers drafting a chain: the best (K, depth) (when the scorer has the target)
    eagle-like       the EAGLE-like default subnet (the study's first trial), with its best tree
    neural           the study's best subnet
    neural+lookup    each of the `top` best subnets merged with lookup: best (tree depth, total, LookupSpec)

Each row's design (tree, lookup spec, merge rule) is picked on the sequences the trials scored; when the
held-out set is larger, confirm_rows scores the contenders again, design fixed, on all of it (the tau
interval printed is that set's), and the choice is made there. The lookup rows alone are picked again over
their whole grid there: their replay costs no forward (seconds), and on the demo's 168 held-out sequences the
spec picked on 4 of them (a 2-token corpus branch, replayed tau 1.712, predicted 1.546x) lost to one with a
runner-up branch (tau 1.803, 1.565x). The row with the best predicted speed-up
is exported, whatever its kind; training-free kinds need no weights. When nothing beats plain decoding
the search says so in one line and exports kind "none".
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pandas as pd

from decode.arch import DraftArch
from decode.drafts.prompt_lookup import LookupSpec
from nas.kinds import LOOKUP_ALONE_GRID, LOOKUP_GRID, KindScorer

logger = logging.getLogger(__name__)

CONFIRM_MARGIN = 0.2  # rows this far (a fraction) behind the best on the trials' sequences are not re-scored
# fine-tuning the best subnet alone (nas.search) is skipped when even this much faster its best row would trail a
# training-free one, per kind of row: measured at the cpu scale it moved the subnet alone by +7.5%, +6.2% (chat
# prompts, 2026-12-06) and +6.3% (the demo's recipe, 2026-12-07), its neural + lookup row by +4.6% (1.362x -> 1.425x),
# +3.4% (1.420x -> 1.468x), +3.8% on the H200 profile and +1.0% (1.711x -> 1.728x, 2026-12-07: 25.6 minutes of
# fine-tuning data and steps that one gate of 8% for both let run against prompt + corpus lookup at 1.804x, which
# stayed the choice). Lookup already proposes much of what fine-tuning teaches the network, so the merged row gains
# less: each gate sits above every gain measured for its kind
FINETUNE_GAIN = {"neural": 0.08, "neural+lookup": 0.05}
CI_GOAL = 0.05  # half-width of the chosen design's bootstrap 95% tau interval that the held-out set is sized for

# ties go to the simpler kind: nothing to load beats weights to load
SIMPLICITY = {"none": 0, "prompt-lookup": 1, "layerskip": 2, "neural": 3, "neural+lookup": 4}


def distinct_archs(done: pd.DataFrame, top: int) -> list[DraftArch]:
    """The `top` best distinct subnets (tree included) of the finished, feasible trials."""
    out: list[DraftArch] = []
    for text in done.drop_duplicates("arch")["arch"]:
        out.append(DraftArch.from_json(text))
        if len(out) == top:
            break
    return out


def kinds_rows(scorer: KindScorer, done: pd.DataFrame, sweep_of, depths, totals, eagle: DraftArch | None,
               top: int = 3, grid=LOOKUP_GRID, lookup_grid=LOOKUP_ALONE_GRID, corpus_grid=()) -> list[dict]:
    """Every kind's best row; `sweep_of(arch)` gives the TreeSweep of a subnet at its top_k (the fine-tuned subnet's
    rows come from tuned_rows, once fine-tuning is known to be worth it). grid: the lookups merged with
    neural trees; lookup_grid: the (plain) lookups tried alone; corpus_grid: lookups with a corpus branch tried
    alone (a row of their own: plain prompt lookup always keeps its row)."""
    rows = [{**scorer.vanilla(), "label": "vanilla"}]
    grids = lookup_grids(corpus_grid, lookup_grid)
    rows += [{**scorer.best_lookup(grid), "label": label} for label, grid in grids.items()]
    skip = scorer.best_layerskip()
    if skip is not None:
        rows.append({**skip, "label": "layer-skip self-draft"})
    best = distinct_archs(done, top)
    if eagle is not None:
        match = [DraftArch.from_json(a) for a in done["arch"]
                 if replace(DraftArch.from_json(a), tree_depth=1, total_tokens=1) ==
                 replace(eagle, tree_depth=1, total_tokens=1)]
        if match:  # the EAGLE-like subnet with the best tree any of its trials found
            rows.append({**max((scorer.neural(a, sweep_of(a)) for a in match), key=lambda r: r["speedup"]),
                         "label": "EAGLE-like default"})
    for i, arch in enumerate(best):
        sweep = sweep_of(arch)
        if i == 0:
            rows.append({**scorer.neural(arch, sweep), "label": "best neural"})
        rows.append({**scorer.best_merged(arch, sweep, depths, totals, grid), "label": f"neural #{i + 1} + lookup"})
    return rows


def tuned_rows(scorer: KindScorer, arch: DraftArch, sweep, depths, totals, grid=LOOKUP_GRID) -> list[dict]:
    """The fine-tuned best subnet's rows (its sweep: `sweep`), alone and merged with lookup, marked "tuned"."""
    return [{**scorer.best_merged(arch, sweep, depths, totals, None), "label": "best neural, fine-tuned",
             "tuned": True},
            {**scorer.best_merged(arch, sweep, depths, totals, grid), "label": "fine-tuned + lookup", "tuned": True}]


def finetune_may_pay(rows: list[dict], gain: dict[str, float] | None = None) -> bool:
    """Whether fine-tuning the best subnet could change the choice: some neural row (alone or merged), faster by its
    kind's gain (FINETUNE_GAIN), would reach the best training-free row."""
    gain = FINETUNE_GAIN if gain is None else gain
    reach = [r["speedup"] * (1 + gain[r["kind"]]) for r in rows if r["kind"] in gain]
    free = [r["speedup"] for r in rows if r["kind"] not in gain]
    return bool(reach) and max(reach) >= max(free, default=0.0)


def lookup_grids(corpus_grid: tuple[LookupSpec, ...] = (),
                 lookup_grid: tuple[LookupSpec, ...] = LOOKUP_ALONE_GRID) -> dict[str, tuple[LookupSpec, ...]]:
    """The lookup rows' grids by label: kinds_rows picks each row's spec from its grid, confirm_rows again on more
    sequences."""
    return {"prompt lookup": lookup_grid, **({"prompt + corpus lookup": corpus_grid} if corpus_grid else {})}


def confirm_rows(rows: list[dict], scorer: KindScorer, sweep_of, tuned_sweep_of=None,
                 margin: float | None = None, grids: dict[str, tuple[LookupSpec, ...]] | None = None) -> list[dict]:
    """The contenders re-scored, their design fixed, by `scorer` (the whole held-out set); sweep_of(arch) /
    tuned_sweep_of(arch): TreeSweeps of the supernet's / the fine-tuned subnet at the arch's tree depth.

    Contenders: rows within `margin` (a fraction) of the best speed-up on the trials' sequences, the
    training-free rows (their replay costs no forward) and rows that share a sweep with a contender (free
    then). A row further behind keeps its trials' numbers (its "sequences" says so): a full sweep of it costs
    minutes and cannot change the choice. Each confirmed row keeps what it scored before under "search".
    margin None: CONFIRM_MARGIN. grids: {label: LookupSpecs}: prompt-lookup rows of that label are picked again
    over that grid (KindScorer.best_lookup) rather than re-scored with their spec fixed."""
    grids = grids or {}
    margin = CONFIRM_MARGIN if margin is None else margin
    top = max(r["speedup"] for r in rows)
    # the sweep a row needs: (tuned, its subnet without the tree); None for the training-free rows
    keys = [(bool(r.get("tuned")), replace(DraftArch.from_json(r["arch"]), tree_depth=1, total_tokens=1))
            if r.get("arch") else None for r in rows]
    contenders = {k for k, r in zip(keys, rows) if k is not None and r["speedup"] >= (1 - margin) * top}
    deepest: dict[tuple, int] = {}  # rows of one subnet (same top_k) share a sweep at the deepest tree among them
    for k, r in zip(keys, rows):
        if k in contenders:
            deepest[k] = max(deepest.get(k, 0), DraftArch.from_json(r["arch"]).tree_depth)
    out = []
    for key, r in zip(keys, rows):
        if key is not None and key not in contenders:
            out.append(r)
            continue
        search = {"tau": r["tau"], "tau_ci95": r["tau_ci95"], "speedup": r["speedup"], "sequences": r.get("sequences")}
        keep = {k: r[k] for k in ("label", "tuned") if k in r}
        lookup = LookupSpec(**r["lookup"]) if r.get("lookup") else None
        if r["kind"] == "none":
            new = scorer.vanilla()
        elif r["kind"] == "prompt-lookup":
            grid = grids.get(r.get("label", ""))
            new = scorer.best_lookup(grid) if grid else scorer.lookup(lookup)
        elif r["kind"] == "layerskip":
            new = scorer.layerskip(r["layerskip"]["layers"], r["layerskip"]["tree_depth"])
        else:
            a = DraftArch.from_json(r["arch"])
            sweep = (tuned_sweep_of if r.get("tuned") else sweep_of)(replace(a, tree_depth=deepest[key]))
            new = scorer.neural(a, sweep, lookup, rule=r.get("merge", "union"))
        out.append({**new, **keep, "sequences": len(scorer.seqs), "search": search})
    return out


def choose(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: (r["speedup"], -SIMPLICITY[r["kind"]]))


def describe(row: dict) -> str:
    parts = []
    if row.get("layerskip"):
        s = row["layerskip"]
        parts.append(f"first {s['layers']} layers + LM head, chain {s['tree_depth']}")
    if row.get("arch"):
        a = DraftArch.from_json(row["arch"])
        parts.append(f"{a.fusion} layers{list(a.feature_layers)} d{a.depth} h{list(a.heads)} ffn{list(a.ffn)} "
                     f"vocab {a.draft_vocab or 'full'} keep {a.visual_keep:g} tree {a.tree_depth}x{a.top_k}/{a.total_tokens}")
    if row.get("lookup"):
        s = row["lookup"]
        rule = f" ({row['merge']})" if row.get("merge") else ""
        if row.get("merge") == "switch" and "neural_share" in row:
            rule = f" (switch: the network drafts in {row['neural_share']:.0%} of cycles)"
        weak = f" weak {s['weak_depth']}" if s.get("weak_depth") else ""
        corpus = f" + corpus {s['corpus_depth']}" if s.get("corpus_depth") else ""
        corpus += f"+{s['corpus_second']}" if s.get("corpus_second") else ""
        corpus += f" + {s['leaf_depth']}-token chains under {s['leaf_count']} leaves" if s.get("leaf_depth") else ""
        parts.append(f"lookup n<={s['max_ngram']} {s['tree_depth']}x{s['top_k']}/{s['total_tokens']}{weak}{corpus}"
                     f"{rule}")
    return " + ".join(parts) or "-"


def format_table(rows: list[dict], chosen: dict, hardware: str) -> str:
    n = chosen.get("sequences")
    searched = (chosen.get("search") or {}).get("sequences")
    on = f"{n} held-out sequences" if n else "held-out data"
    if searched and searched != n:
        on += f"; designs picked on the {searched} the trials scored"
        if any(r.get("sequences") != n for r in rows):
            on += f", rows over {CONFIRM_MARGIN:.0%} behind left at those"
    lines = [f"every kind of draft on {hardware} (predicted from the profile, exact greedy tau on {on}):",
             f"  {'':2}{'design':<24} {'speed-up':>8} {'tau':>6} {'tau 95% CI':>15} {'verify':>6} {'seqs':>5}  details"]
    for r in sorted(rows, key=lambda r: -r["speedup"]):
        lo, hi = r["tau_ci95"]
        mark = "->" if r is chosen else ""
        lines.append(f"  {mark:2}{r['label']:<24} {r['speedup']:>7.3f}x {r['tau']:>6.3f} [{lo:.3f}, {hi:.3f}] "
                     f"{r['verify_tokens']:>6.1f} {r.get('sequences') or '':>5}  {describe(r)}")
    lo, hi = chosen["tau_ci95"]
    if chosen["kind"] != "none" and (hi - lo) / 2 > CI_GOAL:
        lines.append(f"the chosen design's tau interval is +-{(hi - lo) / 2:.3f} wide (goal +-{CI_GOAL}): more "
                     f"held-out sequences (the scale's nas.heldout_data prompts) would narrow it")
    if chosen["kind"] == "none":
        lines.append(f"no draft is predicted faster than plain decoding on {hardware}: exporting kind 'none' "
                     f"(vanilla decoding); train a larger scale (--scale cpu/full) for a neural draft that pays")
    return "\n".join(lines)


def to_json(rows: list[dict], chosen: dict) -> str:
    return json.dumps({"rows": rows, "chosen": chosen}, indent=1)
