"""Plots of a profile (matplotlib, Agg): verify latency vs tree size, draft cycle vs depth and width.

Left: verify latency against the number of candidate tokens, one line per context length (the
grid points as markers). Right: LatencyModel.draft_cycle_ms against draft depth for a few layer
widths (heads x FFN) of the profile's search space, at the default context, a mid-size tree and
the space's smallest draft vocabulary.
"""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402

from decode.arch import DraftArch  # noqa: E402
from hwprofile.latency import LatencyModel  # noqa: E402
from hwprofile.schema import Profile  # noqa: E402

logger = logging.getLogger(__name__)


def _reference_arch(space: dict, heads: int, ffn: int, depth: int) -> DraftArch:
    vocabs = [v for v in space["draft_vocab"] if v is not None]
    td = sorted(space["tree_depth"])[len(space["tree_depth"]) // 2]
    k = sorted(space["top_k"])[len(space["top_k"]) // 2]
    return DraftArch(fusion="concat", feature_layers=(-1,), depth=depth, heads=(heads,) * depth, ffn=(ffn,) * depth,
                     draft_vocab=min(vocabs) if vocabs else None, tree_depth=td, top_k=k,
                     total_tokens=max(space["total_tokens"]))


def plot_profile(profile: Profile, path: str | Path) -> Path:
    model = LatencyModel(profile)
    verify = profile.tables["verify"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ctx in verify.grid("ctx"):
        ns = verify.grid("n")
        ax1.plot(ns, [verify.ms[(n, ctx)] for n in ns], marker="o", ms=3, label=f"context {ctx}")
    ax1.set_xscale("log", base=2)
    ticks = [2**i for i in range(int(max(verify.grid("n"))).bit_length())]
    ax1.set_xticks(ticks, [str(t) for t in ticks])
    ax1.set_xlabel("candidate tokens verified (root included)")
    ax1.set_ylabel("verify latency (ms)")
    ax1.set_title("target verify")
    ax1.legend(fontsize=8)

    space = profile.space
    depths = sorted(space["depth"])
    widths = sorted({(min(space["heads"]), min(space["ffn"])), (max(space["heads"]), max(space["ffn"])),
                     (sorted(space["heads"])[len(space["heads"]) // 2], sorted(space["ffn"])[len(space["ffn"]) // 2])})
    for heads, ffn in widths:
        ys = [model.draft_cycle_ms(_reference_arch(space, heads, ffn, d)) for d in depths]
        ax2.plot(depths, ys, marker="o", ms=3, label=f"{heads} heads, ffn {ffn}")
    ref = _reference_arch(space, widths[0][0], widths[0][1], 1)
    ax2.set_xlabel("draft depth (layers)")
    ax2.set_ylabel("draft cycle latency (ms)")
    ax2.set_title(f"draft cycle (tree {ref.tree_depth}x{ref.top_k}, vocab {ref.draft_vocab or 'full'})")
    ax2.set_xticks(depths)
    ax2.legend(fontsize=8)
    kind = "predicted" if profile.predicted else "measured"
    fig.suptitle(f"{profile.hardware} / {profile.target_name} ({profile.dtype}, {profile.runtime}, {kind}, "
                 f"context {model.default_context})", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    logger.info("wrote %s", out)
    return out
