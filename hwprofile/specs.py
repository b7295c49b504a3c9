"""Hardware spec sheets: configs/hardware/<name>.yaml -> HardwareSpec (SI units).

A sheet gives dense peak FLOP/s per dtype, memory bandwidth and size, and a per-kernel launch
overhead estimate, each with its source in a comment. Units in the YAML are the ones datasheets
use (TFLOP/s, GB/s, GB, microseconds); `HardwareSpec` holds FLOP/s, B/s, bytes and seconds.
Products sold in several memory sizes list `variants` that override fields (A100 40 GB).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from configs import config_dir
from decode.errors import UserError

_DTYPE_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_REQUIRED = ("name", "kind", "peak_tflops", "memory_bandwidth_gbs", "memory_gb", "launch_overhead_us")


def dtype_key(dtype: torch.dtype | str) -> str:
    """torch.float32 / "float32" / "fp32" -> "fp32" (the keys of peak_tflops)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_KEYS:
            raise UserError(f"no peak FLOP/s for dtype {dtype}; use float32, bfloat16 or float16")
        return _DTYPE_KEYS[dtype]
    aliases = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16"}
    if dtype not in aliases:
        raise UserError(f"unknown dtype '{dtype}'; use float32, bfloat16 or float16")
    return aliases[dtype]


def dtype_bytes(dtype: str | torch.dtype) -> int:
    return 4 if dtype_key(dtype) == "fp32" else 2


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    kind: str  # cuda | cpu
    description: str
    peak_flops: dict[str, float]  # dtype key -> dense FLOP/s
    memory_bandwidth: float  # B/s
    memory_bytes: float
    launch_overhead_s: float  # per kernel (eager dispatch + launch)
    variant: str | None = None

    def flops_for(self, dtype: str | torch.dtype) -> float:
        key = dtype_key(dtype)
        if key not in self.peak_flops:
            raise UserError(f"spec sheet '{self.name}' has no peak FLOP/s for {key}; add it to configs/hardware/{self.name}.yaml")
        return self.peak_flops[key]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareSpec":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def known_hardware() -> list[str]:
    return sorted(p.stem for p in config_dir("hardware").glob("*.yaml"))


def load_spec(name: str, variant: str | None = None, path: Path | None = None) -> HardwareSpec:
    """The spec sheet of a canonical hardware name (or a YAML file path), with an optional variant."""
    p = Path(path) if path is not None else config_dir("hardware") / f"{name}.yaml"
    if not p.is_file():
        raise UserError(f"no spec sheet for hardware '{name}'; known: {', '.join(known_hardware())} "
                        f"(add configs/hardware/{name}.yaml to predict it)")
    raw = yaml.safe_load(p.read_text()) or {}
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise UserError(f"spec sheet {p} lacks {', '.join(missing)}")
    variants = raw.get("variants") or {}
    if variant is not None and variant in variants:
        raw = {**raw, **variants[variant]}
    elif variant is not None:
        variant = None  # a product without that variant: the base sheet applies
    try:
        return HardwareSpec(
            name=str(raw["name"]), kind=str(raw["kind"]), description=str(raw.get("description", "")),
            peak_flops={dtype_key(k): float(v) * 1e12 for k, v in raw["peak_tflops"].items()},
            memory_bandwidth=float(raw["memory_bandwidth_gbs"]) * 1e9, memory_bytes=float(raw["memory_gb"]) * 1e9,
            launch_overhead_s=float(raw["launch_overhead_us"]) * 1e-6, variant=variant,
        )
    except (TypeError, ValueError) as err:
        raise UserError(f"spec sheet {p} has a non-numeric figure ({err}); give plain numbers") from None
