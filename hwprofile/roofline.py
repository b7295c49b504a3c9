"""Roofline model per op, calibrated on the local device.

For one table entry with census c (hwprofile.census: FLOPs, traffic, kernels) on hardware h:

    roofline(c, h) = max(c.flops / peak_h(dtype), c.bytes(dtype) / bandwidth_h)  +  c.kernels * launch_h
                     `------------------- throughput term -------------------'     `-- launch term --'

Real code reaches neither peak nor the sheet's launch estimate, so the model is calibrated with
the ratio of measured to roofline time on the local device, per op class. One ratio for the whole
sum would carry the local device's regime over to the other: a CPU that is throughput-bound would
scale a GPU's launch-bound time by its own (throughput) inefficiency. So the ratio is fitted
separately per term, jointly over all measured entries (non-negative least squares on relative
errors):

    measured(entry) ~= alpha[class] * throughput(c, local)  +  beta * kernels * launch_local

alpha per op class (how far each kind of op stays from its roofline), beta one number (how the
real per-kernel cost compares with the sheet's estimate; host-side dispatch, shared by all ops).
The prediction for hardware h is

    alpha[class] * throughput(c, h)  +  beta' * kernels * launch_h

with beta' = beta when h is of the same kind as the local device (GPU -> GPU: the per-kernel cost
means the same thing on both), else 1: a CPU has no kernel launches, its beta only says how far
the CPU sheet's placeholder dispatch figure is off, so a GPU keeps its own sheet's per-kernel
figure (itself derived from eager measurements on such machines, see configs/hardware/h200.yaml).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from hwprofile.census import Census, roofline_seconds
from hwprofile.schema import Profile
from hwprofile.specs import HardwareSpec, dtype_bytes

# table -> op class sharing one alpha (same kind of work at different sizes)
OP_CLASS: dict[str, str] = {
    "target_prefill": "prefill",  # long sequences: compute-bound
    "target_step": "target",  # target forwards over a few to a few hundred tokens
    "verify": "target",
    "draft_layer": "draft_layer",
    "lm_head": "lm_head",  # one big matmul (+ scatter into the target vocab)
    "scorer": "lm_head",  # softmax / top-k over the target vocab: same streams of vocab-sized rows
    "feat_fc": "small",  # single small linears
    "draft_input": "small",
    "memory_append": "small",
}


def terms_s(c: Census, spec: HardwareSpec, dtype: str) -> tuple[float, float]:
    """(throughput seconds, launch seconds) of a census on hardware `spec` computing in `dtype`."""
    thr = roofline_seconds(c, spec.flops_for(dtype), spec.memory_bandwidth, dtype_bytes(dtype))
    return thr, c.kernels * spec.launch_overhead_s


def roofline_ms(c: Census, spec: HardwareSpec, dtype: str) -> float:
    """The uncalibrated roofline time in ms."""
    return 1e3 * sum(terms_s(c, spec, dtype))


def nnls(a: np.ndarray, b: np.ndarray, sweeps: int = 2000) -> np.ndarray:
    """min ||a x - b||^2 subject to x >= 0, by cyclic coordinate descent (few unknowns, well scaled)."""
    x = np.zeros(a.shape[1])
    col_sq = (a * a).sum(0)
    r = b - a @ x
    for _ in range(sweeps):
        for j in range(a.shape[1]):
            if col_sq[j] == 0:
                continue
            new = max(0.0, x[j] + a[:, j] @ r / col_sq[j])
            r -= a[:, j] * (new - x[j])
            x[j] = new
    return x


@dataclass(frozen=True)
class Calibration:
    hardware: str  # the device the ratios were fitted on
    kind: str  # its kind: cuda | cpu
    device_name: str
    dtype: str  # dtype of the calibration profile
    alpha: dict[str, float]  # op class -> measured / roofline throughput time
    beta: float  # measured / sheet per-kernel launch overhead
    fit_mape_pct: dict[str, float]  # how well the fitted model reproduces the local measurements, per class

    def predict_ms(self, c: Census, op_class: str, spec: HardwareSpec, dtype: str) -> float:
        thr, launch = terms_s(c, spec, dtype)
        beta = self.beta if spec.kind == self.kind else 1.0  # see the module docstring
        return 1e3 * (self.alpha[op_class] * thr + beta * launch)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["alpha"] = {k: round(v, 4) for k, v in self.alpha.items()}
        d["beta"] = round(self.beta, 4)
        d["fit_mape_pct"] = {k: round(v, 2) for k, v in self.fit_mape_pct.items()}
        return d


def fit_calibration(profile: Profile, local_spec: HardwareSpec) -> Calibration:
    """Fit alpha per op class and beta on a measured profile whose tables carry censuses."""
    classes = sorted(set(OP_CLASS.values()))
    rows, ys, cls_of = [], [], []
    for table_name, op_class in OP_CLASS.items():
        table = profile.tables.get(table_name)
        for p in table.points() if table is not None else ():
            if p not in table.census or table.ms[p] <= 0:
                continue
            thr, launch = terms_s(table.census[p], local_spec, profile.dtype)
            row = np.zeros(len(classes) + 1)
            row[classes.index(op_class)] = thr * 1e3
            row[-1] = launch * 1e3
            rows.append(row)
            ys.append(table.ms[p])
            cls_of.append(op_class)
    if not rows:
        raise ValueError("the calibration profile has no census data; re-measure it with this version")
    a, y = np.array(rows), np.array(ys)
    w = 1.0 / y  # relative errors: small ops count as much as a 1 s prefill
    x = nnls(a * w[:, None], y * w)
    pred = a @ x
    fit = {c: float(np.mean([abs(pred[i] - y[i]) / y[i] for i in range(len(y)) if cls_of[i] == c]) * 100)
           for c in classes if c in cls_of}
    alpha = {c: float(x[i]) for i, c in enumerate(classes)}
    for c in classes:  # a class without data (or fitted to 0) keeps the plain roofline
        if c not in cls_of or alpha[c] <= 0:
            alpha[c] = 1.0
    return Calibration(hardware=profile.hardware, kind=local_spec.kind, device_name=str(profile.device.get("name")), dtype=profile.dtype,
                       alpha=alpha, beta=float(x[-1]), fit_mape_pct=fit)
