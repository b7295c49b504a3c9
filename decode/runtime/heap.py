"""Keep large freed CPU buffers in the process heap instead of handing them back to the OS.

glibc serves an allocation above its mmap threshold (dynamic, but never above 32 MiB on 64-bit) with a fresh
mmap and unmaps it on free, so the next buffer of that size page-faults on every 4 KiB page it touches.
Training and data building allocate such buffers many times per step: the gradient of the draft's
16384 x 576 hot-vocabulary head (37.7 MB) is a fresh zero-filled tensor each time a subnet slices it, the
target's (192, 49152) logits of a data forward are 37.7 MB. Measured on 2 cores (README): one demo supernet
step 0.73 -> 0.55 s with the same losses to the last digit, because the memory is simply reused.

`retain_freed_memory()` raises the mmap threshold (which also switches glibc's dynamic threshold off) and the
trim threshold, so freed chunks stay in the heap for the next allocation. The process's resident memory then
stays near its peak instead of falling back between steps. Called once by every CLI (decode.cli.run_cli);
VLM_DRAFT_NAS_HEAP=system keeps glibc's defaults. A no-op off glibc (macOS, musl, Windows).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # buffers up to 1 GiB come from the heap
TRIM_THRESHOLD = 1 << 30  # up to 1 GiB of free memory at the heap's top stays mapped
ENV = "VLM_DRAFT_NAS_HEAP"


def retain_freed_memory() -> bool:
    """Set glibc's thresholds as above; True when both took effect, False when off glibc or opted out."""
    if os.environ.get(ENV, "").lower() == "system" or platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    mallopt = ctypes.CDLL(name).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; the trim threshold must be set too, or the freed top of the heap is returned
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        logger.info("mallopt refused the heap thresholds; large buffers are mapped and unmapped per use")
    return ok
