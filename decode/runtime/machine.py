"""Which CPU this process runs on: model, vector extensions and usable cores. The kernels that are fast on a CPU
depend on all three (decode.runtime.small_rows chooses per machine and keeps its choices per machine;
hwprofile.device records them in every profile)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (Linux), else platform.processor()."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "asimd", "sve")  # x86 and Arm


def cpu_isa() -> str:
    """The vector extensions among ISA_FLAGS that /proc/cpuinfo lists, e.g. "avx2,avx512f,amx_tile"; two
    CPUs of one model name can differ here (and MKL's small-matrix kernels with them), "" when unknown."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return ""
    for line in cpuinfo.read_text(errors="replace").splitlines():
        if line.lower().startswith(("flags", "features")):
            have = set(line.split(":", 1)[1].split())
            return ",".join(f for f in ISA_FLAGS if f in have)
    return ""


def cpu_cores() -> int:
    """Cores this process may run on (affinity mask, e.g. a container's share), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
