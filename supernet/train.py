"""`python -m supernet.train`: sandwich-rule training of the draft supernet toward the target.

    python -m supernet.train --target smolvlm-135m --data out/data-smolvlm-135m --scale demo
    torchrun --nproc_per_node=2 -m supernet.train --target tiny-llava --data DIR --space tiny --steps 20

Each step trains the largest, the smallest and `n_random` random subnets (the same on every rank;
--schedule progressive: the largest alone for the first third of the steps, then elastic depth, then the
full sandwich; --eagle-role adds the space's EAGLE-like default every step or every other step) on this
rank's sequences. Losses: cross-entropy/KL to the target's next-token distribution at every answer
position (--loss topk: a softmax over the target's stored top-k + --negatives frequent tokens, with
--full-positions positions per sequence also scored over the whole vocabulary; --loss full: the whole
vocabulary, --max-positions per sequence) + smooth-L1 regression of the target's final feature (+ the
entropy-layer feature where used), over a multi-step unroll (supernet/unroll.py). Sequences without an
answer position are never drawn.
--init-from-target starts the draft layers from the target's last decoder layer (decode/drafts/from_target.py);
--time-budget-s stops after that much training time, counted across --resume (the checkpoint keeps the clock;
the LR schedule then follows time, and a run stopped by its budget is finished). AdamW,
linear warm-up then cosine decay, gradient clipping, bf16 autocast where the hardware has bf16 units (--autocast;
supernet/precision.py), checkpoints every `ckpt_every` steps (resumable
exactly: the subnets and sequences of step s derive from (seed, s)), a CSV log, tqdm.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from configs import config_dir
from decode.arch import DraftArch
from decode.cli import add_target_args, run_cli, setup_logging
from decode.drafts.from_target import init_from_target
from decode.drafts.model import TargetDims
from decode.errors import UserError
from decode.paths import writable_dir
from decode.space import SearchSpace, default_space_name, weights_part
from decode.targets.compat import check_fingerprint
from decode.targets.loader import load_target
from supernet import checkpoint as ckpt
from supernet.dataset import FeatureData
from supernet.distributed import average_gradients, barrier, init_distributed, shutdown
from supernet.elastic import DraftSupernet
from supernet.precision import MODES, autocast, autocast_dtype
from supernet.unroll import LossConfig, loss_negatives, subnet_losses

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    target: str
    data: str
    out: str
    space: str | None = None  # search space (YAML or name); None: the target's default (tiny for tiny-* targets)
    scale: str = "demo"
    steps: int = 160
    seqs_per_step: int = 1
    lr: float = 1e-3
    warmup: int = 16
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    unroll: int = 3
    unroll_decay: float = 0.7  # loss weight of unroll step s = unroll_decay**s
    feat_weight: float = 0.2  # smooth-L1 regression of the target's final feature, beside the token loss
    n_random: int = 2
    ckpt_every: int = 20
    reorder_at: int = 40  # importance reordering of heads/channels once, after this many steps (0 = never)
    val_sequences: int = 4
    max_positions: int = 0  # scored positions per sequence and unroll step (0 = all)
    answer_only: bool = True  # score only positions that predict answer tokens (what drafts propose at run time)
    loss: str = "topk"  # topk: distil over the target's stored top-k + `negatives` frequent tokens | full: whole vocab
    negatives: int = 1024  # topk loss: the most frequent answer tokens every position also scores (0 = none)
    full_positions: int = 32  # topk loss: positions per sequence and unroll step also scored over the whole vocabulary
    feat_noise: float = 0.0  # U(-a, a) x feature RMS added to the target features the draft reads (LossConfig)
    init_from_target: bool = False  # draft layers start as the target's last decoder layer (decode/drafts/from_target.py)
    init_fusion: bool = False  # with init_from_target: identity feat_fc and in_fc = [I, I]
    schedule: str = "sandwich"  # sandwich from step 0 | progressive: largest, then elastic depth, then everything
    # the space's EAGLE-like default (decode.space.SearchSpace.eagle_like) as a sandwich role: off | extra (a fourth
    # pass every step) | alternate (in place of the first random subnet on every other step). In the compact space it
    # is neither the largest nor the smallest, so without it the reference every result is compared with trains only
    # through the weights it shares with the others
    eagle_role: str = "off"
    threads: int = 0  # torch intra-op threads (0 = torch's default)
    autocast: str = "auto"  # bf16 autocast: auto (where the GPU/CPU multiplies bf16 natively) | bf16 | off
    time_budget_s: float = 0.0  # > 0: stop after this much training wall-clock (the LR schedule follows time)
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    cache_dir: str | None = None  # where the target is prepared and loaded from (None: the default cache)
    resume: bool = False

    def __post_init__(self) -> None:  # the space is part of the checkpoint's identity: resolve the default now
        if self.space is None:
            object.__setattr__(self, "space", default_space_name(self.target))

    def loss_config(self) -> LossConfig:
        return LossConfig(unroll=self.unroll, decay=self.unroll_decay, feat_weight=self.feat_weight,
                          max_positions=self.max_positions, answer_only=self.answer_only, loss=self.loss,
                          full_positions=self.full_positions, feat_noise=self.feat_noise)

    def lr_at(self, step: int, elapsed_s: float = 0.0) -> float:
        """Linear warm-up to lr, then cosine decay to 10% of it; with a time budget the decay follows
        whichever runs out first, steps or time (so runs of equal wall-clock all end their schedule)."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = run_progress((step - self.warmup) / max(1, self.steps - self.warmup), elapsed_s, self.time_budget_s)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


