"""The profile file: one JSON per (hardware, target), measured or predicted, same schema for both.

    format          "vlm-draft-nas/hwprofile-v1"
    hardware        canonical hardware name (a100, h200, cpu ...)
    predicted       false: measured on `device`; true: roofline prediction, see `calibrated_from`
    device          DeviceInfo of the measuring machine (predicted: the spec sheet's device)
    versions        python, torch, transformers, driver
    dtype, runtime  e.g. "float32", "eager"
    target          name, fingerprint, dims (hidden, layers, heads, head_dim, vocab)
    space           the search space the draft tables cover
    config, grids   ProfileConfig and Grids as used
    tables          name -> Table (hwprofile.tables): target_prefill, target_step, verify, draft_layer,
                    feat_fc, draft_input, lm_head, scorer, memory_append, overhead
    calibrated_from predicted only: the local profile and the fitted roofline ratios
    load_avg        1-minute system load average before and after measuring (noise on shared machines)
    spec            predicted only: the spec sheet
    small_rows      CPU: the few-row linear kernel each (rows x in -> out) shape took while measuring
                    (decode/runtime/small_rows.py: "linear", "wx" = W @ x^T, "native") and the per-machine file they are kept in
                    (decode/runtime/kernel_table.py), which later decoding processes on this machine adopt
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from decode.errors import UserError
from hwprofile.tables import Table

FORMAT = "vlm-draft-nas/hwprofile-v1"

# table name -> axes; the LatencyModel relies on exactly these
TABLE_AXES: dict[str, tuple[str, ...]] = {
    "target_prefill": ("ctx",),
    "target_step": ("ctx",),
    "verify": ("n", "ctx"),  # n = tree tokens incl. the root
    "draft_layer": ("heads", "ffn", "cross", "n", "ctx"),  # one DraftLayer forward + its KV append
    "feat_fc": ("f", "n"),  # project_features of n rows of f concatenated target features
    "draft_input": ("concat", "n"),  # token embedding (+ in_fc over [embedding; feature] when concat)
    "lm_head": ("vocab", "n"),  # model.logits: norm + head rows (vocab = target vocab: the target's own head)
    "scorer": ("n",),  # log_softmax + top-k over n rows of target-vocab logits (tree building)
    "memory_append": ("heads", "ctx"),  # cross layers: K/V of one new target feature into the memory
    "overhead": ("tree_depth", "top_k"),  # Python / bookkeeping of propose + accept beyond the components
}
# tables a profile may lack (hand-built synthetic profiles, e.g. in nas tests): the LatencyModel counts them as 0
OPTIONAL_TABLES = frozenset({"scorer"})


@dataclass
class Profile:
    hardware: str
    predicted: bool
    device: dict
    versions: dict
    dtype: str
    runtime: str
    date: str
    command: str
    target: dict
    space: dict
    config: dict
    grids: dict
    tables: dict[str, Table]
    wall_s: float = 0.0
    calibrated_from: dict | None = None
    spec: dict | None = None
    load_avg: dict | None = None  # system load (1-min average) before / after measuring: shared machines are noisy
    notes: list[str] = field(default_factory=list)
    small_rows: dict | None = None  # CPU: the few-row linear kernel choices made while measuring

    @property
    def target_name(self) -> str:
        return self.target["name"]

    def check_tables(self) -> None:
        for name, axes in TABLE_AXES.items():
            if name not in self.tables and name in OPTIONAL_TABLES:
                continue
            if name not in self.tables:
                raise UserError(f"profile lacks table '{name}'; re-run python -m hwprofile.profile")
            if self.tables[name].axes != axes:
                raise UserError(f"profile table '{name}' has axes {self.tables[name].axes}, expected {axes}")

    def to_json(self) -> dict:
        return {
            "format": FORMAT, "hardware": self.hardware, "predicted": self.predicted, "device": self.device,
            "versions": self.versions, "dtype": self.dtype, "runtime": self.runtime, "date": self.date,
            "command": self.command, "wall_s": round(self.wall_s, 1), "target": self.target, "space": self.space,
            "config": self.config, "grids": self.grids, "calibrated_from": self.calibrated_from, "spec": self.spec,
            "load_avg": self.load_avg, "notes": self.notes, "small_rows": self.small_rows,
            "tables": {k: t.to_json() for k, t in self.tables.items()},
        }

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n")
        return p

    @classmethod
    def from_json(cls, d: dict) -> "Profile":
        if not isinstance(d, dict):
            raise UserError(f"not a hardware profile (a JSON {type(d).__name__}, expected an object of format {FORMAT!r})")
        if d.get("format") != FORMAT:
            raise UserError(f"not a hardware profile (format {d.get('format')!r}, expected {FORMAT!r})")
        try:
            return cls._from_fields(d)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            missing = f"missing {err}" if isinstance(err, KeyError) else str(err)
            raise UserError(f"damaged hardware profile ({missing}); re-create it with python -m hwprofile.profile") from None

    @classmethod
    def _from_fields(cls, d: dict) -> "Profile":
        wrong = [k for k in ("device", "versions", "target", "space", "config", "grids", "tables")
                 if not isinstance(d[k], dict)]
        if wrong:
            raise ValueError(f"{', '.join(repr(k) for k in wrong)} must be JSON objects")
        if not isinstance(d["target"].get("name"), str) or not isinstance(d["target"].get("fingerprint"), dict):
            raise ValueError("'target' needs a 'name' and a 'fingerprint' object")
        prof = cls(
            hardware=d["hardware"], predicted=bool(d["predicted"]), device=d["device"], versions=d["versions"],
            dtype=d["dtype"], runtime=d["runtime"], date=d["date"], command=d.get("command", ""), target=d["target"],
            space=d["space"], config=d["config"], grids=d["grids"],
            tables={k: Table.from_json(v) for k, v in d["tables"].items()}, wall_s=float(d.get("wall_s", 0.0)),
            calibrated_from=d.get("calibrated_from"), spec=d.get("spec"), load_avg=d.get("load_avg"),
            notes=list(d.get("notes", [])), small_rows=d.get("small_rows"),
        )
        prof.check_tables()
        return prof

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        p = Path(path)
        if not p.is_file():
            what = "is a directory, not a profile JSON file" if p.is_dir() else "does not exist"
            raise UserError(f"profile '{path}' {what}; create one with python -m hwprofile.profile")
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as err:
            raise UserError(f"profile '{path}' is not valid JSON ({err.msg} at line {err.lineno}); re-create it") from None
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"profile '{path}' cannot be read ({err.__class__.__name__}); re-create it") from None
        try:
            return cls.from_json(raw)
        except UserError as err:
            raise UserError(f"profile '{path}': {err}") from None


def default_profile_path(hardware: str, target: str, root: Path = Path("profiles"), runtime: str = "eager") -> Path:
    """profiles/<hardware>-<target>.json, <hardware>-<target>-compiled.json for the compiled runtime (a target
    directory contributes its folder name)."""
    name = Path(target).name if ("/" in target or target.startswith(".")) else target
    return root / f"{hardware}-{name}{'' if runtime == 'eager' else '-' + runtime}.json"
