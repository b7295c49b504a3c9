"""The SearchSpace as Optuna define-by-run parameters, and the archs every new study starts with.

One categorical parameter per DraftArch field, per-layer ones only for the layers that exist:

    fusion                  space.fusion
    feature_set             index into space.feature_layers (a layer *set* is one choice; indices keep
                            the parameter plain and the "entropy" entry unresolved in the storage)
    depth                   space.depth
    heads_{i}, ffn_{i}      space.heads / space.ffn, for i < depth (define-by-run: a depth-1 trial has
                            no heads_1, so the samplers never tune parameters that do not exist)
    draft_vocab             space.draft_vocab (None = the full vocabulary)
    visual_keep             space.visual_keep
    tree_depth, top_k, total_tokens
                            the tree; total_tokens is clamped to what a dynamic tree of that depth and
                            top_k can hold, as SearchSpace does (so equal trees are equal archs)
"""

from __future__ import annotations

import itertools

import optuna

from decode.arch import DraftArch, max_tree_nodes
from decode.space import SearchSpace


def params_to_arch(params: dict, space: SearchSpace, entropy_layer: int | None) -> DraftArch:
    """A complete parameter dict (as a trial holds it) -> its DraftArch."""
    depth = int(params["depth"])
    td, k = int(params["tree_depth"]), int(params["top_k"])
    return DraftArch(
        fusion=params["fusion"],
        feature_layers=space.resolve_layers(space.feature_layers[int(params["feature_set"])], entropy_layer),
        depth=depth,
        heads=tuple(int(params[f"heads_{i}"]) for i in range(depth)),
        ffn=tuple(int(params[f"ffn_{i}"]) for i in range(depth)),
        draft_vocab=params["draft_vocab"],
        visual_keep=float(params["visual_keep"]),
        tree_depth=td, top_k=k, total_tokens=min(int(params["total_tokens"]), max_tree_nodes(td, k)),
    )


def suggest_arch(trial: optuna.Trial, space: SearchSpace, entropy_layer: int | None, tree: bool = True) -> DraftArch:
    """Sample one arch through the trial (define-by-run).

    tree=False: the sampler picks top_k but not the tree depth and total_tokens, which come back as the
    space's largest (the caller chooses them, e.g. per device: SpeedupObjective.best_tree).
    """
    p: dict = {
        "fusion": trial.suggest_categorical("fusion", list(space.fusion)),
        "feature_set": trial.suggest_categorical("feature_set", list(range(len(space.feature_layers)))),
        "depth": trial.suggest_categorical("depth", list(space.depth)),
    }
    for i in range(int(p["depth"])):
        p[f"heads_{i}"] = trial.suggest_categorical(f"heads_{i}", list(space.heads))
        p[f"ffn_{i}"] = trial.suggest_categorical(f"ffn_{i}", list(space.ffn))
    for name in ("draft_vocab", "visual_keep", "tree_depth", "top_k", "total_tokens"):
        if tree or name not in ("tree_depth", "total_tokens"):
            p[name] = trial.suggest_categorical(name, list(getattr(space, name)))
        else:
            p[name] = max(getattr(space, name))
    return params_to_arch(p, space, entropy_layer)


def arch_to_params(arch: DraftArch, space: SearchSpace, entropy_layer: int | None) -> dict:
    """The parameter dict that reproduces `arch` (for enqueue_trial); ValueError if the space lacks it."""
    sets = [i for i, s in enumerate(space.feature_layers)
            if _resolvable(s, entropy_layer) and space.resolve_layers(s, entropy_layer) == arch.feature_layers]
    totals = [t for t in space.total_tokens if min(t, max_tree_nodes(arch.tree_depth, arch.top_k)) == arch.total_tokens]
    if not sets or not totals:
        raise ValueError(f"arch {arch.to_json()} is not in search space '{space.name}'")
    p: dict = {"fusion": arch.fusion, "feature_set": sets[0], "depth": arch.depth}
    for i in range(arch.depth):
        p[f"heads_{i}"], p[f"ffn_{i}"] = arch.heads[i], arch.ffn[i]
    p.update(draft_vocab=arch.draft_vocab, visual_keep=arch.visual_keep, tree_depth=arch.tree_depth,
             top_k=arch.top_k, total_tokens=totals[0])
    return p


def every_arch(space: SearchSpace, entropy_layer: int | None, tree: bool, limit: int) -> list[dict] | None:
    """The parameter dicts of every distinct arch suggest_arch can return (tree=False: the tree as it sets
    it), in a fixed order; None as soon as there are more than `limit` (too many to enumerate)."""
    trees = (list(itertools.product(space.tree_depth, space.total_tokens)) if tree
             else [(max(space.tree_depth), max(space.total_tokens))])
    found: dict[str, dict] = {}
    for fusion, fset, depth in itertools.product(space.fusion, range(len(space.feature_layers)), space.depth):
        if not _resolvable(space.feature_layers[fset], entropy_layer):
            continue
        for layers in itertools.product(itertools.product(space.heads, space.ffn), repeat=depth):
            for vocab, keep, k, (td, total) in itertools.product(space.draft_vocab, space.visual_keep, space.top_k,
                                                                  trees):
                p = {"fusion": fusion, "feature_set": fset, "depth": depth, "draft_vocab": vocab,
                     "visual_keep": keep, "tree_depth": td, "top_k": k, "total_tokens": total}
                for i, (h, f) in enumerate(layers):
                    p[f"heads_{i}"], p[f"ffn_{i}"] = h, f
                found.setdefault(params_to_arch(p, space, entropy_layer).to_json(), p)
                if len(found) > limit:
                    return None
    return list(found.values())


def _resolvable(layer_set: tuple, entropy_layer: int | None) -> bool:
    return "entropy" not in layer_set or entropy_layer is not None


def starting_archs(space: SearchSpace, entropy_layer: int | None) -> list[tuple[str, DraftArch]]:
    """(label, arch) enqueued first in a new study: EAGLE-like default, largest, smallest (duplicates dropped)."""
    out: list[tuple[str, DraftArch]] = []
    for label, arch in (("eagle-like", space.eagle_like(entropy_layer)), ("largest", space.largest(entropy_layer)),
                        ("smallest", space.smallest(entropy_layer))):
        if all(arch != a for _, a in out):
            out.append((label, arch))
    return out