EAGLE_ROLES = ("off", "extra", "alternate")


def run_progress(step_fraction: float, elapsed_s: float, time_budget_s: float) -> float:
    """How far a run is through its schedule: its share of the steps or, with a time budget (> 0), of the time when
    that runs out first (schedules then end with the run, whichever stops it)."""
    return max(step_fraction, elapsed_s / time_budget_s) if time_budget_s > 0 else step_fraction


# TrainConfig fields that say where and how long a run trains, not what it learns: a cached checkpoint that
# differs from a scale only in these is the same recipe (steps: a longer scale resumes it)
RUN_FIELDS = frozenset({"target", "data", "out", "space", "scale", "steps", "ckpt_every", "val_sequences", "threads",
                        "time_budget_s", "device", "dtype", "cache_dir", "resume", "autocast"})


def recipe_changes(saved: dict, cfg: TrainConfig) -> list[str]:
    """The recipe fields (loss, schedule, learning rate, ...) in which a checkpoint's saved config differs from
    `cfg`, as 'name old -> new'. A field the saved config lacks was added later: the run used its default."""
    out = []
    for f in fields(TrainConfig):
        if f.name in RUN_FIELDS:
            continue
        old, new = saved.get(f.name, f.default), getattr(cfg, f.name)
        if old != new:
            out.append(f"{f.name} {old!r} -> {new!r}")
    return out


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with betas (0.9, 0.95), one fused kernel per tensor: torch's CPU default (a loop of small ops
    per tensor) took 32 ms per step against 10 ms fused for the demo supernet's 22.4M weights on 2 cores."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), fused=True)


def scale_defaults(scale: str, section: str) -> dict:
    file = config_dir("scale") / f"{scale}.yaml"
    if not file.is_file():
        known = ", ".join(sorted(p.stem for p in config_dir("scale").glob("*.yaml")))
        raise UserError(f"unknown scale '{scale}'; use one of: {known}")
    return dict((yaml.safe_load(file.read_text()) or {}).get(section, {}))


def scale_space(scale: str, target: str) -> str:
    """The search space a scale trains when none is named: tiny for the tiny-* test targets, else the scale's
    top-level `space` (configs/scale/<scale>.yaml: the demo's is compact, sized for its few hundred steps),
    else default."""
    name = default_space_name(target)
    if name != "default":
        return name
    scale_defaults(scale, "train")  # an unknown scale is a one-line error
    raw = yaml.safe_load((config_dir("scale") / f"{scale}.yaml").read_text()) or {}
    return str(raw.get("space") or name)


