"""Tree geometry shared by the target adapter and the drafts: ancestor masks, depths, 4D masks.

A draft tree of N tokens is given by `parents` (N,): parents[i] is the index of token i's parent
inside the tree, or -1 when token i hangs directly off the last committed token. Parents always
come before their children (parents[i] < i), so one forward pass over the N tokens in index order,
with each token attending to the committed past and to its own ancestors, verifies every
root-to-leaf path at once.
"""

from __future__ import annotations

import torch


def validate_parents(parents: torch.Tensor) -> None:
    """Raise ValueError unless parents (N,) is a topologically ordered forest (-1 = root-level)."""
    if parents.ndim != 1:
        raise ValueError(f"parents must be 1-D (N,), got shape {tuple(parents.shape)}")
    idx = torch.arange(parents.numel(), device=parents.device)
    if bool(((parents < -1) | (parents >= idx)).any()):
        raise ValueError("parents[i] must be -1 or an index < i (parents listed before children)")


def ancestor_mask(parents: torch.Tensor, check: bool = True) -> torch.Tensor:
    """(N,N) bool, [i, j] True when j is i itself or one of i's ancestors.

    check: validate `parents` first (reads them back: a host sync on a GPU; the loop's own trees skip it).

    Transitive closure by repeated squaring of the "self or parent" relation: after k squarings
    a row reaches every ancestor up to 2**k levels up, and a tree of N tokens is at most N deep,
    so ceil(log2 N) squarings suffice. A fixed number of small matmuls (no per-node Python loop,
    no host sync) keeps this cheap on a GPU; 0/1 products summed in fp32 are exact for N < 2**24.
    """
    if check:
        validate_parents(parents)
    n = parents.numel()
    device = parents.device
    eye = torch.eye(n, dtype=torch.bool, device=device)
    if n == 0:
        return eye
    has_parent = (parents >= 0)[:, None]  # (N, 1)
    parent_hot = torch.nn.functional.one_hot(parents.clamp(min=0).long(), n).bool() & has_parent
    reach = (eye | parent_hot).float()  # (N, N) self or parent
    for _ in range(max(1, (n - 1).bit_length())):
        reach = ((reach @ reach) > 0).float()
    return reach.bool()


def depths_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """(N,) long: 0 for root-level tokens; the number of strict ancestors otherwise."""
    return mask.sum(dim=-1).to(torch.long) - 1


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (..., Q, K) -> float mask with 0 where allowed and finfo.min elsewhere.

    HF eager attention adds the mask to the scores, so a bool mask would be added as 0/1
    (silently wrong); a float mask works for eager and sdpa alike.
    """
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return out.masked_fill_(~allowed, torch.finfo(dtype).min)


def tree_attention_allowed(
    tent_mask: torch.Tensor,
    q_depths: torch.Tensor,
    k_depths: torch.Tensor,
    past_len: int,
    sliding_window: int | None,
) -> torch.Tensor:
    """(N, past_len + M) bool: which keys each of N new tree tokens may attend to.

    Keys are the past_len committed tokens (positions 0..past_len-1) followed by M tentative tree
    tokens (earlier tree levels, then the N new ones) at positions past_len + k_depths.
    tent_mask (N, M) says which tentative keys each query may see (its ancestors and itself).
    Query i sits at position past_len + q_depths[i]. With a sliding window W a query at position q
    only sees keys at positions k with q - k < W (HF convention: kv_idx > q_idx - W).
    """
    n = tent_mask.shape[0]
    device = tent_mask.device
    past = torch.ones(n, past_len, dtype=torch.bool, device=device)
    allowed = torch.cat([past, tent_mask], dim=1)  # (N, P+M)
    if sliding_window is not None:
        q_pos = past_len + q_depths  # (N,)
        k_pos = torch.cat([torch.arange(past_len, device=device), past_len + k_depths])  # (P+M,)
        allowed &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    return allowed
