"""One subnet on one training sequence: the multi-step unroll ("training-time test") and its losses.

Step 0 is how the draft runs on committed tokens: position j gets (x_j, feat(f_{j-1})), with
causal self-attention and cross-attention to target features of positions < j. Its output h_j
should predict the target's next-token distribution at j and regress the target feature f_j.

Step s >= 1 is how the draft runs s levels deep in a tree rooted at position p - s: the token is
still the true x_p (deeper nodes only matter when the path was accepted) but the feature input is
the draft's own output h^(s-1)_{p-1}; self-attention sees step-0 entries up to the root (p - s)
and the step-t entries at p - s + t (its own tree ancestors); cross-attention sees target
features of positions < p - s. Later steps are weighted less (decay^s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decode.arch import DraftArch
from decode.targets.capture import normalize_layer
from supernet.elastic import DraftSupernet


@dataclass(frozen=True)
class LossConfig:
    unroll: int = 3  # steps 0..unroll-1
    decay: float = 0.7  # weight of step s = decay**s
    kl_weight: float = 1.0
    feat_weight: float = 0.2
    aux_weight: float = 0.1  # entropy-layer feature regression, where the arch uses that layer
    max_positions: int = 0  # > 0: score only this many (seeded) positions per step; the LM head dominates on CPU
    answer_only: bool = True  # score positions that predict answer tokens (what a draft proposes at run time)
    loss: str = "topk"  # topk: softmax over the target's stored top-k + shared negatives | full: whole vocabulary
    full_positions: int = 32  # topk loss: also this many (seeded) positions per step with the full-vocabulary loss
    # uniform noise on the target features the draft reads (both its fused input and its cross-attention memory),
    # U(-a, a) times each position's feature RMS: at run time the draft reads its own, imperfect features from
    # tree depth 2 on, and with a few hundred sequences it memorises clean ones (EAGLE trains with such noise)
    feat_noise: float = 0.0

    def __post_init__(self) -> None:
        if self.loss not in ("topk", "full"):
            raise ValueError(f"unknown loss '{self.loss}'; use topk or full")
        if not self.feat_noise >= 0:
            raise ValueError(f"feat_noise must be >= 0, got {self.feat_noise}")


def unroll_mask(t: int, step: int, device: torch.device) -> torch.Tensor:
    """(T, (step+1)*T) bool: which cached entries a step-`step` query at sequence index p sees."""
    p = torch.arange(t, device=device)
    blocks = [p[None, :] <= (p[:, None] - step)]  # step-0 entries up to the root p - step
    for s in range(1, step + 1):
        blocks.append(p[None, :] == (p[:, None] - step + s))  # the ancestor at depth s
    return torch.cat(blocks, dim=1)


def _ce_kl(logq: torch.Tensor, topk_logits: torch.Tensor, lse: torch.Tensor):
    """(n, K) draft log-probs of the target's top-k (−inf: cannot say) -> per-row CE and KL against the
    target's top-k probabilities exp(l - lse), renormalised over the tokens the draft can say."""
    p = torch.exp(topk_logits.float() - lse.float()[:, None])
    p = torch.where(torch.isfinite(logq), p, torch.zeros_like(p))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
    logq = torch.where(torch.isfinite(logq), logq, torch.zeros_like(logq))
    ce = -(p * logq).sum(-1)
    kl = (p * (torch.log(p.clamp_min(1e-12)) - logq)).sum(-1)
    return ce, kl


def target_kl(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logits: torch.Tensor, lse: torch.Tensor):
    """Cross-entropy of the draft against the target's top-k distribution, and the KL for logging.

    logits (n, V) draft (−inf outside its vocab); topk_* (n, K) and lse (n,) from the target: the
    target probabilities of the top-k are exp(l - lse). Tokens the draft cannot produce are
    dropped and p renormalised over the rest (a reduced-vocab draft is judged on what it can say).
    """
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, topk_ids)  # (n, K)
    return _ce_kl(logq, topk_logits, lse)


