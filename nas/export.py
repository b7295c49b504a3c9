"""`python -m nas.export`: one subnet of a trained supernet as a standalone draft checkpoint.

    python -m nas.export --supernet out/supernet-smolvlm-135m-demo/checkpoint --trial 12 \\
        --storage sqlite:///out/nas-cpu-smolvlm-135m/study.db --out out/draft-cpu
    python -m nas.export --supernet CKPT --arch '{"fusion": "concat", ...}' --out DIR --finetune-steps 50
    python -m nas.export --supernet CKPT --trial 12 --storage URL --out DIR --lookup 4:2:1 --merge switch

The draft directory (model.safetensors + draft_config.json) loads with decode.run / decode.bench
(`--draft DIR`) without any supernet code: decode.DraftModel with weights copied out of the
supernet's leading slices (supernet.elastic.DraftSupernet.extract). draft_config.json records the
arch, the target fingerprint (a draft refuses another target), and as metadata the hardware, the
profile, the predicted tau / speed-up, the study and trial it came from, and this export's config.

--finetune-steps K first trains the chosen subnet alone for K sequences (nas/finetune.py) on the
supernet's training data minus the held-out tail; --finetuned DIR takes the weights a search fine-tuned
instead (its OUT/finetune folder, written when the scale fine-tunes the best subnet), so a kinds-table row
marked fine-tuned can be exported and benched beside the design.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from decode.arch import DraftArch
from decode.cli import run_cli, setup_logging
from decode.drafts.model import DraftModel
from decode.errors import UserError
from decode.targets.target import TargetModel
from supernet.elastic import DraftSupernet

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportConfig:
    supernet: str
    out: str
    arch: str | None = None  # JSON text or a JSON file (an arch dict, or a draft_config.json with "arch")
    trial: int | None = None
    study_name: str | None = None
    storage: str | None = None
    finetune_steps: int = 0
    finetune_lr: float = 3e-4
    heldout: int | None = None  # training sequences kept out of fine-tuning (None: the study's / checkpoint's)
    data: str | None = None  # fine-tuning data (None: the supernet's training data)
    target: str | None = None  # None: the supernet's target
    device: str = "auto"
    dtype: str = "auto"
    cache_dir: str | None = None
    lookup: str | None = None  # "D:M:K[:W[:C]]": merge prompt lookup into the draft (kind neural+lookup)
    corpus: str | None = None  # the corpus file a lookup with a corpus branch (C > 0) carries
    merge: str = "union"  # union | switch (decode/drafts/merged.py)
    finetuned: str | None = None  # a search's fine-tuning checkpoint (its OUT/finetune): the arch's weights from there


def lookup_extra(text: str | None, merge: str) -> dict:
    """--lookup D:M:K[:W[:C[:S[:L:N]]]] / --merge -> the draft_config keys of kind neural+lookup (no --lookup: kind
    neural)."""
    from decode.drafts.merged import RULES
    from decode.drafts.prompt_lookup import LookupSpec

    if text is None:
        return {"kind": "neural"}
    if merge not in RULES:
        raise UserError(f"--merge must be one of {', '.join(RULES)}, got {merge!r}")
    try:
        vals = [int(v) for v in text.split(":")]
        if len(vals) not in (3, 4, 5, 6, 8):
            raise ValueError(text)
        d, m, k, w, c, b, leaf, leaves = (*vals, 0, 0, 0, 0, 0)[:8]
        spec = LookupSpec(max_ngram=m, tree_depth=d, top_k=k, total_tokens=d * k, weak_depth=w, corpus_depth=c,
                          corpus_second=b, leaf_depth=leaf, leaf_count=leaves)
    except (ValueError, UserError):
        raise UserError(f"--lookup must be D:M:K[:W[:C[:S[:L:N]]]] (branch length, max n-gram, branches, integers "
                        f">= 1; W: branch length after a match shorter than M, 0 <= W <= D; C: corpus branch length, "
                        f"needs --corpus; S: second corpus branch length, 0 <= S <= C; L:N: corpus chains of L tokens "
                        f"under the neural tree's N best leaves, needs --corpus), got {text!r}") from None
    return {"kind": "neural+lookup", "lookup": asdict(spec), "merge": merge}


def parse_arch(text: str) -> DraftArch:
    """DraftArch from JSON text or a JSON file path."""
    p = Path(text)
    raw = p.read_text() if not text.lstrip().startswith("{") and p.is_file() else text
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as err:
        raise UserError(f"--arch is neither a JSON object nor a JSON file ({err.msg}); give e.g. "
                        "'{\"fusion\": \"concat\", \"depth\": 1, ...}'") from None
    if not isinstance(d, dict):
        raise UserError("--arch must be a JSON object")
    return DraftArch.from_dict(d.get("arch", d) if isinstance(d.get("arch"), dict) else d)


def trial_record(storage_url: str, study_name: str | None, number: int) -> tuple[DraftArch, dict]:
    """The arch of a finished trial and its metadata (prediction + the study's setup)."""
    import optuna

    from nas.study import SETUP_ATTR, open_storage

    storage = open_storage(storage_url)
    names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
    if study_name is None:
        if len(names) != 1:
            raise UserError(f"storage {storage_url} holds {len(names)} studies ({', '.join(names) or 'none'}); "
                            "pass --study-name")
        study_name = names[0]
    if study_name not in names:
        raise UserError(f"no study '{study_name}' in {storage_url}; studies there: {', '.join(names) or 'none'}")
    study = optuna.load_study(study_name=study_name, storage=storage)
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    t = trials.get(number)
    if t is None or t.state != optuna.trial.TrialState.COMPLETE or "arch" not in t.user_attrs:
        done = sorted(n for n, x in trials.items() if x.state == optuna.trial.TrialState.COMPLETE)
        raise UserError(f"study '{study_name}' has no finished trial {number} (finished: {done[:20]}"
                        f"{' ...' if len(done) > 20 else ''})")
    meta = prediction_metadata(t.user_attrs)
    meta.update(study=study_name, trial=number, storage=storage_url, setup=study.user_attrs.get(SETUP_ATTR, {}))
    return DraftArch.from_json(t.user_attrs["arch"]), meta


def prediction_metadata(attrs: dict) -> dict:
    keys = ("tau", "speedup", "cycle_ms", "draft_ms", "verify_ms", "target_step_ms", "params", "memory_mb")
    return {"predicted": {k: attrs.get(k) for k in keys}}


def replace_dir(tmp: Path, dest: Path) -> None:
    """Move a finished directory into place: a killed export, or two workers exporting to one place, never
    leave a weights file and a config from different exports side by side."""
    old = dest.with_name(f".{dest.name}.old{os.getpid()}")
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)


