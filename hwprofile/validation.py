"""Validate a measured profile: predicted vs measured cycle latency of real draft cycles.

Per sample: an arch (and tree) drawn from the profile's search space, a random-weight DraftModel of
that arch on the profile's target (NeuralDraft), a real prompt; after warm-up cycles (the first one
feeds the whole prompt to the draft), `cycles` real cycles are timed phase by phase with the decode
code (propose | forward_tree + verify + keep | accept, synchronised between phases like the loop);
all samples are run `passes` times in turn. The measured cycle is the median over all timed
cycles; the prediction is LatencyModel.cycle_ms at the sample's mean acceptance (tau) and context.
Errors are (predicted - measured) / measured. Per phase, the predicted overhead (bookkeeping of
propose and accept together) is counted in propose.
"""

from __future__ import annotations

import logging
import random
import statistics
from dataclasses import asdict, dataclass

import numpy as np
import torch
from tqdm import tqdm

from decode.drafts.model import DraftModel, TargetDims
from decode.drafts.neural import NeuralDraft
from decode.drafts.pack import pack_for_decoding
from decode.errors import UserError
from decode.loop.tree import TreePolicy
from decode.prompt import Prompt
from decode.space import SearchSpace
from decode.targets.target import TargetModel
from hwprofile.cycle import GREEDY, verify_tree
from hwprofile.device import DeviceInfo, local_device
from hwprofile.latency import LatencyModel, tree_tokens
from hwprofile.schema import Profile
from hwprofile.timing import Timer

logger = logging.getLogger(__name__)

FIXED_PROMPTS = (
    "What is the capital of France, and why is it famous?",
    "Write a short poem about the sea at night.",
    "Explain how a hash table works, with an example in Python.",
    "Give me three tips for learning a new language quickly.",
    "Summarise the plot of a detective story in four sentences.",
)


@dataclass(frozen=True)
class ValidateConfig:
    profile: str
    samples: int = 20
    warmup: int = 2  # untimed cycles per sample (the first feeds the whole prompt)
    cycles: int = 5  # timed cycles per sample and pass
    passes: int = 2  # rounds over all samples (each from a fresh prefill)
    prompts: str = "sharegpt"  # sharegpt | images | fixed: where the sample prompts come from
    seed: int = 0
    out: str | None = None
    cache_dir: str | None = None

    def check(self) -> None:
        if min(self.samples, self.cycles, self.warmup, self.passes) < 1:
            raise UserError("--samples, --cycles, --passes and --warmup must be >= 1 (the first cycle feeds the prompt)")
        if self.prompts not in ("sharegpt", "images", "fixed"):
            raise UserError(f"--prompts must be sharegpt, images or fixed, got '{self.prompts}'")

    def to_dict(self) -> dict:
        return asdict(self)


def local_device_for(profile: Profile) -> DeviceInfo:
    """This machine's device of the profile's kind; refuses what cannot be checked by measurement here."""
    if profile.predicted:
        raise UserError(f"profile for '{profile.hardware}' is predicted (roofline), not measured; validate a "
                        "measured profile of this machine (python -m hwprofile.profile without --predict)")
    if profile.device.get("kind") == "cuda" and not torch.cuda.is_available():
        raise UserError(f"profile was measured on a GPU ({profile.device.get('name')}) and this machine has none; "
                        "validate it on the machine that measured it")
    local = local_device("cuda" if profile.device.get("kind") == "cuda" else "cpu")
    check_profile_matches(profile, local)
    return local


def check_profile_matches(profile: Profile, local: DeviceInfo) -> None:
    """Refuse a profile measured on another device."""
    dev = profile.device
    if dev.get("hardware") != local.hardware or dev.get("name") != local.name:
        raise UserError(f"profile was measured on {dev.get('hardware')} ({dev.get('name')}), this machine is "
                        f"{local.hardware} ({local.name}); validate it on the machine that measured it")


def space_of(profile: Profile) -> SearchSpace:
    d = profile.space
    lists = {k: tuple(v) for k, v in d.items() if k not in ("name", "feature_layers")}
    return SearchSpace(name=d.get("name", "profile"), feature_layers=tuple(tuple(s) for s in d["feature_layers"]), **lists)


def sample_prompts(target: TargetModel, kind: str, n: int, cache_dir: str | None) -> list[Prompt]:
    if kind == "fixed":
        return [target.build_prompt(FIXED_PROMPTS[i % len(FIXED_PROMPTS)]) for i in range(n)]
    from decode.datasets import parse_prompt_spec

    if kind == "images" and not target.is_vlm:
        raise UserError(f"target '{target.name}' is text-only; use --prompts sharegpt or fixed")
    items = parse_prompt_spec(f"{kind}:{n}", cache_dir=cache_dir)
    if not items:
        raise UserError(f"no {kind} prompts available; use --prompts fixed")
    return [target.build_prompt(it.text, it.image, it.history) for it in (items[i % len(items)] for i in range(n))]


def _time_phases(timer: Timer, target, draft, state: dict, policy: TreePolicy) -> tuple[float, float, float]:
    """One cycle timed per phase (ms): propose, verify (forward_tree + verify + keep), accept."""
    out: dict = {}

    def propose():
        out["tree"] = draft.propose(state["root"], policy, GREEDY, None)

    def verify_():
        out["v"] = verify_tree(target, out["tree"], draft.feature_layers)

    def accept():
        _, bonus, path_tokens, path_hidden = out["v"]
        draft.accept(path_tokens, path_hidden, bonus)

    t = (timer.time_ms(propose), timer.time_ms(verify_), timer.time_ms(accept))
    state["root"] = out["v"][1]
    state["emitted"] = len(out["v"][0])
    return t


