"""decode.runtime.small_rows: the few-row CPU linear path computes F.linear's values, and decoding stays lossless."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_prompt, tiny_target

from decode.drafts import make_draft
from decode.loop.speculative import speculative_generate
from decode.loop.vanilla import vanilla_generate
from decode.runtime import small_rows
from decode.runtime.small_rows import linear


@pytest.fixture
def forced(monkeypatch):
    """W @ x^T for every candidate call, whatever this machine measures."""
    monkeypatch.setattr(small_rows, "MODE", "on")


@pytest.mark.parametrize("out_features", [48, 576, 8200])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17])
def test_linear_matches_f_linear(rows, out_features, forced):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, 64, generator=g)
    b = torch.randn(out_features, generator=g)
    x = torch.randn(rows, 64, generator=g)
    for bias in (None, b):
        ref = torch.nn.functional.linear(x, w, bias)
        got = linear(x, w, bias)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    x3 = x.reshape(1, rows, 64)  # batched (1, n, in) input as HF layers give it
    torch.testing.assert_close(linear(x3, w), torch.nn.functional.linear(x3, w), rtol=1e-5, atol=1e-5)


def test_which_calls_take_the_new_path(monkeypatch, forced):
    calls = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    w = torch.randn(8200, 32)
    linear(torch.randn(3, 32), w)
    linear(torch.randn(1, 32), w)  # one row: two identical columns of W @ X, not MKL's one-core GEMV
    assert calls == []  # few rows: W @ x^T
    linear(torch.randn(3, 32, requires_grad=True), w)  # training: autograd through F.linear
    linear(torch.randn(3, 32, dtype=torch.float64), w.double())  # not float32
    linear(torch.randn(small_rows.SMALL_ROWS + 1, 32), w)  # prefill-sized
    monkeypatch.setattr(small_rows, "MODE", "off")
    linear(torch.randn(3, 32), w)
    linear(torch.randn(1, 32), w)
    assert len(calls) == 5


@pytest.mark.parametrize("slow", ["rows", "plain"])
def test_auto_mode_takes_the_product_measured_faster_once_per_shape(monkeypatch, slow):
    """auto: the first call of a shape times the products on its weight; the slower one is never taken
    for that shape again, and the timing is not repeated (torch's two products here; native in test_native_rows)."""
    import time

    from decode.runtime import native_rows

    monkeypatch.setattr(native_rows, "available", lambda: False)
    monkeypatch.setattr(small_rows, "MODE", "auto")
    monkeypatch.setattr(small_rows, "_CHOICE", {})
    monkeypatch.setattr(small_rows, "MAX_COPIES", 2)  # two weights per timing sample: the sleeps below stay short
    real_rows, real_plain = small_rows._rows_product, torch.nn.functional.linear
    if slow == "rows":
        monkeypatch.setattr(small_rows, "_rows_product", lambda x, w: time.sleep(0.002) or real_rows(x, w))
    else:
        monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: time.sleep(0.002) or real_plain(*a, **k))
    measured = []
    real_measure = small_rows._measure
    monkeypatch.setattr(small_rows, "_measure", lambda r, w: measured.append(r) or real_measure(r, w, reps=3))
    w, x = torch.randn(64, 32), torch.randn(3, 32)
    for _ in range(3):
        torch.testing.assert_close(linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    linear(torch.randn(2, 32), w)
    assert measured == [3, 2]  # once per (rows, in, out)
    expect = "wx" if slow == "plain" else "linear"
    assert small_rows.choices() == {"2x32->64": expect, "3x32->64": expect}


def test_timing_streams_the_weight_from_memory(monkeypatch):
    """Timed over one weight again and again, a weight stays in cache and the choice misleads for a whole model,
    whose weights outgrow every cache: each timing sample runs through COLD_BYTES of distinct clones."""
    monkeypatch.setattr(small_rows, "COLD_BYTES", 1 << 20)
    w = torch.randn(256, 64)  # 64 KiB
    copies = small_rows._cold_copies(w)
    assert len(copies) == 16 and copies[0] is w
    assert len({c.data_ptr() for c in copies}) == 16 and all(torch.equal(c, w) for c in copies)
    assert len(small_rows._cold_copies(torch.randn(1024, 1024))) == 1  # 4 MiB: itself is enough
    monkeypatch.setattr(small_rows, "MAX_COPIES", 4)
    assert len(small_rows._cold_copies(w)) == 4
    seen = []
    real = small_rows._rows_product
    monkeypatch.setattr(small_rows, "_rows_product", lambda x, wt: seen.append(wt.data_ptr()) or real(x, wt))
    monkeypatch.setattr(small_rows, "_products", lambda: {"linear": torch.nn.functional.linear,
                                                          "wx": small_rows._rows_product})
    small_rows._measure(2, w, reps=1)
    assert len(set(seen)) == 4  # every copy, not the same weight four times


def test_gradients_flow_as_with_f_linear():
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 4)
    linear(x, w).sum().backward()
    ref = w.grad.clone()
    w.grad = None
    torch.nn.functional.linear(x, w).sum().backward()
    assert torch.equal(w.grad, ref)