def topk_ce(logits_c: torch.Tensor, topk_logits: torch.Tensor, lse: torch.Tensor):
    """Cross-entropy and KL of the draft against the target over candidate tokens only.

    logits_c (n, K + M) draft logits of the target's top-k ids, then of M shared negatives (the most
    frequent answer tokens, −inf where they repeat a top-k id), −inf where the draft cannot say a
    token. The target's probability is exp(l - lse) on its top-k and 0 on the negatives (they lie
    outside its top-k), renormalised over the top-k; the draft's softmax runs over all K + M. So the
    draft learns to rank the target's candidates and to keep common intruders below them, at
    K + M head rows instead of V. With K = V it is exactly target_kl."""
    logq = torch.log_softmax(logits_c.float(), dim=-1)[:, : topk_logits.shape[1]]  # (n, K)
    return _ce_kl(logq, topk_logits, lse)


def noisy(x: torch.Tensor, amplitude: float, seed: int) -> torch.Tensor:
    """x (T, D) plus U(-amplitude, amplitude) * the RMS of each row (a scale-free amount for any target's features),
    drawn from `seed`; x itself when amplitude is 0."""
    if amplitude <= 0:
        return x
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(x.shape, generator=gen, dtype=torch.float32).to(device=x.device, dtype=x.dtype)  # (T, D) in [0, 1)
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt().to(x.dtype)  # (T, 1)
    return x + (2 * u - 1) * amplitude * rms


def visible_positions(arch: DraftArch, image_mask: torch.Tensor, attn_received: torch.Tensor) -> torch.Tensor:
    """Sequence indices the draft sees: all text tokens + the most attended visual_keep of images."""
    keep = torch.ones_like(image_mask, dtype=torch.bool)
    img = image_mask.nonzero().flatten()
    if img.numel() and arch.visual_keep < 1:
        n = max(1, math.ceil(arch.visual_keep * img.numel()))
        keep[img] = False
        keep[img[attn_received[img].topk(n).indices]] = True
    return keep.nonzero().flatten()


