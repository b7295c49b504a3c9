"""DraftArch JSON round trip, DraftModel save/load, wrong-target and corrupted-checkpoint errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_prompt, tiny_target
from decode.arch import DraftArch
from decode.draft_model import WEIGHTS_NAME, DraftModel, TargetDims
from decode.drafts import NeuralDraft, make_draft, random_arch
from decode.errors import UserError
from decode.speculative import speculative_generate


def test_arch_json_round_trip_and_validation():
    arch = DraftArch(fusion="hybrid", feature_layers=[-1, 2, 5], depth=2, heads=[4, 2], ffn=[128, 64],
                     draft_vocab=100, visual_keep=0.5, tree_depth=3, top_k=2, total_tokens=6)
    again = DraftArch.from_json(arch.to_json())
    assert again == arch and hash(again) == hash(arch)
    assert json.loads(arch.to_json())["feature_layers"] == [-1, 2, 5]
    for bad in (dict(fusion="sum"), dict(depth=2), dict(visual_keep=0.0), dict(total_tokens=0), dict(top_k=0),
                dict(feature_layers=[]), dict(draft_vocab=1)):
        with pytest.raises(UserError):
            DraftArch(**bad)
    with pytest.raises(UserError, match="unknown DraftArch fields"):
        DraftArch.from_dict({"fusion": "concat", "width": 3})


@pytest.mark.parametrize("fusion", ["concat", "cross", "hybrid"])
def test_save_load_round_trip_decodes_identically(tmp_path, fusion):
    target = tiny_target("tiny-llava")
    torch.manual_seed(1)
    arch = random_arch(target, fusion, draft_vocab=120, feature_layers=(-1, 1), depth=2, heads=(2, 4), ffn=(32, 64))
    d2t = torch.randperm(target.vocab_size)[:120]
    model = DraftModel(arch, TargetDims.of(target), d2t=d2t).attach(target, init_head=True).eval()
    model.save_pretrained(tmp_path / "d", target, metadata={"note": "test"})
    state = load_file(str(tmp_path / "d" / WEIGHTS_NAME))
    assert not any("embed" in k for k in state)  # the target's embedding is shared, not saved
    loaded = DraftModel.from_pretrained(tmp_path / "d", target)
    assert loaded.arch == arch and loaded.metadata == {"note": "test"}
    assert torch.equal(loaded.d2t, d2t)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    prompt = tiny_prompt(target)
    a = speculative_generate(target, NeuralDraft(model), prompt, 10)
    b = speculative_generate(target, make_draft(str(tmp_path / "d"), target), prompt, 10)
    assert a.tokens == b.tokens and a.accept_hist == b.accept_hist and a.tree_sizes == b.tree_sizes


def test_loading_onto_another_target_is_a_clear_error(tmp_path):
    target = tiny_target("tiny-llava")
    DraftModel(random_arch(target), TargetDims.of(target)).attach(target).save_pretrained(tmp_path / "d", target)
    other = tiny_target("tiny-llama")
    with pytest.raises(UserError, match="was made for target 'tiny-llava', not 'tiny-llama'"):
        DraftModel.from_pretrained(tmp_path / "d", other)


def test_corrupted_or_missing_checkpoint(tmp_path):
    target = tiny_target("tiny-llama")
    with pytest.raises(UserError, match="not a draft checkpoint"):
        DraftModel.from_pretrained(tmp_path, target)
    DraftModel(random_arch(target), TargetDims.of(target)).attach(target).save_pretrained(tmp_path / "d", target)
    state = load_file(str(tmp_path / "d" / WEIGHTS_NAME))
    state.pop(next(k for k in state if k.startswith("layers.0.mlp")))
    save_file(state, str(tmp_path / "d" / WEIGHTS_NAME))
    with pytest.raises(UserError, match="do not match"):
        DraftModel.from_pretrained(tmp_path / "d", target)


def test_bad_draft_specs():
    target = tiny_target("tiny-llama")
    for spec in ("eagle", "layerskip:0", f"layerskip:{target.num_layers}", "layerskip:x", "random:sum"):
        with pytest.raises(UserError):
            make_draft(spec, target)
    with pytest.raises(UserError, match="exceeds the target vocabulary"):
        DraftModel(random_arch(target, draft_vocab=10**6), TargetDims.of(target))
    with pytest.raises(UserError, match="does not exist"):
        DraftModel(random_arch(target, feature_layers=(99,)), TargetDims.of(target))