def test_targets_use_it_and_decoding_stays_lossless(monkeypatch, forced):
    target = tiny_target("tiny-llava")
    assert any(m.forward.__func__ is small_rows._forward for m in target.model.modules()
               if isinstance(m, torch.nn.Linear) and hasattr(m.forward, "__func__"))
    prompt = tiny_prompt(target)
    draft = make_draft("random:hybrid", target)
    fast = speculative_generate(target, draft, prompt, 24).tokens
    assert fast == vanilla_generate(target, prompt, 24).tokens
    monkeypatch.setattr(small_rows, "MODE", "off")
    assert vanilla_generate(target, prompt, 24).tokens == fast  # the same greedy text with torch's kernels


@pytest.mark.parametrize("faster", [True, False])
def test_compiled_graphs_take_the_product_measured_before_tracing(monkeypatch, faster):
    """(W @ x^T or F.linear here; the native kernel's operator in test_native_rows.)"""
    """Inside torch.compile no timing can run: measure_linears times a model's linears for a row count first and
    the traced graph holds the product it chose (W @ x^T or F.linear), with the same values."""
    monkeypatch.setattr(small_rows, "MODE", "auto")
    monkeypatch.setattr(small_rows, "_CHOICE", {})
    monkeypatch.setattr(small_rows, "_measure", lambda rows, w: "wx" if faster else "linear")
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 16, bias=False))
    small_rows.use_small_rows(model)
    assert small_rows.measure_linears(model, 4) == 2 and small_rows.measure_linears(model, 4) == 0
    expect = "wx" if faster else "linear"
    assert small_rows.choices() == {"4x32->64": expect, "4x64->16": expect}
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(4, 32)
    with torch.no_grad():
        out = torch.compile(model, backend=keep_graph, dynamic=False)(x)
        torch.testing.assert_close(out, model[1](model[0](x)), rtol=1e-5, atol=1e-5)
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert any("linear" in o for o in ops) != faster
    assert any("matmul" in o for o in ops) == faster
    torch._dynamo.reset()


@pytest.mark.parametrize("spec", ["random:concat", "random:cross+lookup"])
def test_warm_up_chooses_every_kernel_before_the_timed_runs(monkeypatch, spec):
    """Chosen lazily, a kernel choice was timed inside a timed generation (~0.1-0.2 s each on the default target):
    the bench's warm-up measures every few-row shape of the draft's networks (1..SMALL_ROWS rows) and of the
    target (up to the largest tree), so a timed generation afterwards measures nothing."""
    from decode.benchio import Method, make_policy, warm_up
    from decode.loop.sampling import SamplingConfig

    monkeypatch.setattr(small_rows, "MODE", "auto")
    monkeypatch.setattr(small_rows, "_CHOICE", {})
    timed = []
    monkeypatch.setattr(small_rows, "_measure", lambda rows, w: timed.append(rows) or ("wx" if rows % 2 else "linear"))
    target = tiny_target("tiny-llava")
    draft = make_draft(spec, target)
    policy = make_policy(draft, None, {})
    methods = [Method.vanilla(), Method(draft.name, draft, policy)]
    prompt = tiny_prompt(target)
    warm_up(target, prompt, methods, 16, SamplingConfig())
    net = draft.networks()[0]
    shapes = {(w.shape[1], w.shape[0]) for w in (m.weight for m in net.modules() if type(m) is torch.nn.Linear)}
    assert {(r, i, o) for r in range(1, small_rows.SMALL_ROWS + 1) for i, o in shapes} <= set(small_rows._CHOICE)
    head = target.lm_head.weight
    tree_rows = range(1, min(draft.max_nodes(policy), small_rows.SMALL_ROWS) + 1)
    assert all((r, head.shape[1], head.shape[0]) in small_rows._CHOICE for r in tree_rows)
    timed.clear()
    for other in ("Tell me a story about the sea.", "one two three one two three"):
        speculative_generate(target, draft, tiny_prompt(target, other), 16, policy=policy)
    assert timed == []


