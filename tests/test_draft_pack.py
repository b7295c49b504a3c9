"""Drafts packed for CPU decoding (decode/drafts/pack.py): bfloat16 linear weights read by the native kernel.

The kernel's own bfloat16 path is tested in tests/test_native_rows.py. Here: small_rows.linear takes float32 inputs
through bfloat16 weights for any row count; a loaded or random draft is packed (its own linears only, never the
target's shared embedding and head) unless VLM_DRAFT_NAS_DRAFT_WEIGHTS=fp32; decoding with a packed draft stays
lossless on both runtimes; CPU profiles record the format and a profile timed with the other one is stale."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_prompt, tiny_target

from decode.drafts import make_draft
from decode.drafts.model import DraftModel
from decode.drafts.pack import ENV, cpu_format, pack_for_decoding, weight_format
from decode.loop.speculative import speculative_generate
from decode.loop.vanilla import vanilla_generate
from decode.runtime import native_rows, small_rows

pytestmark = pytest.mark.skipif(native_rows.unavailable_reason() is not None,
                                reason=f"native kernel not possible here: {native_rows.unavailable_reason()}")


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 300])
def test_small_rows_linear_takes_bf16_weights_with_float32_inputs(rows):
    """Few rows go through the native kernel, more (a draft's first forward over a prompt) through F.linear on the
    widened weight: float32 out either way, the same values."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(40, 96, generator=g).bfloat16()
    bias = torch.randn(40, generator=g)
    x = torch.randn(1, rows, 96, generator=g)
    y = small_rows.linear(x, w, bias)
    assert y.dtype == torch.float32 and y.shape == (1, rows, 40)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w.float(), bias), rtol=1e-5, atol=1e-5)


def test_a_loaded_draft_is_packed_and_its_checkpoint_stays_float32(tmp_path, monkeypatch):
    target = tiny_target("tiny-llama")
    draft = make_draft("random:concat", target)
    model = draft.model
    assert weight_format(model) == "bf16"
    own = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert own and all(m.weight.dtype == torch.bfloat16 for m in own)
    assert model.norm.weight.dtype == torch.float32 and model.act_dtype == torch.float32
    # the target's shared embedding and LM head are the target's: never packed
    assert target.lm_head.weight.dtype == torch.float32
    assert target.decoder.embed_tokens.weight.dtype == torch.float32

    fresh = DraftModel(model.arch, model.dims).attach(target, init_head=True).eval()
    fresh.save_pretrained(tmp_path / "d", target)
    loaded = make_draft(str(tmp_path / "d"), target)
    assert weight_format(loaded.model) == "bf16"
    from safetensors.torch import load_file
    assert all(t.dtype != torch.bfloat16 for t in load_file(str(tmp_path / "d" / "model.safetensors")).values())
    # packing rounds each weight to bfloat16 and changes nothing else
    for (name, a), (_, b) in zip(fresh.named_parameters(), loaded.model.named_parameters()):
        assert torch.equal(a.to(b.dtype), b), name
    assert pack_for_decoding(loaded.model) == 0  # idempotent

    monkeypatch.setenv(ENV, "fp32")
    assert cpu_format() == "fp32"
    assert weight_format(make_draft(str(tmp_path / "d"), target).model) == "fp32"


@pytest.mark.parametrize("fusion", ["concat", "cross", "hybrid"])
def test_decoding_with_a_packed_draft_is_lossless(fusion):
    target = tiny_target("tiny-llama")
    prompt = tiny_prompt(target)
    ref = vanilla_generate(target, prompt, 24)
    draft = make_draft(f"random:{fusion}", target)
    assert weight_format(draft.model) == "bf16"
    assert speculative_generate(target, draft, prompt, 24).tokens == ref.tokens


def test_the_compiled_runtime_runs_packed_drafts_losslessly():
    target = tiny_target("tiny-llama")
    prompt = tiny_prompt(target)
    ref = vanilla_generate(target, prompt, 16)
    target.use_runtime("compiled")
    try:
        draft = make_draft("random:concat", target)
        assert weight_format(draft.model) == "bf16"
        for _ in range(2):  # the second generation runs the draft's compiled level graphs
            assert speculative_generate(target, draft, prompt, 16).tokens == ref.tokens
        assert draft.runner is not None and draft.runner.calls["compiled"] > 0
    finally:
        target.use_runtime("eager")


def test_a_cpu_profile_timed_with_the_other_draft_weights_is_stale(monkeypatch):
    from types import SimpleNamespace

    from nas.hardware import stale_kernels

    target = tiny_target("tiny-llama")
    versions = {"attention": target.attention_kernels(), "linear": small_rows.linear_kernels(),
                "draft_weights": "fp32"}
    profile = SimpleNamespace(predicted=False, device={"kind": "cpu"}, versions=versions, runtime="eager")
    assert "draft weights" in stale_kernels(profile, target)
    versions["draft_weights"] = cpu_format()
    assert stale_kernels(profile, target) is None
    # a compiled-runtime profile also names how its graphs were compiled (single-threaded inductor kernels on a CPU)
    compiled = SimpleNamespace(predicted=False, device={"kind": "cpu"}, versions=dict(versions), runtime="compiled")
    assert "compiled graphs" in stale_kernels(compiled, target)
    from decode.runtime.compiled import compile_tag
    compiled.versions["compiled"] = compile_tag("cpu")
    assert stale_kernels(compiled, target) is None
    assert "cpp.threads=1" in compile_tag("cpu") and "window" in compile_tag("cpu")
    monkeypatch.setenv(ENV, "fp32")
    assert "draft weights" in stale_kernels(profile, target)
