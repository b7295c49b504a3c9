"""Side-by-side measurement shared by `decode.run --compare` and `decode.bench`, and the record keeping.

A *method* is vanilla decoding or one draft with its tree policy. `measure` runs every method on one
prompt `repeats` times, interleaved (the order rotates each repeat so no method always runs right
after another), and keeps each run; `Measurement` reduces the runs to medians. Machines here are
shared and noisy, so only ratios measured this way, in one process, mean much (DESIGN.md section 7).

Timing is what the generate functions report: prefill + decode wall time, synchronised on CUDA.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import re
import shlex
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from decode.arch import TreeSpec
from decode.drafts.base import Draft
from decode.errors import UserError
from decode.loop.sampling import SamplingConfig
from decode.loop.speculative import SpecResult, speculative_generate
from decode.loop.tree import TreePolicy
from decode.loop.vanilla import GenerationResult, vanilla_generate
from decode.prompt import Prompt
from decode.runtime import small_rows
from decode.targets.target import TargetModel

if TYPE_CHECKING:
    from decode.hf_generate import HFSpec

logger = logging.getLogger(__name__)

VANILLA = "vanilla"
TREE_FIELDS = ("tree_depth", "top_k", "total_tokens")


def make_policy(draft: Draft, tree: str | None, overrides: dict[str, int | None], candidates: str = "topk") -> TreePolicy:
    """The draft's default TreeSpec with the given fields replaced, shaped by `tree` (dynamic|chain|static:..)."""
    spec = replace(draft.default_tree, **{k: v for k, v in overrides.items() if v is not None})
    return TreePolicy.parse(tree, spec, candidates)


def check_tree_args(tree: str | None, overrides: dict[str, int | None], candidates: str) -> None:
    """Validate tree settings before any model is loaded (UserError with the flag's name)."""
    from decode.errors import UserError

    for name, value in overrides.items():
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value}")
    TreePolicy.parse(tree, replace(TreeSpec(), **{k: v for k, v in overrides.items() if v is not None}), candidates)


def policy_dict(policy: TreePolicy) -> dict:
    d = {"kind": policy.kind, "candidates": policy.candidates, **{k: getattr(policy.spec, k) for k in TREE_FIELDS}}
    if policy.kind == "static":
        d["branching"] = list(policy.branching)
    return d


def vanilla_name(runtime: str) -> str:
    """Vanilla decoding's row name on a runtime: "vanilla" (eager), "vanilla@compiled"."""
    return VANILLA if runtime == "eager" else f"{VANILLA}@{runtime}"


@dataclass(frozen=True)
class Method:
    """Vanilla decoding (draft None) or speculative decoding with one draft and tree policy."""

    name: str
    draft: Draft | None = None
    policy: TreePolicy | None = None
    hf: "HFSpec | None" = None  # transformers' own generate (decode/hf_generate.py), the peer
    runtime: str = "eager"  # our loop's runtime (decode/runtime/compiled.py); transformers' methods run their own

    @property
    def baseline(self) -> str:
        """The vanilla method this one's speed-up is taken against: vanilla decoding on the same runtime."""
        return vanilla_name(self.runtime) if self.hf is None else VANILLA

    @classmethod
    def transformers(cls, spec: str) -> "Method":
        from decode.hf_generate import HFSpec

        hf = HFSpec.parse(spec)
        return cls(hf.name, hf=hf)

    @classmethod
    def vanilla(cls, runtime: str = "eager") -> "Method":
        return cls(vanilla_name(runtime), runtime=runtime)

    def generate(self, target: TargetModel, prompt: Prompt, max_new_tokens: int,
                 sampling: SamplingConfig) -> GenerationResult:
        if self.hf is not None:
            from decode.hf_generate import hf_generate

            if not sampling.greedy:
                raise UserError(f"{self.name} is compared greedy only; drop --temperature")
            return hf_generate(target, prompt, max_new_tokens, self.hf)
        target.use_runtime(self.runtime)
        if self.draft is None:
            return vanilla_generate(target, prompt, max_new_tokens, sampling)
        return speculative_generate(target, self.draft, prompt, max_new_tokens, sampling, self.policy)

    def supports(self, prompt: Prompt) -> bool:
        """transformers' prompt lookup cannot take image prompts (its assisted loop re-feeds pixel values:
        "Image features and image tokens do not match"); those prompts are skipped for it, and its speed-up
        is taken against vanilla on the prompts it ran."""
        return not (self.hf is not None and self.hf.lookup_tokens and prompt.has_image)

    def describe(self) -> dict:
        if self.hf is not None:
            return {"method": self.name, "draft": None, "tree": None, "hf": vars(self.hf), "runtime": "transformers"}
        if self.draft is None:
            return {"method": self.name, "draft": None, "tree": None, "runtime": self.runtime}
        return {"method": self.name, "draft": self.draft.name, "tree": policy_dict(self.policy), "runtime": self.runtime}


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