def _fresh_process(monkeypatch, mode: str = "auto") -> None:
    """What a new process starts with: no choices in memory, none adopted from a table yet."""
    monkeypatch.setattr(small_rows, "MODE", mode)
    monkeypatch.setattr(small_rows, "_CHOICE", {})
    monkeypatch.setattr(small_rows, "_TABLE_KEY", None)


def test_a_choice_is_measured_once_per_machine_and_every_later_process_takes_it(monkeypatch, tmp_path):
    """Timed per process, near-ties flipped between processes, and the profile priced a step with other kernels than
    the bench ran: the first measurement is kept in the machine's table and a later process adopts it untimed,
    even where its own timing would have said otherwise."""
    from decode.runtime import kernel_table

    table = tmp_path / "kernels.json"
    monkeypatch.setenv(kernel_table.ENV, str(table))
    w, x = torch.randn(64, 32), torch.randn(3, 32)
    timed = []
    _fresh_process(monkeypatch)
    monkeypatch.setattr(small_rows, "_measure", lambda rows, weight: timed.append(rows) or "wx")
    torch.testing.assert_close(linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    assert timed == [3] and small_rows.table_file() == str(table)
    saved = json.loads(table.read_text())
    assert saved["format"] == kernel_table.FORMAT and saved["choices"] == {"3x32->64": "wx"}
    assert saved["machine"] == kernel_table.machine_key(small_rows.rule())

    _fresh_process(monkeypatch)  # a second process, whose own timing would pick F.linear
    monkeypatch.setattr(small_rows, "_measure", lambda rows, weight: timed.append(rows) or "linear")
    linear(x, w)
    assert small_rows.choices() == {"3x32->64": "wx"} and timed == [3]  # adopted, not timed again
    linear(torch.randn(2, 32), w)  # a new shape is timed and added beside the first
    assert timed == [3, 2]
    assert json.loads(table.read_text())["choices"] == {"2x32->64": "linear", "3x32->64": "wx"}


def test_the_table_is_per_machine_and_a_broken_file_is_measured_again(monkeypatch, tmp_path, caplog):
    from decode.runtime import kernel_table

    table = tmp_path / "kernels.json"
    monkeypatch.setenv(kernel_table.ENV, str(table))
    key = kernel_table.machine_key(small_rows.rule())
    other = key.replace(f"threads={torch.get_num_threads()}", f"threads={torch.get_num_threads() + 1}")
    for content in (json.dumps({"format": kernel_table.FORMAT, "machine": other, "choices": {"3x32->64": "wx"}}),
                    "{not json", json.dumps([1, 2]), "",
                    json.dumps({"format": kernel_table.FORMAT, "machine": key, "choices": {"3x32->64": True}})):
        table.write_text(content)
        _fresh_process(monkeypatch)
        monkeypatch.setattr(small_rows, "_measure", lambda rows, weight: "linear")
        with caplog.at_level("WARNING"):
            linear(torch.randn(3, 32), torch.randn(64, 32))
        assert small_rows.choices() == {"3x32->64": "linear"}  # measured here, not the other machine's answer
        assert json.loads(table.read_text())["machine"] == key  # and the file rewritten for this machine
    assert "ignoring the kernel choice table" in caplog.text


def test_choices_made_under_another_thread_count_are_dropped(monkeypatch, tmp_path):
    from decode.runtime import kernel_table

    monkeypatch.setenv(kernel_table.ENV, "off")
    _fresh_process(monkeypatch)
    assert small_rows.table_file() is None
    monkeypatch.setattr(small_rows, "_measure", lambda rows, weight: "wx")
    w = torch.randn(64, 32)
    linear(torch.randn(3, 32), w)
    assert small_rows.choices() == {"3x32->64": "wx"}
    monkeypatch.setattr(small_rows, "_measure", lambda rows, weight: "linear")
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        linear(torch.randn(3, 32), w)  # still the first answer: the cached choice is not re-checked per call
        small_rows.measure_linears(torch.nn.Linear(32, 64), 3)  # a warm-up re-reads the machine's key
        assert small_rows.choices() == {"3x32->64": "linear"}
    finally:
        torch.set_num_threads(threads)


def test_an_unwritable_table_costs_only_the_persistence(monkeypatch, tmp_path, caplog):
    from decode.runtime import kernel_table

    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv(kernel_table.ENV, str(blocker / "kernels.json"))  # a folder that cannot be made
    _fresh_process(monkeypatch)
    monkeypatch.setattr(small_rows, "_measure", lambda rows, weight: "wx")
    x, w = torch.randn(2, 32), torch.randn(48, 32)
    with caplog.at_level("WARNING"):
        torch.testing.assert_close(linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    assert small_rows.choices() == {"2x32->48": "wx"}
    assert "could not keep the kernel choices" in caplog.text
