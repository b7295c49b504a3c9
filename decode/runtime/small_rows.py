"""Faster CPU linear layers for the few-row inputs of decoding (a small draft tree, its verification),
where the CPU has them: the choice is measured per shape on the machine that runs.

torch's `F.linear(x, W)` computes x @ W^T through MKL's GEMM with a transposed weight. On some CPUs that
re-packs the whole weight on every call when x has a few rows: on one 2-core Xeon (AVX2) the target's LM
head (49152 x 576) took 9.4 ms for one row but 22.5 ms for two and 33.6 ms for three, while W @ x^T (the
same product, W read in place) took 3.1 and 4.0 ms, and verifying a 2-3 token tree cost 1.6-2x a decoding
step. On another 2-core Xeon (AVX-512 + AMX) it is the other way round: F.linear 2.4 ms for 1-3 rows of the
same head, W @ x^T 7.9 ms, and a 2-4 token verify through W @ x^T cost 2.2x a step against 1.1-1.5x with
F.linear. So no fixed rule is right: in the default mode `auto`, the first call with a given (rows, in,
out) shape times both products on its real weight (a few alternating runs, medians; each run streams clones
of the weight from memory, as a forward through the whole model does) and every later call of that shape
takes the fastest; the others must beat F.linear by 10% to be taken. A third product joins where the machine can
build it: decode/runtime/native_rows.py, a native kernel that streams each weight once for all rows (on a 2-core AMD
EPYC the default target's linear layers took 15 ms for one row against 29 with the best torch product, 14 for four
against 39, 17 for eight against 88).

CPU float32 inference calls with 1..SMALL_ROWS rows are candidates. One row too: MKL's one-column product
(GEMV) streams the weight on one core, and the same row as two identical columns of W @ X runs on all
threads, which made a decoding step of the default target 13-25% faster on a 2-core AMD EPYC (README).
Prefill, training (autograd) and other devices or dtypes always run F.linear.

Inside a torch.compile graph (the compiled runtime) inductor lowers F.linear to the same transposed-weight
GEMM, with the same cost: on a 2-core AMD EPYC (AVX2) the compiled LM head took 46-100 ms for 2-8 rows
against 16-42 ms for a compiled W @ x^T, which made compiled tree verification slower than eager. No host
timing can run while a graph is traced, so `measure_linears(model, rows)` times the choices of a model's
linear layers beforehand (the compiled runtime does it for every bucket before compiling it) and the traced
code reads them as constants; a shape never measured keeps F.linear. The draft blocks call `linear`;
`use_small_rows(model)` routes every nn.Linear of a target through it (decode.targets.loader does so for every
target). Vanilla and speculative decoding run the same layers, so speed-ups stay like-for-like; outputs
stay token-identical (tested), values within 1e-5 of F.linear.

Exact before fast (the default mode, `exact`): where the native kernel is built, every float32 CPU inference call of
1..EXACT_ROWS rows takes it, whatever auto would time faster. Its result for a row does not depend on the other
rows (rows_kernel.cpp), and with the native attention kernel (native_attention.py) neither does the rest of a
forward: a token verified in a tree of up to EXACT_ROWS tokens gets the logits a vanilla step gives it, bit for
bit, so greedy speculative decoding reproduces the target's own output without exception, where mixing products by
row count (e.g. MKL for 17+ rows) moved a verified token's logits by up to 2e-5 and could flip a near-tie. On the
2-core AMD EPYC that every measurement here ran on, auto chose the native kernel for every one of the default
target's decoding shapes anyway. Without the kernel `exact` is `auto`.

VLM_DRAFT_NAS_SMALL_ROWS=exact (default) | auto (the fastest product per shape, measured: up to ties, not exact) |
on (W @ x^T for every candidate call) | native (the native kernel for every candidate call, W @ x^T where it is not
available) | off (F.linear everywhere; VLM_DRAFT_NAS_PLAIN_LINEAR=1 means the same). VLM_DRAFT_NAS_NATIVE_ROWS=off
keeps the native kernel out of every choice. `choices()` lists what auto picked ("linear", "wx" or "native" per
shape).

A choice is measured once per machine, not per process: decode.runtime.kernel_table keeps it in a file in the cache
folder that every later process adopts, so the hardware profile and the bench that checks it run the same kernels
(timed per process, near-ties flipped between processes and the profile priced a step 36% above the bench's).
"""

from __future__ import annotations

import os
import statistics
import time
import types

import torch

from decode.runtime import kernel_table, native_rows

SMALL_ROWS = 16  # inputs with more rows (prefill, training batches) keep F.linear, except in mode exact:
EXACT_ROWS = 64  # mode exact: rows up to this many (the largest tree verified) take the native kernel
MARGIN = 0.9  # auto: another product is taken when its median time is below MARGIN x F.linear's
COLD_BYTES = 128 << 20  # weights streamed per timing sample: four times a 32 MiB last-level cache
MAX_COPIES = 256  # tiny weights: at most this many clones per timing sample
VERSION = "rows-cold-5"  # how the choice is made and the native kernel tiles; profiles record it (step and verify
# costs depend on both)
MODES = ("exact", "auto", "on", "native", "off")
PRODUCTS = ("linear", "wx", "native")  # F.linear; W @ x^T through torch; the native kernel (native_rows)


