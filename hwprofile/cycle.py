"""One speculative cycle exactly as decode.loop.speculative runs it, split where the profiler times it.

    draft.propose  the draft builds its tree                                    -> draft components + overhead
    verify_tree    truncation + forward_tree + verify + keep + path bookkeeping -> the `verify` table
    draft.accept   the draft learns the outcome                                 -> feat_fc, memory_append + overhead

Also: fixed-length synthetic contexts (real text, so no image or special tokens) and a verify tree
of any size, for the target tables.
"""

from __future__ import annotations

import functools

import torch

from decode.loop.sampling import SamplingConfig
from decode.loop.speculative import verify_cycle
from decode.loop.tree import DraftTree
from decode.prompt import Prompt
from decode.targets.target import TargetModel

GREEDY = SamplingConfig()
_NO_LIMIT = 1 << 30

_FILLER = (
    "The history of computing is a story of people finding ways to make machines do arithmetic faster and "
    "more reliably. Early mechanical calculators used gears and levers; later, relays and vacuum tubes replaced "
    "them, and the transistor made computers small enough to sit on a desk. Today a phone holds more memory than "
    "the largest machines of the nineteen sixties, and software written by millions of programmers runs on it. "
)


@functools.lru_cache(maxsize=8)
def _filler_ids(tokenizer) -> torch.Tensor:
    return tokenizer(_FILLER, add_special_tokens=False, return_tensors="pt")["input_ids"][0]  # (T,)


def synthetic_prompt(target: TargetModel, length: int) -> Prompt:
    """A text-only Prompt of exactly `length` tokens (a fixed English passage, repeated)."""
    ids = _filler_ids(target.tokenizer)
    reps = -(-length // ids.numel())
    input_ids = ids.repeat(reps)[:length][None]  # (1, length)
    return Prompt(input_ids=input_ids, model_inputs={"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)},
                  text="<synthetic>")


def filler_tokens(target: TargetModel, n: int, offset: int = 0) -> torch.Tensor:
    """(n,) real text token ids (never an image or special token)."""
    ids = _filler_ids(target.tokenizer)
    return ids.roll(-offset).repeat(-(-n // ids.numel()))[:n].clone()


def verify_shape_tree(target: TargetModel, n: int, branching: int = 4) -> DraftTree:
    """A draft-like tree of n nodes (node 0 the root, each node with up to `branching` children)."""
    parents = torch.tensor([-1] + [(i - 1) // branching for i in range(1, n)])
    return DraftTree(filler_tokens(target, n, offset=3), parents)


def verify_tree(target: TargetModel, tree: DraftTree, feature_layers: tuple[int, ...],
                sampling: SamplingConfig = GREEDY) -> tuple[list[int], int, list[int], dict[int, torch.Tensor]]:
    """The loop's verify half (decode.loop.speculative): score the tree, pick the path, keep it.

    -> path (node ids), bonus token, path tokens, target features at the path ({layer: (m, H)}).
    """
    tree = tree.truncated(_NO_LIMIT)  # the loop truncates near max_new_tokens; same bookkeeping
    verdict, path_hidden = verify_cycle(target, tree, feature_layers, sampling, None)
    return verdict.path, verdict.bonus, verdict.tokens, path_hidden
