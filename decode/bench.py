"""`python -m decode.bench`: vanilla vs drafts, side by side on held-out prompts, in one process.

    python -m decode.bench --target smollm2-135m --drafts prompt-lookup,layerskip:12 --prompts sharegpt:20
    python -m decode.bench --target smolvlm-135m --drafts out/draft-h200,prompt-lookup --prompts sharegpt:20,images:5
    python -m decode.bench --drafts prompt-lookup --runtimes eager,compiled --prompts sharegpt:10,images:3

Per prompt: the prompt is built once, then vanilla decoding and every draft run interleaved
--repeats times (after one untimed warm-up of each method on the first prompt); each (prompt,
method) keeps the median wall time. Summary per method:

    tokens_per_s    total new tokens / total of the per-prompt median wall times (prefill included)
    speedup         tokens_per_s / tokens_per_s of vanilla decoding on the same runtime (`baseline`)
    speedup_vs_eager  tokens_per_s / eager vanilla's tokens_per_s (what a compiled method gains in all)
    decode_speedup  the same ratio after the prefill (tokens after the first / decode wall time): the phase a
                    draft speeds up and the search's predicted speed-up prices (None for transformers' rows)
    median_speedup  median over prompts of (method tokens/s / its baseline's tokens/s) on that prompt
    tau             mean over prompts of tokens emitted per target verify forward (bonus included)
    identical_rate  share of prompts whose greedy output equals eager vanilla's token for token
                    (null when sampling: speculative sampling matches the distribution, not the draws)

Results go to --out (default benchmarks/results/bench-<target>-<device>-<date>.json) with the
config, command line, device, library versions and every per-prompt row.

--runtimes eager,compiled runs vanilla decoding and every draft on each runtime (rows "NAME@compiled"):
compiled = a static KV cache, trees padded to fixed buckets and torch.compile'd target forwards
(decode/runtime/compiled.py), compiled in the untimed warm-up. Every row records its runtime.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from decode.benchio import (
    RESULTS_DIR,
    VANILLA,
    Method,
    check_tree_args,
    default_out_path,
    environment,
    identical,
    make_policy,
    measure,
    merge_hists,
    warm_up,
    write_json,
)
from decode.datasets import PromptItem, data_prompt_ids, parse_prompt_spec
from decode.errors import UserError
from decode.loop.sampling import SamplingConfig
from decode.loop.vanilla import check_max_new_tokens
from decode.paths import writable_dir, writable_file
from decode.runtime import small_rows
from decode.runtime.compiled import check_runtime

logger = logging.getLogger("decode.bench")  # not __main__ under python -m


@dataclass(frozen=True)
class BenchConfig:
    target: str = "smolvlm-135m"
    drafts: tuple[str, ...] = ("prompt-lookup",)
    prompts: str = "sharegpt:20,images:5"
    split: str = "heldout"
    exclude_data: tuple[str, ...] = ()  # supernet.data folders whose prompts are passed over (a search's held-out set)
    max_new_tokens: int = 128
    runtimes: tuple[str, ...] = ("eager",)  # our loop's runtimes: each gets its vanilla row and every draft
    repeats: int = 3
    warmup: bool = True
    tree: str | None = None  # dynamic | chain | static:B1,B2,.. (None: dynamic)
    tree_depth: int | None = None  # overrides of each draft's default TreeSpec
    top_k: int | None = None
    total_tokens: int | None = None
    candidates: str = "topk"
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = 0  # fixed, so every repeat of a sampled method draws the same text
    device: str = "auto"
    dtype: str = "auto"
    cache_dir: str | None = None
    out: str | None = None

    @property
    def tree_overrides(self) -> dict[str, int | None]:
        return {"tree_depth": self.tree_depth, "top_k": self.top_k, "total_tokens": self.total_tokens}

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, seed=self.seed)

    def check(self) -> None:
        """UserError for anything wrong that can be seen before loading a model."""
        if not self.drafts or any(not d.strip() for d in self.drafts):
            raise UserError(f"--drafts needs a comma-separated list of draft specs, got {','.join(self.drafts)!r}")
        if len(set(self.drafts)) != len(self.drafts):
            raise UserError(f"--drafts lists a draft twice: {','.join(self.drafts)}")
        if self.repeats < 1:
            raise UserError(f"--repeats must be at least 1, got {self.repeats}")
        check_max_new_tokens(self.max_new_tokens)
        if not self.runtimes or len(set(self.runtimes)) != len(self.runtimes):
            raise UserError(f"--runtimes needs distinct runtimes (eager, compiled), got {','.join(self.runtimes)!r}")
        for r in self.runtimes:
            check_runtime(r)
        check_tree_args(self.tree, self.tree_overrides, self.candidates)
        self.sampling  # validates temperature / top-p


def _methods(config: BenchConfig, target) -> list[Method]:
    from decode.drafts import make_draft
    from decode.hf_generate import is_hf_spec

    # eager vanilla always runs: every row's identity is checked against it and "speedup_vs_eager" is taken from it
    runtimes = ("eager",) + tuple(r for r in config.runtimes if r != "eager")
    methods = [Method.vanilla(r) for r in runtimes]
    drafts: list[tuple[str, object]] = []
    for spec in config.drafts:
        if is_hf_spec(spec):
            methods.append(Method.transformers(spec))
            continue
        draft = make_draft(spec, target, seed=config.seed or 0)
        taken = {n for n, _ in drafts}
        # a spec (prompt-lookup, prompt-lookup:2:2, layerskip:12) and a checkpoint folder name their rows as given:
        # a folder by its path (named by its draft, "draft:prompt-lookup", an exported lookup design's row read like
        # the prompt-lookup baseline beside it)
        name = spec
        if name in taken:  # the same spec twice: numbered by its place among the rows
            name = f"{spec}#{1 + len(drafts) + sum(m.hf is not None for m in methods)}"
        drafts.append((name, draft))
    for runtime in config.runtimes:
        for name, draft in drafts:
            policy = make_policy(draft, config.tree, config.tree_overrides, config.candidates)
            methods.append(Method(name if runtime == "eager" else f"{name}@{runtime}", draft, policy, runtime=runtime))
    return methods


def _usable_prompts(items: list[PromptItem], is_vlm: bool, target_name: str) -> tuple[list[PromptItem], int]:
    if is_vlm:
        return items, 0
    kept = [p for p in items if p.image is None]
    skipped = len(items) - len(kept)
    if skipped:
        logger.warning("target %s is text-only: skipping %d image prompt(s)", target_name, skipped)
    return kept, skipped


def run_bench(config: BenchConfig, prompts: list[PromptItem] | None = None,
              on_prompt: Callable[[dict], None] | None = None) -> dict:
    """Benchmark every method of `config` on `prompts` (default: config.prompts, held-out split) -> results dict.

    on_prompt(partial result) is called after each prompt (main writes it to --out), so a bench that is
    stopped (a time limit on a lent GPU, Ctrl-C) keeps every finished prompt; "complete" says which it is.
    """
    from tqdm import tqdm

    from decode.targets.loader import load_target

    config.check()
    sampling = config.sampling
    exclude = frozenset().union(*(data_prompt_ids(d) for d in config.exclude_data))  # bad folders fail first
    target = load_target(config.target, device=config.device, dtype=config.dtype,
                         cache_dir=Path(config.cache_dir) if config.cache_dir else None)
    items = prompts if prompts is not None else parse_prompt_spec(
        config.prompts, split=config.split, cache_dir=Path(config.cache_dir) if config.cache_dir else None,
        exclude=exclude)
    items, skipped = _usable_prompts(list(items), target.is_vlm, target.name)
    if not items:
        raise UserError(f"no prompts to run (spec '{config.prompts}', {skipped} image prompts skipped on a "
                        f"text-only target); ask for sharegpt:N")
    methods = _methods(config, target)
    built = [(item, target.build_prompt(item.text, item.image, item.history)) for item in items]
    env = environment(target.device)
    logger.info("bench: %s on %s, %d prompts x %d methods x %d repeats", target.name, env["device"], len(built),
                len(methods), config.repeats)
    if config.warmup:
        # on the longest prompt: the compiled runtime sizes its static cache there, so that no later prompt grows
        # it (new tensors recompile every graph: measured, 25-60 s stalls inside timed runs)
        warm_up(target, max((p for _, p in built), key=lambda p: p.length), methods, config.max_new_tokens, sampling)
    rows: list[dict] = []

    def result(done: int) -> dict:
        return {
            "config": asdict(config),
            **env,
            "target": {"name": target.name, "dtype": str(target.dtype).replace("torch.", ""),
                       "fingerprint": target.fingerprint().to_dict()},
            "prompts": {"spec": config.prompts if prompts is None else "(given)", "split": config.split,
                        "count": done, "planned": len(built), "skipped_image_prompts": skipped,
                        "excluded": sorted(exclude) if prompts is None else [],
                        "ids": [i.id for i, _ in built[:done]]},
            "complete": done == len(built),
            "methods": [m.describe() for m in methods],
            "summary": summarize(rows, [m.name for m in methods], sampling.greedy, {m.name: m.baseline for m in methods}),
            "small_rows": {"mode": small_rows.MODE, "choices": small_rows.choices(),  # which linear kernels ran
                           "table": small_rows.table_file()},
            "per_prompt": rows,
        }

    with tqdm(total=len(built) * len(methods) * config.repeats, desc="bench", unit="run", disable=None) as bar:
        for done, (item, prompt) in enumerate(built, start=1):
            bar.set_postfix_str(item.id[:24])
            runs = measure(target, prompt, methods, config.max_new_tokens, sampling, config.repeats, bar)
            van = runs[VANILLA]
            for m in methods:
                if m.name not in runs:  # a method that cannot take this prompt (Method.supports)
                    continue
                meas, base = runs[m.name], runs[m.baseline]
                row = {"prompt_id": item.id, "prompt_tokens": prompt.length, "has_image": prompt.has_image,
                       **meas.to_row(), "runtime": m.describe()["runtime"], "baseline": m.baseline}
                # against vanilla on the same runtime, and against eager vanilla (what compiling alone gives)
                row["speedup"] = meas.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else None
                row["speedup_vs_eager"] = meas.tokens_per_s / van.tokens_per_s if van.tokens_per_s > 0 else None
                row["identical"] = None if m.name == VANILLA else identical(meas.first, van.first, sampling)
                rows.append(row)
            if on_prompt is not None and done < len(built):
                on_prompt(result(done))
    return result(len(built))


def summarize(rows: list[dict], methods: list[str], greedy: bool, baselines: dict[str, str] | None = None) -> list[dict]:
    """One row per method (definitions in the module docstring); baselines: {method: its vanilla row} (default:
    eager vanilla for all)."""
    baselines = baselines or {}
    def total_rate(method: str, prompts: set[str] | None = None) -> float:
        rs = [r for r in rows if r["method"] == method and (prompts is None or r["prompt_id"] in prompts)]
        wall = sum(r["wall_ms"] for r in rs) / 1e3
        return sum(r["new_tokens"] for r in rs) / wall if wall > 0 else 0.0

    def decode_rate(method: str, prompts: set[str]) -> float | None:
        # tokens after the first (the prefill emits it) per second of decoding, over the prompts it ran
        rs = [r for r in rows if r["method"] == method and r["prompt_id"] in prompts]
        if not rs or any(r.get("decode_ms") is None for r in rs):
            return None
        wall = sum(r["decode_ms"] for r in rs) / 1e3
        return sum(r["new_tokens"] - 1 for r in rs) / wall if wall > 0 else None

    out = []
    for method in methods:
        rs = [r for r in rows if r["method"] == method]
        speedups = [r["speedup"] for r in rs if r["speedup"] is not None]
        rate = total_rate(method)
        ran = {r["prompt_id"] for r in rs}
        base = total_rate(baselines.get(method, VANILLA), ran)  # its vanilla, on the prompts this method ran
        eager = total_rate(VANILLA, ran)
        dec, dec_base = decode_rate(method, ran), decode_rate(baselines.get(method, VANILLA), ran)
        row = {
            "method": method,
            "runtime": rs[0].get("runtime", "eager") if rs else None,
            "baseline": baselines.get(method, VANILLA),
            "prompts": len(rs),
            "tau": statistics.fmean(taus) if (taus := [r["tau"] for r in rs if r["tau"] is not None]) else None,
            "tokens_per_s": rate,
            "speedup": rate / base if base > 0 else None,
            "speedup_vs_eager": rate / eager if eager > 0 else None,
            "decode_speedup": dec / dec_base if dec and dec_base else None,
            "median_speedup": statistics.median(speedups) if speedups else None,
            "identical_rate": (statistics.fmean(bool(r["identical"]) for r in rs)
                               if greedy and method != VANILLA else None),
            "new_tokens": sum(r["new_tokens"] for r in rs),
            "wall_s": sum(r["wall_ms"] for r in rs) / 1e3,
        }
        if method != VANILLA and all("draft_ms" in r for r in rs):
            row.update(draft_ms=statistics.fmean(r["draft_ms"] for r in rs),
                       verify_ms=statistics.fmean(r["verify_ms"] for r in rs),
                       accept_hist=merge_hists([r["accept_hist"] for r in rs]))
        out.append(row)
    return out


def format_table(summary: list[dict]) -> str:
    """The summary as a fixed-width pandas table (draft/verify: mean ms per generation)."""
    import pandas as pd

    cols = {"method": "method", "tau": "tau", "tokens_per_s": "tokens/s", "speedup": "speedup",
            "speedup_vs_eager": "vs eager vanilla", "decode_speedup": "decode-only",
            "median_speedup": "median speedup", "identical_rate": "identical", "draft_ms": "draft ms",
            "verify_ms": "verify ms", "new_tokens": "tokens"}
    df = pd.DataFrame(summary).reindex(columns=list(cols)).rename(columns=cols)
    fmt = {"tau": "{:.2f}", "tokens/s": "{:.1f}", "speedup": "{:.2f}x", "vs eager vanilla": "{:.2f}x",
           "decode-only": "{:.2f}x", "median speedup": "{:.2f}x",
           "identical": "{:.0%}", "draft ms": "{:.0f}", "verify ms": "{:.0f}", "tokens": "{:.0f}"}
    for col, f in fmt.items():
        df[col] = [("-" if v is None or v != v else f.format(v)) for v in df[col]]
    return df.to_string(index=False)


def build_parser() -> argparse.ArgumentParser:
    from decode.cli import add_target_args
    from decode.run import add_sampling_args, add_tree_args

    p = argparse.ArgumentParser(prog="python -m decode.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--drafts", required=True, help="comma-separated methods: DIR | DIR+lookup | prompt-lookup | "
                                                   "layerskip:K | random:FUSION | hf-generate | hf-compiled | "
                                                   "hf-lookup:N[:M] (transformers' generate: plain, with a static "
                                                   "cache and torch.compile, or with prompt lookup)")
    p.add_argument("--prompts", default=BenchConfig.prompts,
                   help="prompt spec: sharegpt:N (first messages), images:N (photo questions), chat:N (later "
                        f"messages after the exchange before them) (default: {BenchConfig.prompts})")
    p.add_argument("--exclude-data", default=None, metavar="DIR[,DIR]",
                   help="pass over the prompts these supernet.data folders were built from, e.g. a search's held-out "
                        "data (<cache>/runs/<target>-<scale>/heldout): a bench on prompts the search never saw")
    p.add_argument("--runtimes", default="eager", metavar="eager[,compiled]",
                   help="runtimes of our decoding loop; each runs vanilla and every draft, speed-ups are taken "
                        "against vanilla on the same runtime (and against eager vanilla) (default: eager)")
    p.add_argument("--max-new-tokens", type=int, default=BenchConfig.max_new_tokens,
                   help=f"default: {BenchConfig.max_new_tokens}")
    p.add_argument("--repeats", type=int, default=BenchConfig.repeats,
                   help=f"timed runs per prompt and method (default: {BenchConfig.repeats})")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generations")
    add_sampling_args(p)
    p.set_defaults(seed=BenchConfig.seed)
    add_tree_args(p)
    p.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/bench-<target>-<device>-<date>.json)")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    return p


def main(argv: list[str] | None = None) -> int:
    from decode.cli import setup_logging

    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    logger.setLevel(logging.INFO)  # the skipped-prompt warning and the bench line
    config = BenchConfig(
        target=args.target, drafts=tuple(d.strip() for d in args.drafts.split(",")), prompts=args.prompts,
        exclude_data=tuple(d.strip() for d in args.exclude_data.split(",")) if args.exclude_data else (),
        max_new_tokens=args.max_new_tokens, runtimes=tuple(r.strip() for r in args.runtimes.split(",")),
        repeats=args.repeats, warmup=not args.no_warmup, tree=args.tree,
        tree_depth=args.tree_depth, top_k=args.top_k, total_tokens=args.total_tokens, candidates=args.candidates,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, device=args.device, dtype=args.dtype,
        cache_dir=str(args.cache_dir) if args.cache_dir else None, out=args.out,
    )
    paths: list[Path] = []
    if config.out:  # checked before the target loads and the prompts run
        writable_file(config.out)
    else:
        writable_dir(RESULTS_DIR)

    def save(partial: dict) -> Path:  # the same file after every prompt, then the final result
        if not paths:
            paths.append(Path(config.out) if config.out else default_out_path(config.target, partial))
        return write_json(paths[0], partial)

    result = run_bench(config, on_prompt=save)
    path = save(result)
    print(f"{result['target']['name']} on {result['device']} ({result['prompts']['count']} prompts, "
          f"{config.max_new_tokens} max new tokens, median of {config.repeats}, "
          f"{'greedy' if config.sampling.greedy else f'T={config.temperature}'})")
    print(format_table(result["summary"]))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from decode.cli import run_cli

    run_cli(main)
