"""What a search leaves behind: every trial as CSV, the best ones as a table, a trials / Pareto plot.

    trials.csv     one row per trial (all states): number, state, speed-up, tau, predicted cycle /
                   draft / verify ms, draft params, extra memory, feasibility, the arch and its params
    best.csv       the top finished, feasible trials by predicted speed-up (also logged as a table)
    trials.png     draft params (log) vs predicted speed-up of every finished trial: feasible ones by
                   fusion, infeasible ones grey, the Pareto front (max speed-up, min params) joined
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import optuna
import pandas as pd

logger = logging.getLogger(__name__)

COLUMNS = ["number", "state", "speedup", "tau", "cycle_ms", "draft_ms", "verify_ms", "target_step_ms", "tree_tokens",
           "params", "memory_mb", "feasible", "start", "repeat", "tree_chosen", "arch"]
SHOWN = ["number", "speedup", "tau", "cycle_ms", "draft_ms", "verify_ms", "params", "fusion", "depth", "tree"]


def trials_frame(study: optuna.Study) -> pd.DataFrame:
    rows = []
    for t in study.get_trials(deepcopy=False):
        row = {"number": t.number, "state": t.state.name}
        row.update({k: t.user_attrs.get(k) for k in COLUMNS[2:]})
        row.update({f"param_{k}": v for k, v in t.params.items()})
        rows.append(row)
    df = pd.DataFrame(rows, columns=None if rows else COLUMNS)
    for c in COLUMNS:
        if c not in df:
            df[c] = None
    return df


def finished(df: pd.DataFrame) -> pd.DataFrame:
    """Complete and feasible trials, best predicted speed-up first (ties: fewer params, earlier trial)."""
    ok = df[(df["state"] == "COMPLETE") & (df["feasible"] == True)]  # noqa: E712 (a column, not a bool)
    return ok.sort_values(["speedup", "params", "number"], ascending=[False, True, True])


def best_table(df: pd.DataFrame, n: int = 10) -> pd.DataFrame:
    """The n best distinct archs (a re-proposed arch is listed once, at its first trial)."""
    top = finished(df).drop_duplicates("arch").head(n).copy()
    if top.empty:
        return pd.DataFrame(columns=SHOWN)
    archs = top["arch"].map(json.loads)
    top["fusion"] = archs.map(lambda a: a["fusion"])
    top["depth"] = archs.map(lambda a: a["depth"])
    top["tree"] = archs.map(lambda a: f"{a['tree_depth']}x{a['top_k']}/{a['total_tokens']}")
    return top[SHOWN].reset_index(drop=True)


def pareto_front(df: pd.DataFrame) -> pd.DataFrame:
    """Finished feasible trials not dominated in (speed-up up, params down), by params."""
    ok = finished(df).sort_values(["params", "speedup"], ascending=[True, False])
    keep, best = [], -float("inf")
    for i, row in ok.iterrows():
        if row["speedup"] > best:
            keep.append(i)
            best = row["speedup"]
    return ok.loc[keep]


def plot_trials(df: pd.DataFrame, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    done = df[df["state"] == "COMPLETE"]
    bad = done[done["feasible"] != True]  # noqa: E712
    if not bad.empty:
        ax.scatter(bad["params"], bad["speedup"], c="lightgrey", s=18, label="over budget")
    ok = finished(df)
    fusions = ok["arch"].map(lambda s: json.loads(s)["fusion"])
    for fusion in sorted(set(fusions)):
        sel = ok[fusions == fusion]
        ax.scatter(sel["params"], sel["speedup"], s=22, label=fusion)
    front = pareto_front(df)
    if not front.empty:
        ax.step(front["params"], front["speedup"], where="post", color="black", lw=1, label="Pareto front")
        best = ok.iloc[0]
        ax.annotate(f"#{int(best['number'])}: {best['speedup']:.2f}x", (best["params"], best["speedup"]),
                    textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("draft parameters (own weights)")
    ax.set_ylabel("predicted speed-up over vanilla")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(study: optuna.Study, out: Path, title: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """trials.csv, best.csv, trials.png under `out`; -> (all trials, best table)."""
    df = trials_frame(study)
    df.to_csv(out / "trials.csv", index=False)
    best = best_table(df)
    best.to_csv(out / "best.csv", index=False)
    if not finished(df).empty:
        plot_trials(df, out / "trials.png", title)
    return df, best