def _mode_from_env() -> str:
    if os.environ.get("VLM_DRAFT_NAS_PLAIN_LINEAR", "") not in ("", "0"):
        return "off"
    mode = os.environ.get("VLM_DRAFT_NAS_SMALL_ROWS", "exact").strip().lower() or "exact"
    return mode if mode in MODES else "exact"


MODE = _mode_from_env()
_CHOICE: dict[tuple[int, int, int], str] = {}  # (rows, in, out) -> the fastest of PRODUCTS (auto mode, measured)
_TABLE_KEY: str | None = None  # the machine key (kernel_table) whose persisted choices _CHOICE holds


def _rows_product(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x2 (rows, in) -> (rows, out) as W @ x^T: W (out, in) is read in place, not re-packed. x2 is made contiguous
    first: the input of an MLP's down projection comes out of the up projection's transposed product, and with
    that layout W @ x^T took 19 ms against 8 for the default target's 30 down projections of a 2-token verify.
    One row runs as two identical columns: MKL computes W @ x for one column as a GEMV that streams the weight on
    one core, while a two-column product runs on all threads (measured 34 against 49 ms for the default target's
    linear layers + LM head on 2 AMD EPYC cores)."""
    rows = x2.shape[0]
    cols = torch.cat([x2, x2]) if rows == 1 else x2.contiguous()  # (max(rows, 2), in)
    return (weight @ cols.T)[:, :rows].T.contiguous()  # (rows, out), contiguous as F.linear's: later ops keep layouts


def _cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight and clones of it, COLD_BYTES in all (at most MAX_COPIES tensors): timing a product over them in
    turn reads each weight from memory, as a decoding forward does (its layers' weights outgrow every cache);
    timed over one weight again and again, the weight stays in cache and the choice was wrong for the model
    (one 2-core AMD EPYC: F.linear looked as fast for 2-row inputs of the 576 x 1536 MLP weights, then took
    53 ms against 24 ms for the default target's layers in a real 2-token verify)."""
    n = max(1, min(MAX_COPIES, -(-COLD_BYTES // max(1, weight.numel() * weight.element_size()))))
    return [weight] + [weight.clone() for _ in range(n - 1)]


def _products() -> dict[str, object]:
    """The products this machine has: name -> f(x2 (rows, in), weight (out, in)) -> (rows, out)."""
    found = {"linear": lambda x2, w: torch.nn.functional.linear(x2, w), "wx": _rows_product}
    if native_rows.available():
        found["native"] = native_rows.rows_linear
    return found


def _measure(rows: int, weight: torch.Tensor, reps: int = 5) -> str:
    """The fastest product (PRODUCTS) for `rows` rows through this weight on this machine: medians of `reps`
    alternating samples, each sample one product through every copy of _cold_copies (from memory, not cache); one
    other than F.linear must beat it by the MARGIN."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    copies = _cold_copies(weight)
    products = _products()
    times: dict[str, list[float]] = {name: [] for name in products}
    with torch.no_grad():
        for _ in range(reps + 1):  # the first round warms up (allocations, the native build's first call)
            for name, product in products.items():
                t0 = time.perf_counter()
                for w in copies:
                    product(x, w)
                times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(t[1:]) for name, t in times.items()}
    best = min((name for name in median if name != "linear"), key=median.__getitem__)
    return best if median[best] < MARGIN * median["linear"] else "linear"


def _sync_table() -> None:
    """Adopt this machine's persisted choices (decode.runtime.kernel_table): once per process and torch thread
    count; choices made under another thread count are dropped (a two-column product's gain is its threads)."""
    global _TABLE_KEY
    key = kernel_table.machine_key(rule())
    if key != _TABLE_KEY:
        if _TABLE_KEY is not None:
            _CHOICE.clear()
        _CHOICE.update(kernel_table.load(key))
        _TABLE_KEY = key


def rule() -> str:
    """VERSION, and whether the native kernel is a candidate: a process without it (VLM_DRAFT_NAS_NATIVE_ROWS=off, no
    compiler) keeps its own table of choices, measured between torch's two products."""
    return f"{VERSION}+native" if native_rows.available() else VERSION


def _forced() -> str:
    """The product MODE on / native forces."""
    return "native" if MODE == "native" and native_rows.available() else "wx"


def _exact() -> bool:
    """Mode exact with the native kernel built: every decoding-sized product takes it."""
    return MODE == "exact" and native_rows.available()


def _choose(rows: int, weight: torch.Tensor) -> str:
    """The product (PRODUCTS) for `rows` rows through `weight` (MODE auto, or exact without the native kernel:
    measured once per machine)."""
    if MODE in ("on", "native"):
        return _forced()
    if _exact():
        return "native"
    key = (rows, weight.shape[1], weight.shape[0])
    choice = _CHOICE.get(key)
    if choice is None:
        _sync_table()
        choice = _CHOICE.get(key)
    if choice is None:  # never measured on this machine: time it once, keep it for every later process
        _CHOICE.update(kernel_table.save(_TABLE_KEY, {key: _measure(rows, weight)}))
        choice = _CHOICE[key]
    return _usable(choice)


def _usable(choice: str) -> str:
    """`choice`, or W @ x^T for a native choice in a process whose kernel went away (tables are kept per rule(), so
    only a kernel that failed after the choice was read meets this)."""
    return "wx" if choice == "native" and not native_rows.available() else choice


def table_file() -> str | None:
    """The file this machine's choices are kept in (None: in memory only); bench results and profiles record it."""
    path = kernel_table.table_path(kernel_table.machine_key(rule()))
    return None if path is None else str(path)


def linear_kernels() -> str:
    """How few-row CPU linear products are chosen in this process (VERSION:MODE); profiles record it."""
    return f"{rule()}:{MODE}"


def choices() -> dict[str, str]:
    """What auto mode measured so far: "rows x in -> out" -> the product taken (PRODUCTS)."""
    return {f"{r}x{i}->{o}": v for (r, i, o), v in sorted(_CHOICE.items())}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through W @ x^T or the native kernel where that is faster (few rows, CPU, float32,
    inference), or a float32 x through a bfloat16 weight. x: (..., in), weight (out, in) -> (..., out)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    limit = EXACT_ROWS if MODE == "exact" and _native_ready() else SMALL_ROWS
    few = (1 <= rows <= limit and x.device.type == "cpu" and x.dtype == torch.float32
           and weight.dtype == torch.float32)
    compiling = torch.compiler.is_compiling()
    if weight.dtype == torch.bfloat16 and x.dtype == torch.float32 and x.device.type == "cpu":
        # a draft packed for CPU decoding (decode/drafts/pack.py): the native kernel widens the weight as it streams
        # it (half the bytes of a float32 weight); more rows (a draft's first forward over the prompt) or no kernel:
        # F.linear through a float32 copy, the same values
        if not (1 <= rows <= SMALL_ROWS and _native_ready()):
            return torch.nn.functional.linear(x, weight.to(x.dtype), bias)
        choice = "native"
    elif compiling:  # the compiled runtime: the choice measured before tracing, read as a constant
        choice = PRODUCTS[_measured_choice(rows, weight.shape[1], weight.shape[0])] if few else "linear"
    elif MODE != "off" and few and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        choice = _choose(rows, weight)
    else:
        choice = "linear"
    if choice == "linear":
        return torch.nn.functional.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    if choice == "wx":
        y = _rows_product(x2, weight)
    else:  # the native kernel; inside a graph as an operator dynamo does not trace into
        y = native_rows.rows_linear_op(x2, weight) if compiling else native_rows.rows_linear(x2, weight)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


@torch.compiler.assume_constant_result
def _native_ready() -> bool:
    return native_rows.available()


@torch.compiler.assume_constant_result
def _measured_choice(rows: int, n_in: int, n_out: int) -> int:
    """What `measure_linears` found for this shape, as an index into PRODUCTS (F.linear when never measured or in
    mode off); traced as a constant, so a graph neither guards on nor recompiles for later entries of the table."""
    if MODE in ("on", "native"):
        return PRODUCTS.index(_forced())
    if _exact():
        return PRODUCTS.index("native")
    measured = MODE in ("auto", "exact")
    return PRODUCTS.index(_usable(_CHOICE.get((rows, n_in, n_out), "linear")) if measured else "linear")


def measure_linears(model: torch.nn.Module, rows: int) -> int:
    """Time (auto mode) the choice for `rows`-row inputs of every float32 CPU nn.Linear of `model` that has not
    been timed yet, so that a graph compiled afterwards takes the faster product; -> shapes measured now."""
    if MODE not in ("auto", "exact") or _exact() or not 1 <= rows <= SMALL_ROWS:
        return 0
    _sync_table()
    n = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        w = module.weight
        if w.device.type == "cpu" and w.dtype == torch.float32 and (rows, w.shape[1], w.shape[0]) not in _CHOICE:
            _choose(rows, w.detach())
            n += 1
    return n


def measure_rows(model: torch.nn.Module, up_to: int = SMALL_ROWS) -> int:
    """measure_linears for every row count 1..up_to: an untimed warm-up makes every choice a decoding run may meet,
    so none is timed inside it (each costs ~0.1-0.2 s of streaming weight clones); -> shapes measured now."""
    return sum(measure_linears(model, rows) for rows in range(1, min(up_to, SMALL_ROWS) + 1))


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def use_small_rows(model: torch.nn.Module) -> int:
    """Route every nn.Linear of `model` (a target) through `linear`; -> layers switched. The path is taken
    per call (CPU, float32, few rows, no gradient), so the model may still move to a GPU or train."""
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_forward, module)
            n += 1
    return n
