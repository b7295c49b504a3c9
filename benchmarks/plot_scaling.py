"""Plot a data-scaling CSV (benchmarks/results/scaling-*.csv): held-out tau against training wall-clock.

    python benchmarks/plot_scaling.py benchmarks/results/scaling-cpu-partial.csv   # -> same name .png

Columns: curve, data, train_s, scored_positions, tau_2x2_4, tau_4x2_16, source. One line per curve
(a: the EAGLE-like subnet of the supernet, b: the NAS-chosen subnet, c: the EAGLE-like arch trained
alone), tau on the small CPU tree (2x2/4, solid) and a deeper one (4x2/16, dashed).
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict
from pathlib import Path


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
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, rows) in enumerate(sorted(curves.items())):
        rows.sort(key=lambda r: float(r["train_s"]))
        x = [float(r["train_s"]) / 60 for r in rows]
        color = f"C{i}"
        ax.plot(x, [float(r["tau_2x2_4"]) for r in rows], "o-", color=color, label=f"{name} (2x2/4)")
        ax.plot(x, [float(r["tau_4x2_16"]) for r in rows], "s--", color=color, alpha=0.6, label=f"{name} (4x2/16)")
    ax.set_xlabel("training wall-clock on 2 CPU cores (minutes)")
    ax.set_ylabel("held-out exact greedy tau")
    ax.set_title("smolvlm-135m: acceptance against training time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    out = path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
