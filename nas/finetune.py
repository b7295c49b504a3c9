"""Optional short fine-tuning of one chosen subnet before it is exported.

The simplest correct option: keep training the *supernet* with its active arch fixed to the chosen
one, using the very losses it was trained with (supernet.unroll.subnet_losses: target KL + feature
regression over the multi-step unroll), then extract. Only the active slices receive non-zero
gradients; Adam without weight decay moves nothing else (zero gradient -> zero moments -> zero
step), and everything else is dropped by `extract` anyway. Training the extracted DraftModel
instead would need a second copy of the loss code for a plain model.

Sequences: the supernet's training data without the held-out tail, so tau stays honest.

The unroll ("training-time test") depth is matched to the chosen tree: a draft that proposes at most
`tree_depth` tokens per cycle is never asked for step tree_depth + 1, so fine-tuning trains at most that
many steps (a one-token draft, tree_depth 1, spends every step on its first guess).

Resumable: with `ckpt_dir`, the supernet copy, AdamW's moments, the step and the losses are saved every
`ckpt_every` steps and at the end (supernet/checkpoint.py: safetensors + JSON, renamed into place); a run with the
same arch, config, sequences and supernet (`identity`) continues from there, bit-exact (the data order and the
per-step loss seeds are replayed from the step), and a finished one is restored without training.

Time budget: with `time_budget_s` > 0 fine-tuning also stops after that much wall-clock (counted across resumes: the
checkpoint keeps the clock) and the cosine schedule follows whichever of steps and time runs out first, as
supernet.train does. A scale's stage then costs at most that, whatever the chosen subnet's step costs: at cpu scale
6000 steps took 10 min for a 4k-token-head subnet and 35 min for a 16k-token head with FFN 1536.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from decode.arch import DraftArch
from supernet.checkpoint import STATE, load_optimizer, load_weights, read_state, recover, save_checkpoint
from supernet.dataset import FeatureData
from supernet.elastic import DraftSupernet
from supernet.precision import autocast, autocast_dtype
from supernet.train import adamw, run_progress
from supernet.unroll import LossConfig, loss_negatives, subnet_losses

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinetuneConfig:
    steps: int
    lr: float = 3e-4
    unroll: int = 3
    unroll_decay: float = 0.7
    feat_weight: float = 0.2
    max_positions: int = 0  # scored positions per sequence and unroll step (0 = all; the CPU demo uses 32)
    grad_clip: float = 1.0
    loss: str = "topk"  # as supernet.train: the target's top-k + `negatives` frequent tokens, or full
    negatives: int = 1024
    full_positions: int = 32
    seed: int = 0
    warmup: int = 20  # steps of linear warm-up: a fresh AdamW's first updates are its largest
    final_lr: float = 0.1  # cosine decay to this fraction of lr (a constant 3e-4 left the cpu scale's one-token
    #                        subnet at tau 1.281 after 1000 steps, below the supernet's 1.297)
    time_budget_s: float = 0.0  # > 0: stop after this much fine-tuning wall-clock (the LR schedule follows it)

    @classmethod
    def like_training(cls, steps: int, state: dict, lr: float = 3e-4, time_budget_s: float = 0.0) -> "FinetuneConfig":
        """Unroll depth and position subsampling as the supernet was trained (its checkpoint's config)."""
        train = state.get("config", {})
        return cls(steps=steps, lr=lr, time_budget_s=float(time_budget_s), unroll=int(train.get("unroll", 3)),
                   unroll_decay=float(train.get("unroll_decay", 0.7)), feat_weight=float(train.get("feat_weight", 0.2)),
                   max_positions=int(train.get("max_positions", 0)), grad_clip=float(train.get("grad_clip", 1.0)),
                   loss=str(train.get("loss", "full")), negatives=int(train.get("negatives", 0)),
                   full_positions=int(train.get("full_positions", 0)))


def finetune_lr(cfg: FinetuneConfig, step: int, elapsed_s: float = 0.0) -> float:
    """The learning rate of fine-tuning step `step` (0-based) after elapsed_s of fine-tuning: linear warm-up, then a
    cosine to cfg.final_lr x lr over the steps or, with a time budget, over the time if that runs out first."""
    warm = min(1.0, (step + 1) / max(1, cfg.warmup))
    frac = min(1.0, run_progress(step / max(1, cfg.steps - 1), elapsed_s, cfg.time_budget_s))
    return cfg.lr * warm * (cfg.final_lr + (1.0 - cfg.final_lr) * 0.5 * (1.0 + math.cos(math.pi * frac)))


def _resume_point(ckpt_dir: Path | None, identity: dict) -> dict | None:
    """The saved state of this very fine-tuning run in ckpt_dir, None when there is none or it was another run's."""
    if ckpt_dir is None:
        return None
    recover(ckpt_dir)  # a save interrupted between its two renames: put the newest complete one back
    if not (Path(ckpt_dir) / STATE).is_file():
        return None
    state = read_state(ckpt_dir)
    if state.get("identity") != identity:
        logger.warning("fine-tuning checkpoint %s is another run's (arch, config, data or supernet differ); "
                       "fine-tuning starts over", ckpt_dir)
        return None
    return state


def finetune_subnet(model: DraftSupernet, arch: DraftArch, data: FeatureData, ids: list[int],
                    cfg: FinetuneConfig, ckpt_dir: Path | None = None, ckpt_every: int = 500,
                    identity: dict | None = None) -> dict:
    """Train `arch`'s slices of `model` for cfg.steps sequences (one per step) or until cfg.time_budget_s runs out;
    -> {first_loss, last_loss, steps (those run), budget_spent}. ckpt_dir: save and resume there (module doc);
    `identity` = what else the run depends on (the supernet)."""
    if not ids:
        return {"steps": 0}
    unroll = min(cfg.unroll, arch.tree_depth)  # steps past the tree's depth are never drafted
    model.set_active(arch).float().train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(params, cfg.lr, 0.0)
    rng = random.Random(cfg.seed)
    loss_cfg = LossConfig(unroll=unroll, decay=cfg.unroll_decay, feat_weight=cfg.feat_weight,
                          max_positions=cfg.max_positions, loss=cfg.loss,
                          full_positions=cfg.full_positions)
    negatives = loss_negatives(data, cfg.negatives if cfg.loss == "topk" else 0, model.feat_fc.weight.device)
    device = model.feat_fc.weight.device
    amp = autocast_dtype("auto", device)  # bf16 where the device multiplies it natively, as supernet.train
    losses: list[float] = []
    order: list[int] = []
    config = asdict(cfg)
    if not cfg.time_budget_s:  # checkpoints of before the budget existed stay this run's
        del config["time_budget_s"]
    key = {"arch": arch.to_json(), "config": config, "sequences": list(ids), "run": identity or {}}
    start, spent, before_s = 0, False, 0.0  # before_s: fine-tuning wall-clock of the runs before a resume
    saved = _resume_point(ckpt_dir, key)
    if saved is not None:
        load_weights(ckpt_dir, model)
        load_optimizer(ckpt_dir, model, opt)
        start, losses = int(saved["step"]), [float(v) for v in saved["losses"]]
        spent, before_s = bool(saved.get("budget_spent", False)), float(saved.get("elapsed_s", 0.0))
        logger.info("fine-tuning resumes at step %d of %d from %s", start, cfg.steps, ckpt_dir)
    for _ in range(start):  # replay the data order up to the saved step (no compute)
        if not order:
            order = rng.sample(ids, len(ids))
        order.pop()
    t0 = time.perf_counter() - before_s
    end = start if spent else cfg.steps  # a run its budget stopped is finished
    for step in tqdm(range(start, end), initial=start, total=cfg.steps, desc="fine-tune", unit="step", disable=None):
        elapsed = time.perf_counter() - t0
        if cfg.time_budget_s > 0 and elapsed >= cfg.time_budget_s:
            spent = True
            logger.info("fine-tuning's time budget of %.0f s reached after %d of %d steps", cfg.time_budget_s, step,
                        cfg.steps)
            if ckpt_dir is not None:
                save_checkpoint(Path(ckpt_dir), model, opt, {"identity": key, "step": step, "losses": losses,
                                                             "elapsed_s": elapsed, "budget_spent": True})
            break
        if not order:  # a fresh shuffle per epoch
            order = rng.sample(ids, len(ids))
        seq = data[order.pop()]
        for group in opt.param_groups:
            group["lr"] = finetune_lr(cfg, step, elapsed)
        with autocast(device, amp):
            loss, _ = subnet_losses(model, seq, loss_cfg, seed=cfg.seed * 1_000_003 + step, negatives=negatives)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # one per step run, resumed runs' included
        if ckpt_dir is not None and ((step + 1) % max(1, ckpt_every) == 0 or step + 1 == cfg.steps):
            save_checkpoint(Path(ckpt_dir), model, opt, {"identity": key, "step": step + 1, "losses": losses,
                                                         "elapsed_s": time.perf_counter() - t0})
    model.eval()
    done = len(losses)
    if not losses:
        return {"steps": done, "unroll": unroll, "budget_spent": spent}
    k = max(1, len(losses) // 4)  # mean of the first / last quarter: single-sequence losses are noisy
    out = {"steps": done, "unroll": unroll, "first_loss": sum(losses[:k]) / k, "last_loss": sum(losses[-k:]) / k,
           "budget_spent": spent}
    logger.info("fine-tuned %s for %d steps (unroll %d): loss %.4f -> %.4f", arch.to_json(), done, unroll,
                out["first_loss"], out["last_loss"])
    return out