def seeded_subset(idx: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """At most n entries of idx (1-D), drawn by a seeded permutation (the same for every subnet of a step)."""
    pick = torch.randperm(idx.numel(), generator=torch.Generator().manual_seed(seed))
    return idx[pick[:n].to(idx.device)]


def loss_negatives(data, n: int, device: torch.device) -> torch.Tensor | None:
    """The topk loss's shared negatives: the n most frequent answer tokens of `data` (FeatureData); None for n = 0."""
    return data.hot_tokens(min(n, data.vocab_size)).to(device) if n > 0 else None


def subnet_losses(model: DraftSupernet, seq: dict, cfg: LossConfig, seed: int = 0,
                  negatives: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted loss of the active subnet on one sequence (scalar) and logging figures.

    negatives (M,) target token ids every position of the topk loss also scores (see topk_ce).

    seed picks the scored positions when cfg.max_positions limits them (the same for every subnet
    of a step, so the sandwich compares like with like)."""
    arch = model.active
    num_layers = model.dims.num_layers
    dev = model.feat_fc.weight.device
    hid = {k: v.to(dev) for k, v in seq["hidden"].items()}
    feats = torch.cat([hid[normalize_layer(x, num_layers)] for x in arch.feature_layers], dim=-1)  # (T, F*H)
    # seeded like the scored positions: every subnet of a step sees the same noise (the sandwich compares like
    # with like) and a resumed run draws what the uninterrupted one would have
    feats = noisy(feats, cfg.feat_noise, seed * 41 + 7)
    last = hid[num_layers]  # (T, H) regression target: the target's final hidden state
    keep = visible_positions(arch, seq["image_mask"], seq["attn_received"]).to(dev)
    ids = seq["input_ids"].to(dev)[keep]
    prev = torch.cat([feats.new_zeros(1, feats.shape[1]), feats[:-1]])[keep]  # feature of position j-1
    pos = keep  # original positions (gaps where image tokens were dropped)
    t = keep.numel()
    loss_mask = seq["loss_mask"].to(dev).bool()
    if cfg.answer_only and "prompt_len" in seq:  # position j predicts token j+1: answers start at prompt_len - 1
        loss_mask = loss_mask & (torch.arange(loss_mask.numel(), device=dev) >= int(seq["prompt_len"]) - 1)
    mask = loss_mask[keep]
    topk_ids, topk_logits, lse = (seq[k].to(dev)[keep] for k in ("topk_ids", "topk_logits", "lse"))
    aux_target = None
    if model.entropy_layer is not None and any(
        normalize_layer(x, num_layers) == normalize_layer(model.entropy_layer, num_layers) for x in arch.feature_layers
    ):
        aux_target = hid[normalize_layer(model.entropy_layer, num_layers)][keep]

    cache = model.new_cache()
    model.add_memory(cache, model.project_features(feats[keep]), pos)
    g = model.project_features(prev)
    total = torch.zeros((), device=dev)
    stats: dict[str, float] = {}
    for step in range(cfg.unroll):
        h = model(ids, g, pos, unroll_mask(t, step, dev), cache, mem_lag=step)  # (T, H)
        valid = mask.clone()
        valid[:step] = False  # the root p - step must exist
        if not bool(valid.any()):
            break
        if cfg.max_positions and int(valid.sum()) > cfg.max_positions:
            idx = seeded_subset(valid.nonzero().flatten(), cfg.max_positions, seed * 31 + step)
            valid = torch.zeros_like(valid)
            valid[idx] = True
        anchor = torch.zeros((), device=dev)  # topk loss: the full-vocabulary term on a few positions
        if cfg.loss == "topk":
            ids_k = topk_ids[valid]  # (n, K)
            logits = model.logits_at(h[valid], ids_k, negatives)  # (n, K + M)
            if negatives is not None and negatives.numel():  # a negative that is one of the row's top-k counts once
                dup = (negatives[None, None, :] == ids_k[:, :, None]).any(1)  # (n, M)
                logits[:, ids_k.shape[1]:] = logits[:, ids_k.shape[1]:].masked_fill(dup, -float("inf"))
            ce, kl = topk_ce(logits, topk_logits[valid], lse[valid])
            top1 = logits.argmax(-1) == 0  # the draft ranks the target's top token above the other candidates
            if cfg.full_positions:
                # the candidate softmax never sees most of the vocabulary, so nothing stops a rare token from
                # drifting above the candidates in the full argmax (measured: held-out tau fell to 1.07); a few
                # full-vocabulary positions per step keep every logit in place
                sub = seeded_subset(valid.nonzero().flatten(), cfg.full_positions, seed * 37 + step)
                full_ce, _ = target_kl(model.logits(h[sub]), topk_ids[sub], topk_logits[sub], lse[sub])
                anchor = full_ce.mean()
        else:
            logits = model.logits(h[valid])  # (n, V)
            ce, kl = target_kl(logits, topk_ids[valid], topk_logits[valid], lse[valid])
            top1 = logits.argmax(-1) == topk_ids[valid][:, 0]
        feat = F.smooth_l1_loss(h[valid].float(), last[keep][valid].float())
        loss = cfg.kl_weight * (ce.mean() + anchor) + cfg.feat_weight * feat
        if aux_target is not None:
            loss = loss + cfg.aux_weight * F.smooth_l1_loss(model.aux_proj(h[valid]).float(), aux_target[valid].float())
        total = total + (cfg.decay ** step) * loss
        stats[f"kl{step}"] = float(kl.detach().mean())
        stats[f"acc{step}"] = float(top1.float().mean())  # top-1 agreement (among the K for the topk loss)
        stats[f"n{step}"] = float(valid.sum())  # scored positions
        # next step: each position is fed the draft's own output at the previous position
        g = torch.cat([h.new_zeros(1, h.shape[1]), h[:-1]])
    stats["loss"] = float(total.detach())
    return total, stats
