"""decode.runtime.native_rows: the native few-row linear kernel computes F.linear's values, a row's result is bitwise
the same alone or among other rows (and for any thread count), bfloat16 weights give the float32 path's bits on the
widened weight (drafts packed for CPU decoding, decode/drafts/pack.py), both vector builds (AVX-512, AVX2) agree,
and decoding through it stays lossless on both runtimes. CI machines are x86-64 with g++: there the kernel must
build, so these tests fail (not skip) when it does not."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from conftest import tiny_prompt, tiny_target

from decode.drafts import make_draft
from decode.loop.speculative import speculative_generate
from decode.loop.vanilla import vanilla_generate
from decode.runtime import native_rows, small_rows

pytestmark = pytest.mark.skipif(native_rows.unavailable_reason() is not None,
                                reason=f"native kernel not possible here: {native_rows.unavailable_reason()}")


@pytest.fixture
def native(monkeypatch):
    """The native kernel for every few-row call."""
    assert native_rows.available(), "the kernel did not build on a machine that has a compiler and AVX2"
    monkeypatch.setattr(small_rows, "MODE", "native")


def _check_rows(product, n_in: int, n_out: int, rows: int) -> None:
    g = torch.Generator().manual_seed(n_in * 7 + n_out + rows)
    w = torch.randn(n_out, n_in, generator=g)
    x = torch.randn(rows, n_in, generator=g)
    y = product(x, w)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5 + 1e-7 * n_in)  # fp32 sums
    alone = torch.cat([product(x[i:i + 1], w) for i in range(rows)])
    assert torch.equal(y, alone)  # bitwise: a vanilla step and a tree verification see the same row values


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 25, 40])
@pytest.mark.parametrize("n_in,n_out", [(64, 48), (37, 3), (576, 1), (1536, 576), (23, 8200)])
def test_values_and_bitwise_row_independence(rows, n_in, n_out):
    assert native_rows.available()
    _check_rows(native_rows.rows_linear, n_in, n_out, rows)


@pytest.mark.parametrize("rows", [1, 4, 5])
def test_the_thread_count_does_not_change_a_bit(rows):
    """The threads' blocks of weight rows, and so which rows fall in a tile of R rows and which are left over, change
    with the thread count: not one bit may."""
    x, w = torch.randn(rows, 576), torch.randn(1001, 576)
    threads = torch.get_num_threads()
    ref = native_rows.rows_linear(x, w)
    try:
        for n in (1, 3, 4):
            torch.set_num_threads(n)
            assert torch.equal(native_rows.rows_linear(x, w), ref)
    finally:
        torch.set_num_threads(threads)


def test_the_avx2_build_agrees(tmp_path):
    """Machines without AVX-512 get the 8-lane build: compiled here with AVX-512 switched off, it must give the same
    guarantees."""
    path = tmp_path / "rows-avx2.so"
    native_rows._build(path, native_rows.FLAGS + ("-mno-avx512f",))
    lib = native_rows.load(path)
    assert lib.vlm_rows_lanes() == 8

    def product(x, w):
        y = torch.empty(x.shape[0], w.shape[0])
        assert lib.vlm_rows_linear(x.data_ptr(), w.data_ptr(), y.data_ptr(), *x.shape, w.shape[0], 2) == 0
        return y

    for rows, n_in, n_out in [(1, 37, 5), (3, 40, 7), (4, 64, 48), (6, 64, 9), (9, 576, 130)]:
        _check_rows(product, n_in, n_out, rows)
        _check_bf16(_bf16_product(lib), product, rows, n_in, n_out)


def _bf16_product(lib):
    def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], w.shape[0])
        assert lib.vlm_rows_linear_bf16(x.data_ptr(), w.data_ptr(), y.data_ptr(), *x.shape, w.shape[0], 2) == 0
        return y
    return product


def _check_bf16(product, float_product, rows: int, n_in: int, n_out: int) -> None:
    g = torch.Generator().manual_seed(rows * 31 + n_in + n_out)
    w = torch.randn(n_out, n_in, generator=g).bfloat16()
    x = torch.randn(rows, n_in, generator=g)
    y = product(x, w)
    # the widened weight through the float32 kernel: the same multiply-adds in the same order, so the same bits
    assert torch.equal(y, float_product(x, w.float()))
    torch.testing.assert_close(y, x @ w.float().T, rtol=1e-5, atol=1e-5 + 1e-7 * n_in)
    alone = torch.cat([product(x[i:i + 1], w) for i in range(rows)])
    assert torch.equal(y, alone)  # a row's values do not depend on the other rows


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 12, 13])
@pytest.mark.parametrize("n_in,n_out", [(64, 48), (37, 3), (576, 16384 // 8), (1536, 7)])
def test_bf16_weights_are_the_float32_kernel_on_the_widened_weight(rows, n_in, n_out):
    assert native_rows.available(), "the kernel did not build on a machine that has a compiler and AVX2"
    _check_bf16(native_rows.rows_linear, native_rows.rows_linear, rows, n_in, n_out)


def test_a_failed_build_falls_back_to_torch(monkeypatch, tmp_path, caplog):
    from decode.runtime import kernel_table

    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("VLM_DRAFT_NAS_CACHE", str(tmp_path))
    monkeypatch.setenv(kernel_table.ENV, "off")
    native_rows._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert not native_rows.available()
        assert "could not be built" in caplog.text
        monkeypatch.setattr(small_rows, "MODE", "native")  # asked for, not there: W @ x^T
        x, w = torch.randn(3, 32), torch.randn(48, 32)
        torch.testing.assert_close(small_rows.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
        monkeypatch.setenv(native_rows.ENV, "off")
        assert native_rows.unavailable_reason() == f"{native_rows.ENV}=off"
    finally:
        native_rows._library.cache_clear()


def test_auto_mode_takes_the_native_kernel_where_it_is_faster(monkeypatch):
    monkeypatch.setattr(small_rows, "MODE", "auto")
    monkeypatch.setattr(small_rows, "_CHOICE", {})
    monkeypatch.setattr(small_rows, "MAX_COPIES", 2)
    slow = {name: (lambda f: lambda x, w: time.sleep(0.002) or f(x, w))(f)
            for name, f in small_rows._products().items() if name != "native"}
    monkeypatch.setattr(small_rows, "_products", lambda: {**slow, "native": native_rows.rows_linear})
    assert small_rows._measure(3, torch.randn(64, 32), reps=3) == "native"


def test_decoding_through_it_is_lossless(native):
    target = tiny_target("tiny-llava")
    prompt = tiny_prompt(target)
    draft = make_draft("random:cross+lookup", target)
    ref = vanilla_generate(target, prompt, 24).tokens
    assert speculative_generate(target, draft, prompt, 24).tokens == ref


def test_compiled_graphs_call_it_as_an_operator(native):
    """Inside torch.compile the kernel is the vlm_draft_nas::rows_linear operator, not traced into; same values."""
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 16, bias=False))
    small_rows.use_small_rows(model)
    torch._dynamo.reset()
    x = torch.randn(4, 32)
    try:
        with torch.no_grad():
            out = torch.compile(model, backend=keep_graph, dynamic=False)(x)
            assert torch.equal(out, model(x))
        ops = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
        assert sum("rows_linear" in o for o in ops) == 2 and not any("linear.default" == o for o in ops)
    finally:
        torch._dynamo.reset()


def test_the_compiled_runtime_stays_lossless_through_it(native):
    target = tiny_target("tiny-llava")
    prompt = tiny_prompt(target)
    draft = make_draft("random:concat", target)
    ref = vanilla_generate(target, prompt, 16).tokens
    target.use_runtime("compiled")
    try:
        assert vanilla_generate(target, prompt, 16).tokens == ref
        assert speculative_generate(target, draft, prompt, 16).tokens == ref
    finally:
        target.use_runtime("eager")
