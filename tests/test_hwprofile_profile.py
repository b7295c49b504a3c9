"""hwprofile.profile on a tiny target (--quick, CPU): the profile file, the predictor, refusals, --predict."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import single_thread

from decode.arch import DraftArch
from decode.errors import UserError
from decode.runtime import small_rows
from hwprofile.latency import LatencyModel, tree_tokens
from hwprofile.profile import main as profile_main
from hwprofile.schema import TABLE_AXES, Profile


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A quick measured profile of tiny-llama on this CPU (one thread), through the CLI."""
    out = tmp_path_factory.mktemp("prof") / "cpu-tiny-llama.json"
    with single_thread():
        assert profile_main(["--target", "tiny-llama", "--quick", "--threads", "1", "--out", str(out)]) == 0
    return out


def test_measured_profile_is_complete(measured):
    raw = json.loads(measured.read_text())
    assert raw["predicted"] is False and raw["hardware"] == "cpu" and raw["runtime"] == "eager"
    assert raw["dtype"] == "float32" and raw["versions"]["torch"] and raw["versions"]["transformers"]
    assert raw["target"]["name"] == "tiny-llama" and raw["target"]["fingerprint"]["family"]
    assert raw["device"]["hardware"] == "cpu" and raw["config"]["quick"] is True
    assert measured.stat().st_size < 1_000_000
    # the few-row kernels each shape took while measuring: a run that chose others decodes at other costs
    rows = raw["small_rows"]
    assert rows["mode"] in small_rows.MODES and isinstance(rows["choices"], dict)
    if rows["mode"] == "auto":
        assert any(key.startswith("1x") for key in rows["choices"])  # the decoding step's one-row shapes
    assert Profile.load(measured).small_rows == rows
    assert measured.with_suffix(".png").stat().st_size > 0
    prof = Profile.load(measured)
    for name, axes in TABLE_AXES.items():
        assert prof.tables[name].axes == axes and prof.tables[name].ms
        assert all(ms >= 0 for ms in prof.tables[name].ms.values())
        if name != "overhead":
            prof.tables[name].check_complete()
            assert all(p in prof.tables[name].census for p in prof.tables[name].ms)


def test_predictor_reproduces_grid_points_exactly(measured):
    prof = Profile.load(measured)
    m = LatencyModel(prof)
    for (n, ctx), ms in prof.tables["verify"].ms.items():
        assert m.verify_ms(n, ctx) == ms
    for (ctx,), ms in prof.tables["target_step"].ms.items():
        assert m.target_step_ms(ctx) == ms
    for name, table in prof.tables.items():
        for point, ms in table.ms.items():
            assert table.lookup(**dict(zip(table.axes, point))) == ms


def test_predictor_interpolates_monotonically_between_grid_points(measured):
    m = LatencyModel(Profile.load(measured))
    verify = m.profile.tables["verify"]
    ns, ctxs = verify.grid("n"), verify.grid("ctx")
    for ctx in ctxs:
        for a, b in zip(ns, ns[1:]):
            ys = [m.verify_ms(n, ctx) for n in np.linspace(a, b, 9)]
            lo, hi = sorted((verify.ms[(a, ctx)], verify.ms[(b, ctx)]))
            assert all(lo - 1e-9 <= y <= hi + 1e-9 for y in ys)
            assert ys == sorted(ys) or ys == sorted(ys, reverse=True)
    mid = (ctxs[0] + ctxs[1]) / 2
    lo, hi = sorted((m.verify_ms(4, ctxs[0]), m.verify_ms(4, ctxs[1])))
    assert lo <= m.verify_ms(4, mid) <= hi


def test_cycle_is_draft_plus_verify_plus_overhead(measured):
    m = LatencyModel(Profile.load(measured))
    arch = DraftArch(fusion="hybrid", feature_layers=(-1, 1), depth=2, heads=(2, 4), ffn=(64, 128), draft_vocab=64,
                     tree_depth=3, top_k=2, total_tokens=8)
    parts = m.breakdown(arch, accepted=2.0, context=40)
    assert parts["total"] == pytest.approx(m.draft_cycle_ms(arch, 2.0, 40) + m.verify_ms(tree_tokens(arch), 40)
                                           + m.overhead_ms(arch))
    assert m.cycle_ms(arch, 2.0, 40) == pytest.approx(parts["total"])
    assert tree_tokens(arch) == 9
    shallow = DraftArch(fusion="hybrid", feature_layers=(-1, 1), depth=1, heads=(2,), ffn=(64,), draft_vocab=64,
                        tree_depth=3, top_k=2, total_tokens=8)
    assert m.draft_cycle_ms(shallow, 2.0, 40) < m.draft_cycle_ms(arch, 2.0, 40)
    assert m.speedup(arch, tau=2.0, context=40) > 0


def test_other_hardware_without_predict_is_refused(capsys):
    from decode.cli import run_cli

    with pytest.raises(SystemExit) as exit_info:
        run_cli(profile_main, ["--hardware", "h200", "--target", "tiny-llama", "--quick"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "--predict" in err and "\n" not in err


def test_unknown_hardware_is_refused():
    with pytest.raises(UserError, match="unknown hardware"):
        profile_main(["--hardware", "tpu", "--target", "tiny-llama", "--quick", "--predict"])


def test_predict_writes_a_predicted_profile_latency_model_reads(measured, tmp_path):
    out = tmp_path / "h200-tiny-llama.json"  # the autouse one_thread fixture restores the thread count
    assert profile_main(["--hardware", "h200", "--target", "tiny-llama", "--quick", "--predict", "--threads", "1",
                         "--calibration", str(measured), "--out", str(out), "--no-plot"]) == 0
    prof = Profile.load(out)
    assert prof.predicted is True and prof.hardware == "h200" and prof.dtype == "bfloat16"
    assert prof.calibrated_from["hardware"] == "cpu" and prof.spec["name"] == "h200"
    assert prof.target["fingerprint"] == Profile.load(measured).target["fingerprint"]
    m = LatencyModel(prof)
    arch = DraftArch(fusion="concat", feature_layers=(-1,), depth=1, heads=(4,), ffn=(128,), draft_vocab=None,
                     tree_depth=3, top_k=3, total_tokens=8)
    assert m.cycle_ms(arch) > 0 and m.target_step_ms() > 0
    assert m.verify_ms(1) <= m.verify_ms(8)