@dataclass
class Measurement:
    """One method on one prompt: every run, reduced to medians (tokens and acceptance from the first run)."""

    method: str
    runs: list[GenerationResult] = field(default_factory=list)
    hf: bool = False  # transformers' generate: its forwards (and so tau) are not known

    @property
    def first(self) -> GenerationResult:
        return self.runs[0]

    @property
    def wall_s(self) -> float:
        return _median([r.prefill_s + r.decode_s for r in self.runs])

    @property
    def tokens_per_s(self) -> float:
        return _median([r.tokens_per_s for r in self.runs])

    @property
    def decode_s(self) -> float | None:
        """Median wall time after the prefill; None for transformers' generate (its prefill is not separable)."""
        return None if self.hf else _median([r.decode_s for r in self.runs])

    @property
    def new_tokens(self) -> int:
        return self.first.new_tokens

    @property
    def speculative(self) -> bool:
        return isinstance(self.first, SpecResult)

    @property
    def tau(self) -> float:
        """Tokens per target forward after the prefill: exactly 1 for vanilla decoding, None for HF generate
        (it does not report its forwards)."""
        if self.speculative:
            return self.first.tau
        return None if self.hf else 1.0

    def to_row(self) -> dict:
        """A flat, JSON-ready record (times in ms, medians over the runs)."""
        r, decode_s = self.first, self.decode_s
        row = {
            "method": self.method, "repeats": len(self.runs), "new_tokens": self.new_tokens,
            "wall_ms": self.wall_s * 1e3, "tokens_per_s": self.tokens_per_s, "tau": self.tau,
            "prefill_ms": _median([x.prefill_s for x in self.runs]) * 1e3,
            "decode_ms": None if decode_s is None else decode_s * 1e3,
            "target_forwards": r.target_forwards,
        }
        if self.speculative:
            sizes = r.tree_sizes
            row.update(
                cycles=r.cycles,
                draft_ms=_median([x.draft_s for x in self.runs]) * 1e3,
                verify_ms=_median([x.verify_s for x in self.runs]) * 1e3,
                accept_hist={str(k): v for k, v in sorted(r.accept_hist.items())},
                mean_tree_size=sum(sizes) / len(sizes) if sizes else 0.0,
            )
        return row


def identical(a: GenerationResult, b: GenerationResult, sampling: SamplingConfig) -> bool | None:
    """Token-wise equality, meaningful only for greedy decoding.

    Speculative sampling matches the target's distribution, not vanilla's draws for the same seed
    (the two consume random numbers differently), so for sampling this is None.
    """
    return a.tokens == b.tokens if sampling.greedy else None