def load_finetuned(supernet: DraftSupernet, state: dict, supernet_path: str, arch: DraftArch, directory: str) -> dict:
    """Put the weights of a search's fine-tuning checkpoint (nas.search's OUT/finetune, nas/finetune.py) into
    `supernet`; -> what the export records. The checkpoint must have fine-tuned this very network (its tree may
    differ: any tree runs on the same weights) from this very supernet, else the weights would be another's."""
    from decode.space import TREE_FIELDS
    from nas.loading import supernet_digest
    from supernet.checkpoint import STATE, load_weights, read_state

    if not (Path(directory) / STATE).is_file():
        raise UserError(f"--finetuned '{directory}' is not a fine-tuning checkpoint (no {STATE}); pass a search's "
                        f"OUT/finetune folder")
    try:
        saved = read_state(Path(directory))
    except json.JSONDecodeError as err:
        raise UserError(f"--finetuned '{directory}': its {STATE} is not valid JSON ({err})") from None
    identity = saved.get("identity") if isinstance(saved, dict) else None
    if not isinstance(identity, dict) or "arch" not in identity:
        raise UserError(f"--finetuned '{directory}' is not a fine-tuning checkpoint (its {STATE} has no identity); "
                        f"pass a search's OUT/finetune folder")
    tuned = {k: v for k, v in json.loads(identity["arch"]).items() if k not in TREE_FIELDS}
    wanted = {k: v for k, v in arch.to_dict().items() if k not in TREE_FIELDS}
    if tuned != wanted:
        raise UserError(f"--finetuned '{directory}' fine-tuned another network ({json.dumps(tuned, sort_keys=True)}), "
                        f"not this arch; export the arch it fine-tuned")
    source = identity.get("run", {}).get("supernet")
    if source is not None and source != supernet_digest(state, supernet_path):
        raise UserError(f"--finetuned '{directory}' was fine-tuned from another supernet than '{supernet_path}' (or "
                        f"the supernet changed since); pass the --supernet its search used")
    load_weights(Path(directory), supernet)
    extra_data = identity.get("run", {}).get("finetune_data", {}).get("dir")  # the target's own answers, if any
    return {"checkpoint": str(Path(directory).resolve()), "steps": saved.get("step"), "seconds": saved.get("elapsed_s"),
            "finetune_data": extra_data}


