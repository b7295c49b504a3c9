"""ProfileConfig (what the user asked for) and Grids (which points get measured), both written into profiles.

Grids are chosen per device kind so that the default CPU profile of the default target finishes in
minutes on 2 cores, and `quick` profiles of tiny targets in seconds (tests):

    contexts        committed target lengths for prefill, step and verify (and the draft's context)
    verify_tokens   tree sizes N (root included) for verify: powers of two plus every tree size an
                    EAGLE-2 tree of the search space can have (min(total_tokens, most nodes of its
                    depth and top_k) + 1), so the space's own trees are grid points, not interpolations
                    (CPU matmuls are not smooth in N: 2-3 rows can cost more than 4); on a CPU the
                    sizes above 32 are interpolated between powers of two
    widths          tokens a draft forward processes: 1..8 cover the level-0 width (accepted
                    tokens + root), plus every top_k of the space (the later levels)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from decode.arch import max_tree_nodes
from decode.space import SearchSpace, default_space_name
from hwprofile.timing import TimingConfig


@dataclass(frozen=True)
class ProfileConfig:
    hardware: str | None = None  # canonical name; None = this machine
    target: str = "smolvlm-135m"
    dtype: str = "auto"
    device: str = "auto"
    space: str | None = None  # YAML path or name under configs/space (None: tiny for tiny-* targets, else default)
    out: str | None = None  # default profiles/<hardware>-<target>.json
    predict: bool = False
    quick: bool = False
    calibration: str | None = None  # measured local profile used to calibrate a prediction
    threads: int | None = None  # torch intra-op threads on CPU (None: torch's default)
    plot: bool = True
    seed: int = 0
    cache_dir: str | None = None
    runtime: str = "eager"  # the decoding runtime measured (decode/runtime/compiled.py): eager | compiled

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def space_name(self) -> str:
        return self.space if self.space is not None else default_space_name(self.target)


@dataclass(frozen=True)
class Grids:
    contexts: tuple[int, ...]
    verify_tokens: tuple[int, ...]
    widths: tuple[int, ...]
    default_context: int  # context of the overhead probes and the predictor's default
    components: TimingConfig = field(default_factory=TimingConfig)  # draft components, overhead probes
    target: TimingConfig = field(default_factory=lambda: TimingConfig(warmup=1, repeats=7))  # step, verify
    prefill: TimingConfig = field(default_factory=lambda: TimingConfig(warmup=1, repeats=3, trim=0.0))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Grids":
        timing = {k: TimingConfig(**d[k]) for k in ("components", "target", "prefill") if k in d}
        return cls(contexts=tuple(d["contexts"]), verify_tokens=tuple(d["verify_tokens"]), widths=tuple(d["widths"]),
                   default_context=int(d["default_context"]), **timing)


def _powers_of_two(limit: int) -> set[int]:
    return {2**i for i in range(limit.bit_length()) if 2**i <= limit}


def space_tree_sizes(space: SearchSpace) -> set[int]:
    """Every verify size (draft nodes + root) a dynamic tree of the space can have."""
    return {min(t, max_tree_nodes(d, k)) + 1 for t in space.total_tokens for d in space.tree_depth for k in space.top_k}


def default_grids(device_kind: str, space: SearchSpace, quick: bool = False) -> Grids:
    """The measurement grid for a device kind ("cpu" | "cuda") and search space."""
    tree_sizes = space_tree_sizes(space)
    widths = tuple(sorted(set(range(1, 9)) | set(space.top_k)))
    if quick:  # tests on tiny targets: a handful of points, few repeats
        return Grids(contexts=(16, 48), verify_tokens=tuple(sorted({1, 2, 4} | tree_sizes)),
                     widths=tuple(sorted({1, 2} | set(space.top_k))), default_context=32,
                     components=TimingConfig(warmup=1, repeats=3), target=TimingConfig(warmup=1, repeats=3),
                     prefill=TimingConfig(warmup=0, repeats=2, trim=0.0))
    # powers of two up to the first that holds the space's largest tree (64 for the default spaces' 61 tokens)
    limit = 1 << max(3, (max(tree_sizes) - 1).bit_length())
    if device_kind == "cuda":  # verify is launch-bound up to a few hundred tokens, so sizes past the space's largest
        # tree tell the search nothing, and on the compiled runtime each bucket beyond it (128, 256) cost one more
        # CUDA-graph build of the whole target, about 40 s on an H200
        return Grids(contexts=(128, 512, 1024, 2048), verify_tokens=tuple(sorted(_powers_of_two(limit) | tree_sizes)),
                     widths=widths, default_context=512,
                     components=TimingConfig(warmup=5, repeats=20), target=TimingConfig(warmup=3, repeats=15),
                     prefill=TimingConfig(warmup=2, repeats=5))
    # contexts from short chat prompts (64) to long ones; ~2 min on 2 cores for the default target. Verify sizes:
    # every tree size up to 32 (small row counts are where CPU matmuls are not smooth in N), above that powers of
    # two up to the first that holds the space's largest tree (cost is near linear in N there: the measured 37-,
    # 53- and 61-token points were within 5% of the 32-64 line, and they and a 128-token point cost a third of
    # the profile's time)
    verify = _powers_of_two(limit) | {n for n in tree_sizes if n <= 32}
    return Grids(contexts=(64, 256, 512, 1024), verify_tokens=tuple(sorted(verify)),
                 widths=widths, default_context=512, target=TimingConfig(warmup=1, repeats=7))
