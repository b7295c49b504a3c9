"""hwprofile units without timing: device identity, spec sheets, tables, census, roofline and its calibration."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_target

from decode.errors import UserError
from hwprofile.census import Census, count
from hwprofile.device import HARDWARE_NAMES, canonical_name, local_device, memory_variant
from hwprofile.roofline import OP_CLASS, fit_calibration, nnls, roofline_ms, terms_s
from hwprofile.schema import TABLE_AXES, Profile
from hwprofile.specs import HardwareSpec, known_hardware, load_spec
from hwprofile.tables import Table


# ---------------------------------------------------------------- device identity and spec sheets
@pytest.mark.parametrize("name, canonical", [
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100-PCIE-40GB", "a100"), ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200"), ("NVIDIA H100 NVL", "h100"), ("NVIDIA L4", "l4"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
])
def test_canonical_names(name, canonical):
    assert canonical_name(name) == canonical


def test_similar_names_are_not_confused():
    assert canonical_name("NVIDIA L40S") != "l4"
    assert canonical_name("NVIDIA GeForce RTX 4080").startswith("gpu-")
    assert canonical_name("anything", kind="cpu") == "cpu"
    assert memory_variant("a100", 40 * 2**30) == "40gb" and memory_variant("a100", 80 * 2**30) == "80gb"
    assert memory_variant("h100", 80 * 2**30) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_local_device_without_gpu_is_cpu():
    info = local_device()  # pynvml raises NVMLError without a GPU: must be caught, not crash
    assert info.hardware == "cpu" and info.kind == "cpu"
    assert info.cpu_cores >= 1 and info.cpu_model and info.torch_threads >= 1
    assert info.to_dict()["hardware"] == "cpu"


def _fake_pynvml(unsupported: set[str], handles: dict[str, str]):
    """A stand-in pynvml module: GPUs by UUID/index, and some NVML calls unsupported on this "board"."""
    import types

    class NVMLError(Exception):
        pass

    def call(name, value):
        def fn(*_args):
            if name in unsupported:
                raise NVMLError(f"{name}: Not Supported")
            return value
        return fn

    def by_uuid(uuid):
        if uuid not in handles:
            raise NVMLError("Not Found")
        return handles[uuid]

    m = types.ModuleType("pynvml")
    m.NVMLError, m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM = NVMLError, 1, 2
    m.nvmlInit = m.nvmlShutdown = call("init", None)
    m.nvmlDeviceGetHandleByUUID = by_uuid
    m.nvmlDeviceGetHandleByIndex = lambda i: f"index-{i}"
    m.nvmlDeviceGetName = lambda h: f"NVIDIA H200 ({h})".encode()  # older bindings return bytes
    m.nvmlDeviceGetMemoryInfo = call("memory", types.SimpleNamespace(total=141 * 2**30))
    m.nvmlSystemGetDriverVersion = call("driver", "580.65")
    m.nvmlDeviceGetMaxClockInfo = call("clock", 1980)
    m.nvmlDeviceGetPowerManagementLimit = call("power", 700_000)
    return m


def test_nvml_fields_survive_unsupported_fields_and_missing_pynvml(monkeypatch):
    import sys

    from hwprofile.device import _nvml_fields

    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml({"power", "memory"}, {"GPU-abc": "uuid-abc"}))
    out = _nvml_fields(0, "abc")  # torch's UUID has no "GPU-" prefix; NVML's has
    assert out["name"] == "NVIDIA H200 (uuid-abc)" and canonical_name(out["name"]) == "h200"
    assert out["driver"] == "580.65" and out["sm_clock_mhz"] == 1980
    assert "power_limit_w" not in out and "memory_bytes" not in out  # unsupported: left out, not fatal
    assert _nvml_fields(3, "unknown")["name"] == "NVIDIA H200 (index-3)"  # UUID not found: by index
    assert _nvml_fields(2, None)["name"] == "NVIDIA H200 (index-2)"  # no UUID from torch: by index
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml({"init"}, {}))
    assert _nvml_fields(0) == {}  # no driver / library
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import raises ImportError
    assert _nvml_fields(0) == {}


def test_every_canonical_name_has_a_sheet():
    assert set(HARDWARE_NAMES) <= set(known_hardware())
    for name in HARDWARE_NAMES:
        spec = load_spec(name)
        assert spec.name == name
        assert all(spec.flops_for(d) > 0 for d in ("fp32", "bf16", "fp16"))
        assert spec.memory_bandwidth > 0 and spec.memory_bytes > 0 and spec.launch_overhead_s > 0
    h200 = load_spec("h200")
    assert h200.memory_bandwidth == pytest.approx(4.8e12) and h200.flops_for(torch.bfloat16) == pytest.approx(989.4e12)
    assert load_spec("a100", "40gb").memory_bandwidth < load_spec("a100").memory_bandwidth


def test_unknown_sheet_is_a_user_error():
    with pytest.raises(UserError, match="known: .*h200"):
        load_spec("tpu-v9")


# ---------------------------------------------------------------- tables
def _table() -> Table:
    t = Table(("n", "ctx"))
    for n in (1, 4, 16):
        for ctx in (128, 512):
            t.put((n, ctx), 10.0 + n * (1 + ctx / 512))
    return t


def test_table_returns_grid_points_exactly_and_interpolates_monotonically():
    t = Table.from_json(_table().to_json())  # through JSON, as a profile file
    for (n, ctx), ms in t.ms.items():
        assert t.lookup(n=n, ctx=ctx) == ms
    ys = [t.lookup(n=n, ctx=300) for n in np.linspace(1, 16, 61)]
    assert all(b >= a for a, b in zip(ys, ys[1:]))
    assert t.lookup(n=1, ctx=128) <= t.lookup(n=2.5, ctx=128) <= t.lookup(n=4, ctx=128)
    assert t.lookup(n=0.1, ctx=10) >= 0.0  # extrapolation never goes below zero


def test_incomplete_table_is_detected():
    t = _table()
    del t.ms[(4, 512)]
    with pytest.raises(ValueError, match="misses"):
        t.check_complete()


# ---------------------------------------------------------------- census
def test_census_counts_linear_flops_and_kernels():
    lin = torch.nn.Linear(32, 64, bias=False)
    x = torch.randn(5, 32)
    c = count(lambda: torch.relu(lin(x)))
    assert c.flops == 2 * 5 * 32 * 64
    assert c.kernels == 2  # mm + relu (the weight transpose is a view: free)
    assert c.float_elems >= 32 * 64 + 5 * 32 + 5 * 64


# ---------------------------------------------------------------- roofline
def _spec(flops: float = 1e12, bw: float = 1e11, launch: float = 0.0, kind: str = "cuda") -> HardwareSpec:
    return HardwareSpec(name="x", kind=kind, description="", peak_flops={"fp32": flops, "bf16": flops, "fp16": flops},
                        memory_bandwidth=bw, memory_bytes=1e10, launch_overhead_s=launch)


def test_memory_bound_op_scales_with_bandwidth():
    op = Census(flops=1e6, float_elems=1e9, other_bytes=0, kernels=1)  # 1 FLOP per 4 bytes: memory-bound
    t1, t2 = roofline_ms(op, _spec(bw=1e11), "fp32"), roofline_ms(op, _spec(bw=2e11), "fp32")
    assert t1 == pytest.approx(2 * t2)
    assert roofline_ms(op, _spec(flops=4e12), "fp32") == pytest.approx(t1)  # more FLOP/s does not help
    assert roofline_ms(op, _spec(), "bf16") == pytest.approx(t1 / 2)  # half the bytes per element


def test_compute_bound_op_scales_with_flops():
    op = Census(flops=1e12, float_elems=1e6, other_bytes=0, kernels=1)
    t1, t2 = roofline_ms(op, _spec(flops=1e12), "fp32"), roofline_ms(op, _spec(flops=4e12), "fp32")
    assert t1 == pytest.approx(4 * t2)
    assert roofline_ms(op, _spec(bw=1e12), "fp32") == pytest.approx(t1)


def test_launch_term_counts_kernels():
    op = Census(flops=0, float_elems=0, other_bytes=0, kernels=100)
    assert roofline_ms(op, _spec(launch=10e-6), "fp32") == pytest.approx(1.0)


def test_nnls_recovers_nonnegative_solution():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert np.allclose(nnls(a, np.array([2.0, 3.0, 5.0])), [2.0, 3.0], atol=1e-6)
    assert nnls(a, np.array([-1.0, 2.0, 1.0]))[0] == 0.0


def _synthetic_profile(local: HardwareSpec, alpha: dict[str, float], beta: float) -> Profile:
    rng = np.random.default_rng(0)
    tables = {}
    for name, axes in TABLE_AXES.items():
        t = Table(axes)
        for i in range(6):
            c = Census(flops=float(rng.uniform(1e6, 1e10)), float_elems=float(rng.uniform(1e4, 1e8)), other_bytes=0.0,
                       kernels=int(rng.integers(1, 2000)))
            point = tuple([i] + [0] * (len(axes) - 1))
            if name in OP_CLASS:
                thr, launch = terms_s(c, local, "fp32")
                t.put(point, 1e3 * (alpha[OP_CLASS[name]] * thr + beta * launch), c)
            else:
                t.put(point, 1.0)
        tables[name] = t
    return Profile(hardware="cpu", predicted=False, device={"name": "test"}, versions={}, dtype="float32",
                   runtime="eager", date="", command="", target={"name": "t", "vocab_size": 10}, space={}, config={},
                   grids={"default_context": 0}, tables=tables)


def test_calibration_recovers_ratios_and_transfers_by_kind():
    local = _spec(flops=1e11, bw=1e10, launch=5e-6, kind="cpu")
    alpha = {c: a for c, a in zip(sorted(set(OP_CLASS.values())), (2.0, 3.0, 1.5, 4.0, 2.5))}
    cal = fit_calibration(_synthetic_profile(local, alpha, beta=0.5), local)
    for c, a in alpha.items():
        assert cal.alpha[c] == pytest.approx(a, rel=1e-3)
    assert cal.beta == pytest.approx(0.5, rel=1e-3)
    op = Census(flops=0.0, float_elems=0.0, other_bytes=0.0, kernels=1000)  # launch-bound
    gpu = _spec(launch=15e-6, kind="cuda")
    assert cal.predict_ms(op, "target", gpu, "bf16") == pytest.approx(15.0)  # CPU beta does not carry to a GPU
    assert cal.predict_ms(op, "target", local, "fp32") == pytest.approx(0.5 * 5.0)


@pytest.mark.parametrize("space_name", ["default", "compact"])
def test_cpu_grid_measures_small_trees_exactly_and_interpolates_large_ones(space_name):
    """Every tree size of the space up to 32 tokens is a verify grid point (small-N CPU cost is not smooth);
    above that powers of two bracket the largest tree, and nothing beyond the first one that holds it."""
    from decode.space import SearchSpace
    from hwprofile.config import default_grids, space_tree_sizes

    space = SearchSpace.load(space_name)
    sizes = space_tree_sizes(space)
    grid = set(default_grids("cpu", space).verify_tokens)
    assert {n for n in sizes if n <= 32} <= grid
    assert max(grid) >= max(sizes) and max(grid) < 2 * max(sizes)
    assert all(n <= 32 or n & (n - 1) == 0 for n in grid)  # above 32: powers of two only
    cuda = set(default_grids("cuda", space).verify_tokens)
    assert sizes <= cuda  # GPUs keep every tree size
    assert max(cuda) < 2 * max(sizes)  # and no compiled-runtime bucket beyond the one that holds the largest tree


def test_small_verifies_are_timed_apart_from_large_ones(monkeypatch):
    """Round-robin with 32-64 token verifies between them, a step and the 2-5 token verifies ran 15-30% slower and
    unevenly (a profile priced a 2-token verify below a step): the step and verifies of up to SMALL_VERIFY tokens
    are timed among themselves, the large verifies in their own round-robin, and every case is timed once."""
    from hwprofile import bench_target
    from hwprofile.config import Grids
    from hwprofile.timing import Stat, Timer

    target = tiny_target("tiny-llama")
    groups = []

    def fake_run(cases, timer, cfg, desc, progress):
        groups.append([c.key for c in cases])
        return {c.key: Stat(ms=1.0, iqr_ms=0.0, n=1) for c in cases}

    monkeypatch.setattr(bench_target, "run_cases", fake_run)
    grids = Grids(contexts=(16, 32), verify_tokens=(1, 2, 8, 9, 32), widths=(1,), default_context=16)
    tables = bench_target.measure_target(target, grids, Timer(torch.device("cpu")), progress=False, with_census=False)
    small, large = groups[1:] if len(groups) == 3 else groups  # (the prefill's own round-robin comes first)
    assert {k[0] for k in small} == {"step", "verify"} and all(k[0] == "step" or k[1] <= 8 for k in small)
    assert all(k[0] == "verify" and k[1] > 8 for k in large)
    assert sorted(small + large) == sorted([("step", c) for c in (16, 32)] + [
        ("verify", n, c) for c in (16, 32) for n in (1, 2, 8, 9, 32)])
    assert set(tables["verify"].ms) == {(n, c) for c in (16, 32) for n in (1, 2, 8, 9, 32)}


def test_overhead_probe_on_the_compiled_runtime_compiles_nothing():
    """The probe's timed component wrappers must run eagerly: inside a compiled level graph dynamo recompiled them
    per probe, and the compiled profile priced 4.5 ms of bogus overhead per cycle (0.2 ms eager)."""
    from conftest import single_thread, tiny_target

    from decode.runtime.compiled import graph_count
    from decode.space import SearchSpace
    from hwprofile.bench_overhead import _Probe, probe_arch
    from hwprofile.cycle import synthetic_prompt
    from hwprofile.tables import Table
    from hwprofile.timing import Timer

    target = tiny_target("tiny-llama")
    scorer = Table(("n",))
    for n in (1, 2):
        scorer.put((n,), 0.0)
    with single_thread():
        try:
            target.use_runtime("compiled")
            prompt = synthetic_prompt(target, 32)
            pre = target.prefill(prompt, feature_layers=(-1,))
            before = graph_count()
            probe = _Probe(target, probe_arch(SearchSpace.load("tiny"), 2, 2), prompt, pre, Timer(target.device), scorer)
            for _ in range(3):
                probe.overhead_ms()
        finally:
            target.use_runtime("eager")
    assert graph_count() == before
    assert probe.inside_ms > 0  # the components were timed in place