def export_draft(supernet: DraftSupernet, arch: DraftArch, target: TargetModel, out: str | Path,
                 metadata: dict, extra: dict | None = None) -> Path:
    """Extract `arch` (weights copied), save it as a draft checkpoint, and check that it loads back.
    extra: top-level config keys, e.g. {"kind": "neural+lookup", "lookup": {...}} (decode/drafts/kinds.py)."""
    sub = supernet.extract(arch, target)
    path = sub.save_pretrained(out, target, metadata, extra)
    DraftModel.from_pretrained(path, target)  # strict load: what decode.run will do
    logger.debug("exported %s -> %s", arch.to_json(), path)
    return path


def export(cfg: ExportConfig) -> Path:
    from decode.drafts.corpus import CORPUS_NAME
    from decode.drafts.prompt_lookup import LookupSpec
    from decode.targets.loader import load_target
    from nas.finetune import FinetuneConfig, finetune_subnet
    from nas.loading import load_supernet, read_supernet_state
    from supernet.dataset import FeatureData

    if (cfg.arch is None) == (cfg.trial is None):
        raise UserError("give exactly one of --arch JSON and --trial N")
    if cfg.trial is not None and cfg.storage is None:
        raise UserError("--trial needs --storage (the study's URL, e.g. sqlite:///out/nas-.../study.db)")
    if cfg.finetune_steps < 0:
        raise UserError(f"--finetune-steps must be >= 0, got {cfg.finetune_steps}")
    if cfg.finetune_steps and cfg.finetuned:
        raise UserError("give --finetune-steps (fine-tune now) or --finetuned DIR (weights fine-tuned before), "
                        "not both")
    extra = lookup_extra(cfg.lookup, cfg.merge)
    uses_corpus = "lookup" in extra and LookupSpec(**extra["lookup"]).uses_corpus
    if uses_corpus and (cfg.corpus is None or not Path(cfg.corpus).is_file()):
        raise UserError("a --lookup with a corpus branch (C > 0) or leaf chains (L > 0) needs --corpus FILE "
                        "(python -m decode.corpus)")
    state = read_supernet_state(cfg.supernet)
    if cfg.trial is not None:
        arch, meta = trial_record(cfg.storage, cfg.study_name, cfg.trial)
    else:
        arch, meta = parse_arch(cfg.arch), {"predicted": None}
    target = load_target(cfg.target or state["target_name"], device=cfg.device, dtype=cfg.dtype,
                         cache_dir=Path(cfg.cache_dir) if cfg.cache_dir else None)
    supernet, state = load_supernet(cfg.supernet, target)
    supernet.space.validate(arch, supernet.entropy_layer, trees=False)  # any tree runs on its weights
    if cfg.finetuned:
        meta["finetune"] = load_finetuned(supernet, state, cfg.supernet, arch, cfg.finetuned)
    setup = meta.get("setup", {})
    meta.update(hardware=setup.get("hardware"), profile=setup.get("profile"),
                supernet=str(Path(cfg.supernet).resolve()), export=asdict(cfg))
    if cfg.finetune_steps:
        data = FeatureData(cfg.data or state["data"], target)
        held = cfg.heldout if cfg.heldout is not None else int(setup.get("heldout_last") or
                                                               state.get("config", {}).get("val_sequences", 0))
        ids = list(range(max(0, len(data) - held)))
        meta["finetune"] = finetune_subnet(supernet, arch, data, ids,
                                           FinetuneConfig.like_training(cfg.finetune_steps, state, cfg.finetune_lr))
        meta["predicted_before_finetune"] = True  # the prediction was made for the weights before fine-tuning
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    export_draft(supernet, arch, target, tmp, meta, extra)  # written beside, then moved into place
    if uses_corpus:
        shutil.copyfile(cfg.corpus, tmp / CORPUS_NAME)
    replace_dir(tmp, out)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nas.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="preset or HF model directory (default: the supernet's target)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="float32|bfloat16|float16|auto (auto: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--cache-dir", default=None, help="where embedded targets are prepared")
    p.add_argument("--supernet", required=True, help="supernet checkpoint folder (supernet.train's OUT/checkpoint)")
    p.add_argument("--arch", default=None, help="the arch: JSON object or JSON file")
    p.add_argument("--trial", type=int, default=None, help="export this finished trial of a study instead")
    p.add_argument("--study-name", default=None, help="the study (default: the storage's only study)")
    p.add_argument("--storage", default=None, help="the study's Optuna storage URL (sqlite:///.../study.db)")
    p.add_argument("--out", required=True, help="draft directory to write")
    p.add_argument("--finetune-steps", type=int, default=0, help="train the chosen subnet alone first (default: 0)")
    p.add_argument("--finetune-lr", type=float, default=3e-4, help="fine-tuning learning rate (default: 3e-4)")
    p.add_argument("--finetuned", default=None, metavar="DIR",
                   help="take the arch's weights from a search's fine-tuning checkpoint (its OUT/finetune folder, "
                        "written when the search fine-tuned its best subnet) instead of the supernet's")
    p.add_argument("--data", default=None, help="fine-tuning data (default: the supernet's training data)")
    p.add_argument("--heldout", type=int, default=None,
                   help="last training sequences kept out of fine-tuning (default: the study's / supernet's)")
    p.add_argument("--lookup", default=None, metavar="D:M:K[:W[:C[:S[:L:N]]]]",
                   help="merge prompt lookup into the draft (kind neural+lookup): branch length D, n-grams up to M, "
                        "K branches, W tokens only after a match shorter than M (default: D), C tokens of a corpus "
                        "branch (needs --corpus), S tokens of a second corpus branch, corpus chains of L tokens under "
                        "the neural tree's N best leaves, e.g. 4:2:1, 8:3:1:2, 4:2:1:0:4:2 or 8:2:2:0:4:2:6:8")
    p.add_argument("--corpus", default=None, metavar="FILE",
                   help="corpus.safetensors (python -m decode.corpus) for a --lookup with a corpus branch or leaf "
                        "chains")
    p.add_argument("--merge", default="union", help="with --lookup: union (both trees) or switch (lookup when it "
                                                    "matched, else the neural tree); default: union")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    logging.getLogger("nas").setLevel(logging.INFO if args.verbose else logging.WARNING)
    cfg = ExportConfig(supernet=args.supernet, out=args.out, arch=args.arch, trial=args.trial,
                       study_name=args.study_name, storage=args.storage, finetune_steps=args.finetune_steps,
                       finetune_lr=args.finetune_lr, heldout=args.heldout, data=args.data, target=args.target,
                       device=args.device, dtype=args.dtype,
                       cache_dir=str(args.cache_dir) if args.cache_dir else None, lookup=args.lookup, merge=args.merge,
                       corpus=args.corpus, finetuned=args.finetuned)
    path = export(cfg)
    print(path)
    return 0


if __name__ == "__main__":
    run_cli(main)