def warm_up(target: TargetModel, prompt: Prompt, methods: list[Method], max_new_tokens: int,
            sampling: SamplingConfig) -> None:
    """One untimed generation per method (allocator, kernels, caches); on the compiled runtime also every tree
    bucket the method may meet, so that nothing compiles in a timed run. First the few-row linear kernels of
    the target (every tree size a method's policy allows) and of each draft network (every row count) are
    chosen (decode.runtime.small_rows): chosen lazily, their timing landed inside timed generations (the
    eager neural draft's drafting took 545 ms per prompt against 172 ms once measured, README)."""
    rows = [m.draft.max_nodes(m.policy) for m in methods if m.draft is not None and m.policy is not None]
    rows += [m.hf.lookup_tokens + 1 for m in methods if m.hf is not None]  # transformers' lookup verifies N + 1
    small_rows.measure_rows(target.model, max(rows, default=1))
    for m in methods:
        for net in m.draft.networks() if m.draft is not None else ():
            small_rows.measure_rows(net)
    for m in methods:
        if m.supports(prompt):
            logger.info("warm-up: %s", m.name)
            res = m.generate(target, prompt, max_new_tokens, sampling)
            if m.runtime == "compiled" and m.hf is None:
                sizes = getattr(res, "tree_sizes", None) or [1]
                up_to = max(max(sizes), m.policy.spec.total_tokens + 1 if m.policy is not None else 1)
                target.warm_buckets(up_to, m.draft.feature_layers if m.draft is not None else ())
                if m.draft is not None and m.policy is not None:
                    m.draft.warm(m.policy)  # the draft's compiled level steps (decode/runtime/draft_step.py)


def measure(target: TargetModel, prompt: Prompt, methods: list[Method], max_new_tokens: int,
            sampling: SamplingConfig, repeats: int, progress=None) -> dict[str, Measurement]:
    """Run the methods interleaved `repeats` times; `progress` (a tqdm bar) advances once per run."""
    out = {m.name: Measurement(m.name, hf=m.hf is not None) for m in methods if m.supports(prompt)}
    for rep in range(repeats):
        shift = rep % len(methods)
        for m in methods[shift:] + methods[:shift]:
            if m.name in out:
                out[m.name].runs.append(m.generate(target, prompt, max_new_tokens, sampling))
            if progress is not None:
                progress.update(1)
    for name, meas in out.items():
        if sampling.greedy and any(r.tokens != meas.first.tokens for r in meas.runs[1:]):
            logger.warning("%s: greedy repeats gave different tokens (non-deterministic kernels?)", name)
    return out


def merge_hists(hists: list[dict[str, int]]) -> dict[str, int]:
    total: Counter[int] = Counter()
    for h in hists:
        total.update({int(k): v for k, v in h.items()})
    return {str(k): v for k, v in sorted(total.items())}


# ---------------------------------------------------------------- environment and files

def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model (from /proc/cpuinfo, else platform)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def environment(device: torch.device) -> dict:
    import transformers

    return {
        "device": device_name(device),
        "device_type": device.type,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(),
    }


def command_line(argv: list[str] | None = None) -> str:
    """sys.argv shell-quoted, with `python -m PKG.MOD` for a module run of this project (any package)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(".py") and Path(argv[0]).parent.name in ("decode", "hwprofile", "nas", "supernet"):
        argv[0] = f"python -m {Path(argv[0]).parent.name}.{Path(argv[0]).stem}"
    return " ".join(argv[:1] + [shlex.quote(a) for a in argv[1:]])


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "x"


RESULTS_DIR = Path("benchmarks/results")  # where benchmark JSON goes by default


def default_out_path(target: str, env: dict, root: Path = RESULTS_DIR) -> Path:
    """benchmarks/results/bench-<target>-<device>-<date>.json (device: GPU name or cpu)."""
    dev = "cpu" if env["device_type"] == "cpu" else slug(env["device"]).removeprefix("nvidia-")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return root / f"bench-{slug(Path(target).name)}-{dev}-{stamp}.json"


def write_json(path: Path, obj: dict) -> Path:
    """Write atomically (temp file + rename): a reader, or a bench killed mid-write, never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