def sandwich(model: DraftSupernet, step: int, cfg: TrainConfig, elapsed_s: float = 0.0):
    """(role, arch) pairs for this step: largest, smallest, then random ones seeded by (seed, step).

    schedule progressive (once-for-all's progressive shrinking): the first third of the run trains
    the largest subnet alone; the second third adds random subnets of elastic depth at the largest
    widths; the last third is the full sandwich. The run's progress is its share of the steps, or of
    the time budget when that runs out first (as for the LR schedule)."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    space, e = model.space, model.entropy_layer
    largest = space.largest(e)
    progress = run_progress(step / cfg.steps, elapsed_s, cfg.time_budget_s)
    if cfg.schedule == "progressive" and progress < 1 / 3:
        return [("largest", largest)]
    if cfg.schedule == "progressive" and progress < 2 / 3:
        out = [("largest", largest)]
        for i in range(cfg.n_random + 1):
            arch = space.sample(rng, e)
            out.append((f"depth{i}", replace(arch, heads=largest.heads[: arch.depth], ffn=largest.ffn[: arch.depth])))
        return out
    pairs = [("largest", largest), ("smallest", space.smallest(e))]
    randoms = [(f"random{i}", space.sample(rng, e)) for i in range(cfg.n_random)]  # drawn alike in every mode
    if cfg.eagle_role not in EAGLE_ROLES:
        raise ValueError(f"eagle_role must be one of {EAGLE_ROLES}, got {cfg.eagle_role!r}")
    if cfg.eagle_role == "extra":
        return pairs + randoms + [("eagle", space.eagle_like(e))]
    if cfg.eagle_role == "alternate" and step % 2 == 1:  # in place of the first random subnet
        return pairs + randoms[1:] + [("eagle", space.eagle_like(e))]
    return pairs + randoms


def distinct_roles(roles: list[tuple[str, DraftArch]]) -> list[tuple[str, DraftArch, int]]:
    """The sandwich's (role, arch) pairs with repeated networks merged: (first role, arch, how many roles drew it).

    A space of one network (space eagle: largest = smallest = every sample, up to the tree shape, which
    training never sees) or a random draw equal to the largest would otherwise run the same forward and
    backward several times per step; one pass weighted by the count gives the same gradient (the loss is
    linear in the pass count) at a fraction of the time (3x fewer passes for a network trained alone)."""
    out: dict[str, list] = {}
    for role, arch in roles:
        key = arch.with_tree(roles[0][1].tree).to_json()  # archs that differ only in their tree are one network
        if key in out:
            out[key][2] += 1
        else:
            out[key] = [role, arch, 1]
    return [tuple(v) for v in out.values()]


def sequence_ids(step: int, cfg: TrainConfig, n_train: int, rank: int, world: int) -> list[int]:
    """This rank's training sequences at `step`: a fresh seeded permutation every epoch."""
    out = []
    for b in range(cfg.seqs_per_step):
        i = (step * world + rank) * cfg.seqs_per_step + b
        epoch, k = divmod(i, n_train)
        perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(cfg.seed + 7919 * epoch))
        out.append(int(perm[k]))
    return out


@torch.no_grad()
def evaluate(model: DraftSupernet, data: FeatureData, ids: list[int], loss_cfg: LossConfig) -> dict[str, dict]:
    out = {}
    for role, arch in (("largest", model.space.largest(model.entropy_layer)),
                       ("smallest", model.space.smallest(model.entropy_layer))):
        model.set_active(arch)
        clean = replace(loss_cfg, max_positions=0, loss="full", feat_noise=0.0)  # validation: every position, no noise
        stats = [subnet_losses(model, data[i], clean)[1] for i in ids]
        keys = {k for s in stats for k in s}
        # sequences without scored positions lack the per-step figures: average over those that have them
        out[role] = {k: sum(s[k] for s in stats if k in s) / max(1, sum(k in s for s in stats)) for k in sorted(keys)}
    return out


