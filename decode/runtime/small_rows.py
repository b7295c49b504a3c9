"""Faster CPU linear layers for the few-row inputs of decoding (a small draft tree, its verification),
where the CPU has them: the choice is measured per shape on the machine that runs.

torch's `F.linear(x, W)` computes x @ W^T through MKL's GEMM with a transposed weight. On some CPUs that
re-packs the whole weight on every call when x has a few rows: on one 2-core Xeon (AVX2) the target's LM
head (49152 x 576) took 9.4 ms for one row but 22.5 ms for two and 33.6 ms for three, while W @ x^T (the
same product, W read in place) took 3.1 and 4.0 ms, and verifying a 2-3 token tree cost 1.6-2x a decoding
step. On another 2-core Xeon (AVX-512 + AMX) it is the other way round: F.linear 2.4 ms for 1-3 rows of the
same head, W @ x^T 7.9 ms, and a 2-4 token verify through W @ x^T cost 2.2x a step against 1.1-1.5x with
F.linear. So no fixed rule is right: in the default mode `auto`, the first call with a given (rows, in,
out) shape times both products on its real weight (a few alternating runs, medians) and every later call
of that shape takes the faster one; W @ x^T must win by 10% to be taken.

Only CPU float32 inference calls with 2..SMALL_ROWS rows are candidates; one row (MKL's GEMV), prefill,
training (autograd) and other devices or dtypes always run F.linear.

Inside a torch.compile graph (the compiled runtime) inductor lowers F.linear to the same transposed-weight
GEMM, with the same cost: on a 2-core AMD EPYC (AVX2) the compiled LM head took 46-100 ms for 2-8 rows
against 16-42 ms for a compiled W @ x^T, which made compiled tree verification slower than eager. No host
timing can run while a graph is traced, so `measure_linears(model, rows)` times the choices of a model's
linear layers beforehand (the compiled runtime does it for every bucket before compiling it) and the traced
code reads them as constants; a shape never measured keeps F.linear. The draft blocks call `linear`;
`use_small_rows(model)` routes every nn.Linear of a target through it (decode.targets.loader does so for every
target). Vanilla and speculative decoding run the same layers, so speed-ups stay like-for-like; outputs
stay token-identical (tested), values within 1e-5 of F.linear.

VLM_DRAFT_NAS_SMALL_ROWS=auto (default) | on (W @ x^T for every candidate call) | off (F.linear
everywhere; VLM_DRAFT_NAS_PLAIN_LINEAR=1 means the same). `choices()` lists what auto picked.
"""

from __future__ import annotations

import os
import statistics
import time
import types

import torch

SMALL_ROWS = 16  # inputs with more rows (prefill, training batches) always keep F.linear
MARGIN = 0.9  # auto: W @ x^T is taken when its median time is below MARGIN x F.linear's
MODES = ("auto", "on", "off")


def _mode_from_env() -> str:
    if os.environ.get("VLM_DRAFT_NAS_PLAIN_LINEAR", "") not in ("", "0"):
        return "off"
    mode = os.environ.get("VLM_DRAFT_NAS_SMALL_ROWS", "auto").strip().lower() or "auto"
    return mode if mode in MODES else "auto"


MODE = _mode_from_env()
_CHOICE: dict[tuple[int, int, int], bool] = {}  # (rows, in, out) -> W @ x^T is faster (auto mode, measured)


def _rows_product(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight @ x2.T).T  # (rows, out): W (out, in) is read in place, not re-packed


def _measure(rows: int, weight: torch.Tensor, reps: int = 7, sample_s: float = 2e-4) -> bool:
    """True when W @ x^T beats F.linear for `rows` rows through this weight on this machine: medians of
    `reps` alternating samples, each sample repeating the product until it lasts about `sample_s` (a
    576 x 576 projection of 3 rows takes some 10-40 us: single calls would time the clock's noise)."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)

    def plain() -> None:
        torch.nn.functional.linear(x, weight)

    def mine() -> None:
        _rows_product(x, weight)

    with torch.no_grad():
        t0 = time.perf_counter()
        plain()
        mine()
        k = max(1, min(64, int(sample_s / max(time.perf_counter() - t0, 1e-7) * 2)))
        times: dict = {plain: [], mine: []}
        for _ in range(reps):
            for f in (plain, mine):
                t0 = time.perf_counter()
                for _ in range(k):
                    f()
                times[f].append(time.perf_counter() - t0)
    return statistics.median(times[mine]) < MARGIN * statistics.median(times[plain])


def _take_rows_path(rows: int, weight: torch.Tensor) -> bool:
    if MODE == "on":
        return True
    key = (rows, weight.shape[1], weight.shape[0])
    faster = _CHOICE.get(key)
    if faster is None:
        faster = _CHOICE[key] = _measure(rows, weight)
    return faster


def choices() -> dict[str, bool]:
    """What auto mode measured so far: "rows x in -> out" -> W @ x^T taken."""
    return {f"{r}x{i}->{o}": v for (r, i, o), v in sorted(_CHOICE.items())}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through W @ x^T where that is faster (few rows, CPU, float32, inference).
    x: (..., in), weight (out, in) -> (..., out)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    few = (2 <= rows <= SMALL_ROWS and x.device.type == "cpu" and x.dtype == torch.float32
           and weight.dtype == torch.float32)
    if torch.compiler.is_compiling():  # the compiled runtime: the choice measured before tracing, read as a constant
        take = few and _measured_faster(rows, weight.shape[1], weight.shape[0])
    else:
        take = (MODE != "off" and few and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
                and _take_rows_path(rows, weight))
    if not take:
        return torch.nn.functional.linear(x, weight, bias)
    y = _rows_product(x.reshape(rows, x.shape[-1]), weight)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


@torch.compiler.assume_constant_result
def _measured_faster(rows: int, n_in: int, n_out: int) -> bool:
    """What `measure_linears` found for this shape (False when never measured or in mode off); traced as a constant,
    so a graph neither guards on nor recompiles for later entries of the choice table."""
    return MODE == "on" or (MODE == "auto" and _CHOICE.get((rows, n_in, n_out), False))


def measure_linears(model: torch.nn.Module, rows: int) -> int:
    """Time (auto mode) the choice for `rows`-row inputs of every float32 CPU nn.Linear of `model` that has not
    been timed yet, so that a graph compiled afterwards takes the faster product; -> shapes measured now."""
    if MODE != "auto" or not 2 <= rows <= SMALL_ROWS:
        return 0
    n = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        w = module.weight
        if w.device.type == "cpu" and w.dtype == torch.float32 and (rows, w.shape[1], w.shape[0]) not in _CHOICE:
            _take_rows_path(rows, w.detach())
            n += 1
    return n


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
