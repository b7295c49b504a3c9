"""RoomyLayer (decode/targets/kv_cache.py): the eager target cache that appends in place, equal to transformers'
DynamicLayer after every operation the decoding loop does, and decoding through it bit for bit the same."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_prompt, tiny_target
from transformers.cache_utils import DynamicLayer

from decode.targets import kv_cache
from decode.targets.kv_cache import DEFAULT_ROOM, RoomyLayer, roomy_cache


def _states(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 3, n, 8, generator=g), torch.randn(1, 3, n, 5, generator=g)  # value dim != key dim


def _same(a, b) -> None:
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_roomy_layer_equals_dynamic_layer_through_appends_commits_crops_and_growth():
    plain, roomy = DynamicLayer(), RoomyLayer(room=4)
    for step, n in enumerate([7, 1, 3, 1, 5, 2, 9, 1]):  # room 4: several appends outgrow the buffers
        k, v = _states(n, step)
        out_p, out_r = plain.update(k, v), roomy.update(k, v)
        assert torch.equal(out_p[0], out_r[0]) and torch.equal(out_p[1], out_r[1])
        _same(plain, roomy)
        if n > 2:  # TargetModel.keep: move the accepted tentative entries in place, then cut to the path
            past, src = plain.get_seq_length() - n, torch.tensor([1, 2]) + plain.get_seq_length() - n
            for layer in (plain, roomy):
                layer.keys[..., past:past + 2, :] = layer.keys.index_select(-2, src)
                layer.values[..., past:past + 2, :] = layer.values.index_select(-2, src)
                layer.keys, layer.values = layer.keys[..., :past + 2, :], layer.values[..., :past + 2, :]
            _same(plain, roomy)
        if step == 5:
            plain.crop(-3)
            roomy.crop(-3)
            _same(plain, roomy)
    assert roomy.get_seq_length() == plain.get_seq_length()


def test_roomy_layer_appends_without_copying_the_committed_entries():
    layer = RoomyLayer(room=16)
    layer.update(*_states(10, 0))
    first = layer.keys.data_ptr()
    committed = layer.keys.clone()
    for step in range(16):  # within the room: every append writes into the same buffer
        layer.update(*_states(1, step + 1))
        assert layer.keys.data_ptr() == first and layer.values.shape[-2] == 11 + step
    assert torch.equal(layer.keys[..., :10, :], committed)
    layer.update(*_states(1, 99))  # past the room: one move to larger buffers, the entries kept
    assert layer.keys.data_ptr() != first and layer.keys.shape[-2] == 27
    assert torch.equal(layer.keys[..., :10, :], committed)
    layer.keys = layer.keys.clone()  # replaced by a tensor that is not a view of the buffers: the next append moves
    kept = layer.keys.clone()
    layer.update(*_states(2, 100))
    assert torch.equal(layer.keys[..., :27, :], kept) and layer.keys.shape[-2] == 29


def test_eager_prefill_reserves_room_for_the_generation():
    target = tiny_target("tiny-llama")
    prompt = tiny_prompt(target)
    target.prefill(prompt, reserve=12)
    layers = target.cache.layers
    assert layers and all(isinstance(layer, RoomyLayer) for layer in layers)
    ptrs = [layer.keys.data_ptr() for layer in layers]
    for t in range(12):  # the reserved room: no layer moves
        target.step(5 + t)
    assert [layer.keys.data_ptr() for layer in layers] == ptrs
    assert all(layer.keys.shape[-2] == prompt.length + 12 for layer in layers)
    target.prefill(prompt)  # no reserve: the default room
    assert target.cache.layers[0]._kbuf.shape[-2] >= prompt.length + DEFAULT_ROOM


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3-text", "tiny-qwen2.5-vl"])
def test_decoding_through_the_roomy_cache_is_bitwise_the_cat_cache(name, monkeypatch):
    """Steps, a branching tree, keep of a moved path and more steps: the same logits bit for bit as with
    transformers' own DynamicCache (attention reads the same values, now as prefix views of the buffers)."""
    target = tiny_target(name)
    prompt = tiny_prompt(target)
    parents = torch.tensor([-1, 0, 0, 1, 2, 4])
    tokens = torch.tensor([7, 9, 11, 13, 15, 17])

    def run() -> list[torch.Tensor]:
        target.prefill(prompt, reserve=4)  # room 4: the tree and steps below outgrow it once
        out = [target.step(t).logits for t in (3, 4)]
        out.append(target.forward_tree(tokens, parents).logits)
        target.keep([0, 2, 4, 5], checked=True)
        out += [target.step(t).logits for t in (5, 6, 8)]
        return out

    roomy = run()
    monkeypatch.setattr(kv_cache, "ENABLED", False)  # VLM_DRAFT_NAS_ROOMY_KV=off: transformers' DynamicCache
    plain = run()
    assert not isinstance(target.cache.layers[0], RoomyLayer) and target.kv_cache() == "dynamic"
    for a, b in zip(roomy, plain, strict=True):
        assert torch.equal(a, b)


def test_roomy_cache_makes_roomy_layers_with_the_room_asked():
    cache = roomy_cache(7)
    cache.update(*_states(3, 0), layer_idx=0)
    cache.update(*_states(3, 1), layer_idx=1)
    assert [type(layer) for layer in cache.layers] == [RoomyLayer, RoomyLayer]
    assert cache.layers[1].room == 7 and cache.get_seq_length() == 3
