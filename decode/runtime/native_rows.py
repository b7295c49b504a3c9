"""The native few-row linear kernel (rows_kernel.cpp): built once per machine with the system's C++ compiler, kept in
the cache folder, called through ctypes; one of the products decode.runtime.small_rows chooses between.

On a 2-core AMD EPYC (AVX-512) the default target's linear layers and LM head took, per forward (weights streamed
from memory): 1 row 15 ms (the best torch product 29 ms), 4-5 rows 14 ms (39), 8 rows 17 ms (88), and up to 12
rows in one pass. Each thread streams one contiguous block of weight rows, prefetching ahead, and multiplies a tile
of weight vectors with every input row while they are in registers; a row's result is bitwise the same alone or
with other rows (see the .cpp).

Where it cannot be had (not x86-64, no AVX2+FMA, no compiler, a failed build, VLM_DRAFT_NAS_NATIVE_ROWS=off),
`available()` is False and small_rows keeps the torch products; a failed build is logged once with the compiler's
message. The built library's name hashes the source, the flags, the compiler and the CPU, so an edit or another
machine builds afresh; the build writes a temporary file and renames it, so concurrent processes never load half a
library. OpenMP: the library links libgomp.so.1, which the dynamic loader resolves to the copy torch has already
loaded (one thread pool, not two).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from decode.runtime.machine import cpu_isa, cpu_model

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rows_kernel.cpp")
# the library also holds the decoding attention kernel (decode/runtime/native_attention.py); both include simd.h
SOURCES = (SOURCE, SOURCE.with_name("attention_kernel.cpp"))
HEADERS = (SOURCE.with_name("simd.h"),)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp", "-shared", "-fPIC", f"-I{SOURCE.parent}")
ENV = "VLM_DRAFT_NAS_NATIVE_ROWS"  # "off" (or 0): never build nor use the native kernel
BUILD_TIMEOUT_S = 120


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def unavailable_reason() -> str | None:
    """Why the kernel cannot be used on this machine (None: it can be tried)."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "no", "false"):
        return f"{ENV}=off"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    isa = set(cpu_isa().split(","))
    if not isa & {"avx2", "avx512f"}:
        return "the CPU has neither AVX2 nor AVX-512"
    if _compiler() is None:
        return "no C++ compiler (g++/c++; set CXX)"
    return None


def _version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _build_dir() -> Path:
    from decode.targets.embedded import default_cache_dir  # the project's cache folder (same layer, imported late)

    folder = default_cache_dir() / "kernels"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="vlm-draft-nas-kernels-"))  # a read-only cache: build for this process only


def library_path() -> Path:
    """Where this machine's build of the kernel lives (it may not exist yet)."""
    compiler = _compiler() or "none"
    texts = [f.read_text() for f in (*SOURCES, *HEADERS)]
    key = "|".join([*texts, " ".join(FLAGS), compiler, _version(compiler), cpu_model(), cpu_isa()])
    return _build_dir() / f"rows-native-{hashlib.sha1(key.encode()).hexdigest()[:12]}.so"


def _build(path: Path, flags: tuple[str, ...] = FLAGS, source: Path | tuple[Path, ...] = SOURCES) -> None:
    """Compile the kernels (`source`: other versions of them, e.g. one file, for A/B runs) into `path` (through a
    temporary file and a rename)."""
    sources = (source,) if isinstance(source, Path) else tuple(source)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        done = subprocess.run([_compiler(), *flags, *map(str, sources), "-o", tmp], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError((done.stderr or done.stdout).strip().splitlines()[-1:] or ["compiler failed"])
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(path: Path) -> ctypes.CDLL:
    """A built kernel library with its functions' signatures declared."""
    lib = ctypes.CDLL(str(path))
    lib.vlm_rows_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.vlm_rows_linear.restype = ctypes.c_int
    if hasattr(lib, "vlm_rows_linear_bf16"):  # absent from builds of older sources (benchmarks/native_kernel_ab.py)
        lib.vlm_rows_linear_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        lib.vlm_rows_linear_bf16.restype = ctypes.c_int
    lib.vlm_rows_lanes.restype = ctypes.c_int
    if hasattr(lib, "vlm_tree_attention"):  # absent from builds of the linear kernel alone (A/B runs)
        lib.vlm_tree_attention.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 13
                                           + [ctypes.c_float, ctypes.c_int])
        lib.vlm_tree_attention.restype = ctypes.c_int
    return lib


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    reason = unavailable_reason()
    if reason is not None:
        log.info("native few-row linear kernel not used: %s", reason)
        return None
    try:
        path = library_path()
        if not path.is_file():
            _build(path)
        return load(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("the native few-row linear kernel could not be built or loaded (%s); torch's products are used", e)
        return None


def available() -> bool:
    """True when the kernel is built (building it now if needed) and loaded."""
    return _library() is not None


def lanes() -> int:
    """The vector width of this machine's build (16: AVX-512, 8: AVX2; 0: not available)."""
    lib = _library()
    return 0 if lib is None else int(lib.vlm_rows_lanes())


def rows_linear(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x2 (rows, in) @ weight (out, in)^T -> (rows, out): float32 CPU x2 and result, a float32 or bfloat16 weight
    (widened exactly as it is read: half the bytes streamed); call only when available()."""
    lib = _library()
    x2 = x2.contiguous()
    weight = weight.contiguous()  # nn.Linear weights already are: no copy
    rows, n_in = x2.shape
    y = torch.empty(rows, weight.shape[0], dtype=torch.float32)
    fn = lib.vlm_rows_linear_bf16 if weight.dtype == torch.bfloat16 else lib.vlm_rows_linear
    if fn(x2.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, n_in, weight.shape[0], torch.get_num_threads()) != 0:
        raise ValueError(f"native rows kernel refused shapes x {tuple(x2.shape)}, weight {tuple(weight.shape)}")
    return y


# rows_linear as an operator a torch.compile graph calls as it is (the compiled runtime's traced forwards). Defined
# through torch.library.Library, not custom_op: a call costs 9 us against 17 (custom_op's autograd and checking
# layers), and a forward of the default target makes 211 of them.
_OPS = torch.library.Library("vlm_draft_nas", "DEF")
_OPS.define("rows_linear(Tensor x2, Tensor weight) -> Tensor")
_OPS.impl("rows_linear", rows_linear, "CPU")


@torch.library.register_fake("vlm_draft_nas::rows_linear")
def _(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x2.new_empty(x2.shape[0], weight.shape[0])  # x2's dtype: float32 whatever the weight's


rows_linear_op = torch.ops.vlm_draft_nas.rows_linear.default