def train(cfg: TrainConfig) -> Path:
    out = writable_dir(cfg.out)  # before the target loads and minutes of training
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target = load_target(cfg.target, device=cfg.device, dtype=cfg.dtype,
                         cache_dir=Path(cfg.cache_dir) if cfg.cache_dir else None)
    d = init_distributed(target.device.type)
    torch.manual_seed(cfg.seed)
    data = FeatureData(cfg.data, target)
    space = SearchSpace.load(cfg.space)
    ck_dir = out / "checkpoint"
    if cfg.resume:
        state = ckpt.read_state(ck_dir)
        if weights_part(state["space"]) != space.weights_dict():  # other tree choices alone train the same weights
            raise UserError(f"checkpoint in '{ck_dir}' was trained on another search space; pass the same --space")
        if check_fingerprint(state["target"], target.fingerprint().to_dict(), f"checkpoint in '{ck_dir}'"):
            raise UserError(f"checkpoint in '{ck_dir}' belongs to target '{state.get('target_name')}', not '{target.name}'")
    reduced = [v for v in space.draft_vocab if v is not None]
    hot = data.hot_tokens(max(reduced)) if reduced else None
    model = DraftSupernet(space, TargetDims.of(target), data.entropy_layer, hot).attach(target, init_head=True)
    if cfg.init_from_target and not cfg.resume:
        src = init_from_target(model, target, feature_layers=(-1,), fusion=cfg.init_fusion)
        model.reorder_by_importance()  # narrower subnets start from the target layer's most important heads/channels
        logger.info("draft layers start from target decoder layer %d", src)
    model.float().train()  # fp32 master weights (the forward may autocast to bf16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(params, cfg.lr, cfg.weight_decay)
    start = 0
    if cfg.resume:
        ckpt.load_weights(ck_dir, model)
        ckpt.load_optimizer(ck_dir, model, opt)
        start = int(state["step"])
        logger.info("resumed from %s at step %d", ck_dir, start)
    n_val = min(cfg.val_sequences, max(0, len(data) - 1))
    val_ids = list(range(len(data) - n_val, len(data)))
    loss_cfg = cfg.loss_config()
    # no wasted steps: sequences without a scored position (the prompt fills max_len) are never drawn
    scored = data.scored_positions(cfg.answer_only)
    train_ids = [i for i in range(len(data) - n_val) if scored[i] > 0]
    if not train_ids:
        raise UserError(f"no training sequence in {cfg.data} has a scored answer position; rebuild the data with a "
                        "larger --max-len or --min-answer")
    if len(train_ids) < len(data) - n_val:
        logger.info("%d of %d training sequences have no answer position within max_len; they are skipped",
                    len(data) - n_val - len(train_ids), len(data) - n_val)
    n_train = len(train_ids)
    negatives = loss_negatives(data, cfg.negatives if cfg.loss == "topk" else 0, target.device)
    out.mkdir(parents=True, exist_ok=True)
    log_file = out / "train_log.csv"
    fields_ = ["step", "role", "lr", "loss", "kl0", "acc0", "positions", "arch", "elapsed_s"]
    if d.main and (start == 0 or not log_file.exists()):
        with log_file.open("w", newline="") as f:
            csv.writer(f).writerow(fields_)
    elif d.main:  # a resumed run redoes the steps after its checkpoint: drop their rows (a killed run logged them)
        with log_file.open(newline="") as f:
            kept = [r for r in csv.reader(f)]
        with log_file.open("w", newline="") as f:
            csv.writer(f).writerows([kept[0]] + [r for r in kept[1:] if r and int(r[0]) < start])
    amp = autocast_dtype(cfg.autocast, target.device)  # None: fp32
    logger.info("training computes in %s", "bf16 autocast" if amp is not None else "fp32")
    # the clock of a time budget (and of the LR schedule that follows it) goes on from the checkpoint's
    t0 = time.perf_counter() - (float(state.get("elapsed_s", 0.0)) if cfg.resume else 0.0)
    bar = tqdm(range(start, cfg.steps), desc="supernet", disable=not d.main, initial=start, total=cfg.steps)
    bad_steps = 0
    for step in bar:
        if cfg.time_budget_s > 0 and time.perf_counter() - t0 >= cfg.time_budget_s:
            logger.info("time budget of %.0f s reached after %d steps", cfg.time_budget_s, step)
            _save(ck_dir, model, opt, step, cfg, space, target, data, d, time.perf_counter() - t0, budget_spent=True)
            break
        lr = cfg.lr_at(step, time.perf_counter() - t0)
        for group in opt.param_groups:
            group["lr"] = lr
        rows = []
        seqs = [train_ids[k] for k in sequence_ids(step, cfg, n_train, d.rank, d.world)]
        roles = sandwich(model, step, cfg, time.perf_counter() - t0)
        for role, arch, count in distinct_roles(roles):
            model.set_active(arch)
            agg: dict[str, float] = {}
            for i in seqs:
                with autocast(target.device, amp):
                    loss, stats = subnet_losses(model, data[i], loss_cfg, seed=step * 100_003 + i, negatives=negatives)
                if loss.requires_grad:  # a sequence with no scored position (all prompt) adds nothing
                    (loss * count / (len(seqs) * len(roles))).backward()
                for k, v in stats.items():
                    agg[k] = agg.get(k, 0.0) + (v if k.startswith("n") else v / len(seqs))
            rows.append([step, role, f"{lr:.3g}", f"{agg.get('loss', 0):.4f}", f"{agg.get('kl0', 0):.4f}",
                         f"{agg.get('acc0', 0):.3f}", int(sum(v for k, v in agg.items() if k[0] == "n" and k[1:].isdigit())),
                         arch.to_json(), f"{time.perf_counter() - t0:.1f}"])
        average_gradients(params, d)
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        if not bool(torch.isfinite(norm)):  # a NaN/inf loss or gradient: skip this step once, then stop
            opt.zero_grad(set_to_none=True)
            bad_steps += 1
            logger.warning("step %d: non-finite loss or gradient; step skipped", step)
            if bad_steps > 1:
                raise UserError(f"training diverged: non-finite loss or gradients at step {step} after a skipped step "
                                f"(checkpoint {ck_dir} holds the last finite weights); lower --lr or check the data")
            continue
        bad_steps = 0
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cfg.reorder_at and step + 1 == cfg.reorder_at:
            model.reorder_by_importance(opt)  # deterministic, so every rank permutes alike
        bar.set_postfix({r[1][:5]: r[4] for r in rows[:2]})
        if d.main:
            with log_file.open("a", newline="") as f:
                csv.writer(f).writerows(rows)
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == cfg.steps:
            _save(ck_dir, model, opt, step + 1, cfg, space, target, data, d, time.perf_counter() - t0)
    if d.main and val_ids:
        evals = evaluate(model, data, val_ids, loss_cfg)
        logger.info("held-out: %s", {r: {k: round(v, 3) for k, v in s.items()} for r, s in evals.items()})
        state = ckpt.read_state(ck_dir)
        state["validation"] = evals
        (ck_dir / ckpt.STATE).write_text(json.dumps(state, indent=2, sort_keys=True))
    barrier(d)
    shutdown(d)
    return ck_dir


