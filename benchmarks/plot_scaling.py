"""Plot a data-scaling CSV (benchmarks/results/scaling-*.csv): held-out tau against training wall-clock
(left) and against scored training positions (right, when the CSV has them).

    python benchmarks/plot_scaling.py benchmarks/results/scaling-cpu-partial.csv   # -> same name .png

Columns: curve, train_s, and one `tau_<depth>x<topk>_<total>` column per tree (as `python -m nas.ablation
--scaling-csv` writes them; other columns are ignored). One colour per curve (e.g. a: the EAGLE-like subnet
of the supernet, b: the NAS-chosen subnet, c: the EAGLE-like arch trained alone), each tree its own line
style and marker (solid, dashed, dotted, dash-dotted); rows without a tree's tau are left out of that line.
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict
from pathlib import Path

STYLES = ("o-", "s--", "^:", "d-.")  # one line style and marker per tree, in the CSV's column order


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(argv) != 1:
        print(__doc__)
        return 2
    path = Path(argv[0])
    curves: dict[str, list[dict]] = defaultdict(list)
    with path.open() as f:
        for row in csv.DictReader(f):
            curves[row["curve"]].append(row)
    trees = list(dict.fromkeys(k for rows in curves.values() for r in rows for k in r if k.startswith("tau_")))
    by_positions = all(r.get("scored_positions") for rows in curves.values() for r in rows)
    fig, axes = plt.subplots(1, 2 if by_positions else 1, figsize=(13 if by_positions else 8, 5), squeeze=False)
    xs = [("train_s", 1 / 60, "training wall-clock on 2 CPU cores (minutes)")]
    if by_positions:  # the same runs against what they learnt from: the cost of weight sharing per sample
        xs.append(("scored_positions", 1e-3, "scored answer positions trained on (thousands; per network of a step)"))
    for ax, (col, scale, xlabel) in zip(axes[0], xs):
        for i, (name, rows) in enumerate(sorted(curves.items())):
            rows.sort(key=lambda r: float(r[col]))
            for j, tree in enumerate(trees):
                pts = [(float(r[col]) * scale, float(r[tree])) for r in rows if r.get(tree)]
                if pts:
                    label = tree[4:].replace("_", "/")
                    ax.plot(*zip(*pts), STYLES[j % len(STYLES)], color=f"C{i}", alpha=1.0 if j == 0 else 0.7,
                            label=f"{name} ({label})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out exact greedy tau")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("smolvlm-135m: acceptance against training time and positions")
    out = path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