@dataclass
class _Run:
    """What the timed cycles of one sample gave (accumulated over passes)."""

    phases: list[tuple[float, float, float]]
    emitted: list[int]
    contexts: list[int]
    prompt_tokens: int = 0
    image_tokens: int = 0


@torch.no_grad()
def run_sample(target: TargetModel, arch, prompt: Prompt, cfg: ValidateConfig, timer: Timer, seed: int, run: _Run) -> None:
    """Prefill, start a fresh random-weight draft (same seed every pass), warm up, time cfg.cycles cycles."""
    torch.manual_seed(seed)
    draft_model = DraftModel(arch, TargetDims.of(target)).attach(target, init_head=True).eval()
    pack_for_decoding(draft_model)  # as a draft loaded for decoding is
    draft = NeuralDraft(draft_model, name="validate")
    pre = target.prefill(prompt, feature_layers=draft.feature_layers, attention_stats=draft.prefill_stats(prompt))
    state = {"root": int(pre.logits[-1].argmax())}
    draft.start(target, prompt, pre)
    policy = TreePolicy(spec=arch.tree)
    for _ in range(cfg.warmup):
        _time_phases(timer, target, draft, state, policy)
    for _ in range(cfg.cycles):
        run.contexts.append(target.seq_len)
        run.phases.append(_time_phases(timer, target, draft, state, policy))
        run.emitted.append(state["emitted"])
    run.prompt_tokens, run.image_tokens = prompt.length, int(pre.image_positions.numel())


def sample_row(arch, run: _Run, model: LatencyModel) -> dict:
    """Measured (median over the timed cycles) vs predicted (at the sample's mean tau and context)."""
    totals = [sum(p) for p in run.phases]
    tau, ctx = float(np.mean(run.emitted)), float(np.mean(run.contexts))
    parts = model.breakdown(arch, accepted=tau, context=ctx, image_tokens=run.image_tokens)
    measured = statistics.median(totals)
    med = [statistics.median(p[i] for p in run.phases) for i in range(3)]
    predicted = parts["total"]
    return {
        "arch": arch.to_dict(), "tree_tokens": tree_tokens(arch), "prompt_tokens": run.prompt_tokens,
        "image_tokens": run.image_tokens, "context": ctx, "tau": tau, "timed_cycles": len(totals),
        "measured_ms": measured, "measured_iqr_ms": float(np.subtract(*np.percentile(totals, [75, 25]))),
        "measured_propose_ms": med[0], "measured_verify_ms": med[1], "measured_accept_ms": med[2],
        "predicted_ms": predicted,
        "predicted_propose_ms": predicted - parts["verify"] - parts["accept"],
        "predicted_verify_ms": parts["verify"], "predicted_accept_ms": parts["accept"],
        "predicted_parts": {k: round(v, 4) for k, v in parts.items()},
        "error_pct": 100.0 * (predicted - measured) / measured,
    }


def summarize(rows: list[dict]) -> dict:
    errs = np.array([r["error_pct"] for r in rows])
    abs_e = np.abs(errs)
    out = {"mape_pct": float(abs_e.mean()), "median_ape_pct": float(np.median(abs_e)),
           "ape_p25_pct": float(np.percentile(abs_e, 25)), "ape_p75_pct": float(np.percentile(abs_e, 75)),
           "max_ape_pct": float(abs_e.max()), "mean_signed_error_pct": float(errs.mean())}
    for phase in ("propose", "verify", "accept"):  # which part of the cycle the model gets wrong
        m = np.array([r[f"measured_{phase}_ms"] for r in rows])
        p = np.array([r[f"predicted_{phase}_ms"] for r in rows])
        out[f"{phase}_mape_pct"] = float(np.mean(np.abs(p - m) / np.maximum(m, 1e-9)) * 100)
    return out


def validate_profile(profile: Profile, target: TargetModel, cfg: ValidateConfig, progress: bool = True) -> dict:
    """Rows (one per sample) and the summary; the caller checks device and target first.

    The samples are run `passes` times in turn (each pass from a fresh prefill), so that a burst of
    load from other processes spreads over all samples instead of inflating one of them.
    """
    model = LatencyModel(profile)
    space = space_of(profile)
    rng = random.Random(cfg.seed)
    entropy_layer = target.num_layers // 2  # stands in for the entropy-chosen layer (only its count matters)
    archs = [space.sample(rng, entropy_layer=entropy_layer) for _ in range(cfg.samples)]
    prompts = sample_prompts(target, cfg.prompts, cfg.samples, cfg.cache_dir)
    timer = Timer(target.device)
    runs = [_Run([], [], []) for _ in archs]
    with tqdm(total=cfg.samples * cfg.passes, desc="validate", disable=not progress) as bar:
        for _ in range(cfg.passes):
            for i, arch in enumerate(archs):
                run_sample(target, arch, prompts[i], cfg, timer, cfg.seed + i, runs[i])
                bar.update()
    target.cache = None
    rows = [sample_row(arch, run, model) for arch, run in zip(archs, runs)]
    for i, row in enumerate(rows):
        logger.info("sample %d: measured %.2f ms, predicted %.2f ms (%+.1f%%)", i, row["measured_ms"],
                    row["predicted_ms"], row["error_pct"])
    return {"rows": rows, "summary": summarize(rows)}