def _save(ck_dir, model, opt, step, cfg, space, target, data, d, elapsed_s: float, budget_spent: bool = False) -> None:
    """The checkpoint at `step`; elapsed_s: training wall-clock so far (a resumed run's budget and LR schedule go
    on from it); budget_spent: the run stopped at its time budget, so it is finished short of cfg.steps."""
    if d.main:
        state = {"step": step, "config": asdict(cfg), "space": space.to_dict(), "entropy_layer": data.entropy_layer,
                 "target": target.fingerprint().to_dict(), "target_name": target.name, "dims": asdict(model.dims),
                 "data": str(cfg.data), "format": "vlm-draft-nas/supernet-v1", "elapsed_s": round(elapsed_s, 2),
                 "budget_spent": budget_spent}
        ckpt.save_checkpoint(ck_dir, model, opt, state)
    barrier(d)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m supernet.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--data", required=True, help="feature data directory from supernet.data")
    p.add_argument("--space", default=None, help="search space: a name in configs/space or a YAML file (default: "
                   "tiny for tiny-* targets, else the scale's: compact at demo scale, default otherwise)")
    p.add_argument("--scale", default="demo", help="preset in configs/scale (demo|full); flags below override it")
    p.add_argument("--out", default=None, help="output directory (default: out/supernet-<target>-<scale>)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    for f in fields(TrainConfig):
        if f.name in ("target", "data", "out", "space", "scale", "device", "dtype", "cache_dir", "resume"):
            continue
        if isinstance(f.default, bool):
            p.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=None)
        else:
            p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None)
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    base = scale_defaults(args.scale, "train")
    cfg = TrainConfig(target=args.target, data=args.data, out=args.out or f"out/supernet-{Path(args.target).name}-{args.scale}",
                      space=args.space or scale_space(args.scale, args.target), scale=args.scale, device=args.device,
                      dtype=args.dtype, cache_dir=str(args.cache_dir) if args.cache_dir else None,
                      resume=args.resume)
    known = {f.name for f in fields(TrainConfig)}
    cfg = replace(cfg, **{k: v for k, v in base.items() if k in known})
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None
                 and f.name not in ("target", "data", "out", "space", "scale", "device", "dtype", "cache_dir",
                                    "resume")}
    cfg = replace(cfg, **overrides)
    if cfg.steps < 1 or cfg.seqs_per_step < 1 or cfg.unroll < 1:
        raise UserError("steps, seqs-per-step and unroll must be >= 1")
    if cfg.ckpt_every < 1:
        raise UserError(f"--ckpt-every must be >= 1 (steps between checkpoints), got {cfg.ckpt_every}")
    if not 0 < cfg.lr < float("inf"):
        raise UserError(f"--lr must be a positive number, got {cfg.lr}")
    if cfg.threads < 0:
        raise UserError(f"--threads must be >= 0 (0: torch's default), got {cfg.threads}")
    if cfg.loss not in ("topk", "full"):
        raise UserError(f"--loss must be topk or full, got {cfg.loss!r}")
    if cfg.autocast not in MODES:
        raise UserError(f"--autocast must be one of {', '.join(MODES)}, got {cfg.autocast!r}")
    if cfg.schedule not in ("sandwich", "progressive"):
        raise UserError(f"--schedule must be sandwich or progressive, got {cfg.schedule!r}")
    if cfg.eagle_role not in EAGLE_ROLES:
        raise UserError(f"--eagle-role must be one of {', '.join(EAGLE_ROLES)}, got {cfg.eagle_role!r}")
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    logging.getLogger("supernet").setLevel(logging.INFO)
    path = train(config_from_args(args))
    print(path)
    return 0


if __name__ == "__main__":
    run_cli(main)
