"""The sample-efficiency levers of supernet training: drafts started from the target's layers, batched
self-distilled answers, the top-k candidate loss, no wasted steps."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import single_thread, tiny_target

import supernet.data as data_mod
from decode.arch import DraftArch
from decode.datasets import PromptItem
from decode.drafts.from_target import expand_kv_rows, init_from_target, source_layer
from decode.drafts.model import DraftModel, TargetDims
from decode.errors import UserError
from decode.loop.batched import batch_greedy
from decode.loop.vanilla import vanilla_generate
from decode.space import SearchSpace
from supernet.data import DataConfig, build_sequence
from supernet.elastic import DraftSupernet
from supernet.unroll import LossConfig, subnet_losses, target_kl, topk_ce

# ---------------------------------------------------------------- start from the target

@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_draft_layer_started_from_target_computes_the_target_layer(name):
    target = tiny_target(name)
    cfg = target.text_config
    dims = TargetDims.of(target)
    arch = DraftArch(fusion="concat", feature_layers=(-1,), depth=1, heads=(cfg.num_attention_heads,),
                     ffn=(cfg.intermediate_size,))
    draft = DraftModel(arch, dims).attach(target)
    src = init_from_target(draft, target)
    assert src == target.num_layers - 1  # feature layer -1: the last decoder layer
    t_layer = target.decoder.layers[src]
    q_heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    assert kv_heads < q_heads  # the tiny targets use grouped KV heads: the expansion is exercised
    mine = draft.layers[0]
    assert torch.equal(mine.attn.q_proj.weight, t_layer.self_attn.q_proj.weight)
    assert torch.equal(mine.mlp.down_proj.weight, t_layer.mlp.down_proj.weight)
    k = t_layer.self_attn.k_proj.weight.view(kv_heads, dims.head_dim, -1)
    for h in range(q_heads):  # query head h reads KV head h // group
        rows = mine.attn.k_proj.weight[h * dims.head_dim: (h + 1) * dims.head_dim]
        assert torch.equal(rows, k[h // (q_heads // kv_heads)])
    # and the layer computes what the target's layer computes (same rotary base, same causal attention)
    n = 6
    x = torch.randn(1, n, dims.hidden_size, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    out = t_layer(x, attention_mask=mask, position_ids=pos, position_embeddings=target.decoder.rotary_emb(x, pos))
    out = out[0] if isinstance(out, tuple) else out
    mine_out, _ = mine(x[0], pos[0], torch.ones(n, n, dtype=torch.bool).tril(), None, dims.rope_theta)
    torch.testing.assert_close(mine_out, out[0], rtol=1e-5, atol=1e-5)
    # identity fusion on request: the layer input is embed(token) + the target feature
    init_from_target(draft, target, fusion=True)
    feat = torch.randn(3, dims.hidden_size)
    torch.testing.assert_close(draft.project_features(feat), feat)


def test_source_layer_and_kv_expansion():
    assert source_layer(30, (-1,)) == 29
    assert source_layer(30, (8, 16)) == 16  # hidden state 16 feeds decoder layer 16
    w = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2 * 3, 4)  # 2 KV heads of dim 3
    e = expand_kv_rows(w, q_heads=4, kv_heads=2, head_dim=3)
    assert torch.equal(e, torch.cat([w[:3], w[:3], w[3:], w[3:]]))
    with pytest.raises(UserError):
        expand_kv_rows(w, q_heads=3, kv_heads=2, head_dim=3)


def test_narrower_subnets_take_importance_ordered_slices_of_the_target_layer():
    target = tiny_target("tiny-llama")
    space = SearchSpace.load("tiny")
    net = DraftSupernet(space, TargetDims.of(target), 1).attach(target)
    init_from_target(net, target, feature_layers=(-1,))
    t_layer = target.decoder.layers[target.num_layers - 1]
    d = net.dims.head_dim
    o = t_layer.self_attn.o_proj.weight
    head_order = o.view(o.shape[0], -1, d).norm(dim=(0, 2)).argsort(descending=True)
    chan_order = t_layer.mlp.down_proj.weight.norm(dim=0).argsort(descending=True)
    net.reorder_by_importance()
    arch = replace(net.space.smallest(1), fusion="concat", feature_layers=(-1,), depth=1, heads=(2,), ffn=(32,))
    sub = net.extract(arch)
    q = t_layer.self_attn.q_proj.weight.view(-1, d, o.shape[0])
    assert torch.equal(sub.layers[0].attn.q_proj.weight, q[head_order[:2]].reshape(2 * d, -1))
    assert torch.equal(sub.layers[0].mlp.gate_proj.weight, t_layer.mlp.gate_proj.weight[chan_order[:32]])
    assert torch.equal(sub.layers[0].mlp.down_proj.weight, t_layer.mlp.down_proj.weight[:, chan_order[:32]])


# ---------------------------------------------------------------- batched self-distilled answers

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Hi", "List three colours and a fruit."]


def test_batched_answers_equal_one_at_a_time():
    with single_thread():
        target = tiny_target("tiny-llama")
        prompts = [target.build_prompt(t) for t in PROMPTS]
        assert len({p.length for p in prompts}) > 1  # padding is exercised
        budgets = [12, 7, 12, 3]
        batched = batch_greedy(target, prompts, budgets)
        for p, n, got in zip(prompts, budgets, batched):
            assert got == vanilla_generate(target, p, n).tokens


def test_heldout_data_refuses_a_batched_answer_that_is_not_the_greedy_continuation(tmp_path, monkeypatch):
    """Held-out data may be regenerated in batches, but an answer the target's own forward disagrees with
    (here: one token of one answer flipped, as a padded batch can do on a near tie) is refused and
    generated again alone: every stored continuation is the target's greedy one."""
    import decode.loop.batched as regen_mod
    from supernet.dataset import FeatureData

    target = tiny_target("tiny-llama")
    real = regen_mod.batch_greedy
    flipped: list[list[int]] = []

    def corrupt(tgt, prompts, max_new):
        answers = real(tgt, prompts, max_new)
        if not flipped:  # the first answer of the first batch gets a wrong second token
            answers[0] = answers[0][:1] + [(answers[0][1] + 1) % tgt.vocab_size] + answers[0][2:]
            flipped.append(answers[0])
        return answers

    monkeypatch.setattr(regen_mod, "batch_greedy", corrupt)
    cfg = DataConfig(target="tiny-llama", split="heldout", prompts="sharegpt:4", space="tiny", mode="regenerate",
                     max_len=64, max_new_tokens=10, topk=8, regen_batch=4, shard_size=4, out=str(tmp_path / "h"),
                     entropy_layer=1)  # given, as the pipeline does: no calibration builds answers one at a time
    with single_thread():
        data_mod.build_data(cfg, target=target)
        data = FeatureData(tmp_path / "h", target)
        manifest = data.manifest
        assert len(manifest["regen_refused"]) == 1  # the corrupted answer only: the other three were kept
        items = {i.id: i for i in data_mod.load_prompts(cfg, target.is_vlm, target.name)}
        for k, sid in enumerate(data.ids):
            seq = data[k]
            assert data_mod.is_greedy_fixed_point(seq)
            full, plen = build_sequence(target, items[sid], replace(cfg, regen_batch=1))  # one at a time
            assert seq["input_ids"].tolist() == full.input_ids[0].tolist() and int(seq["prompt_len"]) == plen
    assert flipped and flipped[0] not in [data[k]["input_ids"].tolist()[int(data[k]["prompt_len"]):]
                                          for k in range(len(data))]


def test_regenerated_batch_sequences_match_one_at_a_time():
    target = tiny_target("tiny-llama")
    items = [PromptItem(f"sharegpt:x{i}", t, None, None) for i, t in enumerate(PROMPTS)]
    cfg = DataConfig(target="tiny-llama", mode="regenerate", max_len=64, max_new_tokens=10, regen_batch=3)
    with single_thread():
        answers = data_mod.regenerate_batched(target, items, cfg)
        assert set(answers) == {i.id for i in items}
        for item in items:
            full, plen = build_sequence(target, item, replace(cfg, regen_batch=1))
            assert full.input_ids[0, plen:].tolist() == answers[item.id]


def test_long_prompt_keeps_its_tail_and_room_for_the_answer():
    target = tiny_target("tiny-llama")
    item = PromptItem("sharegpt:long", "word " * 200, None, "a short answer that is long enough to fill it")
    cfg = DataConfig(target="tiny-llama", mode="teacher", max_len=64, min_answer=16)
    full, plen = build_sequence(target, item, cfg)
    assert full.length == 64 and plen == 64 - 16  # min_answer answer tokens kept
    whole_cfg = replace(cfg, min_answer=0)  # off: the prompt fills max_len, nothing to train (held-out data)
    assert build_sequence(target, item, whole_cfg)[1] == 64
    whole = target.build_prompt(item.text)
    assert full.input_ids[0, :plen].tolist() == whole.input_ids[0, -plen:].tolist()


# ---------------------------------------------------------------- the loss

def _tiny_supernet(target):
    space = SearchSpace.load("tiny")
    torch.manual_seed(0)
    return DraftSupernet(space, TargetDims.of(target), 1, torch.arange(target.vocab_size)).attach(
        target, init_head=True).float()


def _sequence(target, topk: int) -> dict:
    item = PromptItem("sharegpt:seq", "Tell me about the sea and the sky.", None, "It is blue, wide and deep.")
    cfg = DataConfig(target=target.name, mode="teacher", max_len=64, topk=topk, space="tiny", entropy_layer=1)
    return data_mod.features_on_the_fly(target, item, cfg)


def _feat(net, seq) -> torch.Tensor:
    """The feature-regression part of a one-step loss (weight 0.2 included by the caller)."""
    _, stats = subnet_losses(net, seq, LossConfig(unroll=1, answer_only=False, loss="full", kl_weight=0.0))
    return torch.tensor(stats["loss"]) / 0.2


@pytest.mark.parametrize("vocab", [None, 128])
def test_topk_loss_equals_full_loss_over_the_whole_vocabulary(vocab):
    """With the stored top-k covering the vocabulary (and every position scored), the candidate loss is
    the full-vocabulary loss, for the target's head and for a hot-token head."""
    target = tiny_target("tiny-llama")
    net = _tiny_supernet(target)
    arch = replace(net.space.largest(1), draft_vocab=vocab, fusion="concat")
    net.set_active(arch)
    seq = _sequence(target, topk=target.vocab_size)
    full_cfg = LossConfig(unroll=2, answer_only=False, loss="full")
    topk_cfg = replace(full_cfg, loss="topk", full_positions=0)
    full, fs = subnet_losses(net, seq, full_cfg)
    mine, ms = subnet_losses(net, seq, topk_cfg, negatives=torch.arange(40))  # all duplicates of the top-k
    torch.testing.assert_close(mine, full, rtol=1e-5, atol=1e-5)
    assert fs["acc0"] == pytest.approx(ms["acc0"]) and fs["n0"] == ms["n0"] > 0
    # the full-vocabulary anchor on a few positions adds exactly its own term
    anchored, _ = subnet_losses(net, seq, replace(topk_cfg, full_positions=10 ** 6, unroll=1), negatives=torch.arange(40))
    plain, _ = subnet_losses(net, seq, replace(topk_cfg, unroll=1), negatives=torch.arange(40))
    torch.testing.assert_close(anchored, 2 * plain - 0.2 * _feat(net, seq), rtol=1e-4, atol=1e-4)


def test_candidate_loss_pieces():
    target = tiny_target("tiny-llama")
    net = _tiny_supernet(target)
    h = torch.randn(5, net.dims.hidden_size)
    ids = torch.randint(0, target.vocab_size, (5, 4))
    neg = torch.tensor([3, 9, 11])
    got = net.logits_at(h, ids, neg)  # (5, 7)
    full = net.logits(h)
    torch.testing.assert_close(got[:, :4], full.gather(1, ids))
    torch.testing.assert_close(got[:, 4:], full[:, neg])
    # the candidate CE only sees the K + M columns; with a single candidate the draft is always right
    ce, kl = topk_ce(got[:, :1], torch.zeros(5, 1), torch.zeros(5))
    assert torch.allclose(ce, torch.zeros(5)) and torch.allclose(kl, torch.zeros(5))
    # target_kl and topk_ce agree when the candidates are the whole vocabulary
    all_ids = torch.arange(target.vocab_size)[None].expand(5, -1)
    t_logits = torch.randn(5, target.vocab_size)
    lse = torch.logsumexp(t_logits, -1)
    ce1, _ = target_kl(full, all_ids, t_logits, lse)
    ce2, _ = topk_ce(net.logits_at(h, all_ids), t_logits, lse)
    torch.testing.assert_close(ce1, ce2)


def test_scored_positions_counts_answer_positions(tmp_path, monkeypatch):
    items = [PromptItem("sharegpt:a", "Say something nice about the sea.", None, "The sea is wide and calm today."),
             PromptItem("sharegpt:b", "word " * 100, None, "short")]
    monkeypatch.setattr(data_mod, "parse_prompt_spec", lambda *a, **k: list(items))
    target = tiny_target("tiny-llama")
    cfg = DataConfig(target="tiny-llama", mode="teacher", max_len=48, min_answer=4, topk=4, space="tiny",
                     shard_size=1, entropy_layer=1, out=str(tmp_path / "d"))
    with single_thread():
        data_mod.build_data(cfg, target=target)
    from supernet.dataset import FeatureData

    data = FeatureData(tmp_path / "d", target)
    counts = data.scored_positions(answer_only=True)
    for i, n in enumerate(counts):
        seq = data[i]
        start = int(seq["prompt_len"]) - 1
        assert n == int(seq["loss_mask"][start:].sum()) > 0  # the long prompt kept room for its answer
    assert data.scored_positions(answer_only=False)[0] == int(data[0]["loss_mask"].sum())


def test_progressive_schedule_opens_depth_then_everything():
    from supernet.train import TrainConfig, sandwich

    target = tiny_target("tiny-llama")
    net = DraftSupernet(SearchSpace.load("tiny"), TargetDims.of(target), 1)
    cfg = TrainConfig(target="t", data="d", out="o", steps=30, n_random=2, schedule="progressive")
    largest = net.space.largest(1)
    assert sandwich(net, 0, cfg) == [("largest", largest)]  # first third: the largest alone
    mid = sandwich(net, 15, cfg)
    assert mid[0] == ("largest", largest) and len(mid) == 4
    for _, arch in mid[1:]:  # elastic depth at the largest widths
        assert arch.heads == largest.heads[: arch.depth] and arch.ffn == largest.ffn[: arch.depth]
    late = sandwich(net, 25, cfg)
    assert [r for r, _ in late] == ["largest", "smallest", "random0", "random1"]
    assert sandwich(net, 0, TrainConfig(target="t", data="d", out="o", n_random=1))[1][0] == "smallest"
    timed = replace(cfg, steps=100_000, time_budget_s=90.0)  # a time-budgeted run: the phases follow its clock
    assert len(sandwich(net, 3, timed, elapsed_s=10.0)) == 1
    mid = sandwich(net, 3, timed, elapsed_s=45.0)
    assert len(mid) == 4 and mid[1][0] == "depth0"
    assert sandwich(net, 3, timed, elapsed_s=80.0)[1][0] == "smallest"


def test_eagle_role_trains_the_eagle_like_default_every_or_every_other_step():
    """eagle_role puts the space's EAGLE-like default (neither its largest nor its smallest) into the sandwich: a
    fourth pass every step (extra), or in place of the first random subnet on odd steps (alternate); the random
    draws of the other roles stay those of the plain sandwich."""
    from supernet.train import TrainConfig, build_parser, config_from_args, sandwich

    target = tiny_target("tiny-llama")
    net = DraftSupernet(SearchSpace.load("tiny"), TargetDims.of(target), 1)
    eagle = net.space.eagle_like(1)
    assert eagle not in (net.space.largest(1), net.space.smallest(1))
    base = TrainConfig(target="t", data="d", out="o", n_random=2)
    plain = [sandwich(net, s, base) for s in range(4)]
    extra = [sandwich(net, s, replace(base, eagle_role="extra")) for s in range(4)]
    alternate = [sandwich(net, s, replace(base, eagle_role="alternate")) for s in range(4)]
    assert all(e == p + [("eagle", eagle)] for e, p in zip(extra, plain, strict=True))
    assert alternate[0] == plain[0] and alternate[2] == plain[2]
    for s in (1, 3):
        assert alternate[s] == plain[s][:2] + plain[s][3:] + [("eagle", eagle)]
    one_random = replace(base, n_random=0, eagle_role="alternate")  # no random subnet to replace: an extra pass
    assert sandwich(net, 1, one_random)[-1] == ("eagle", eagle) and len(sandwich(net, 0, one_random)) == 2
    with pytest.raises(UserError, match="--eagle-role must be one of off, extra, alternate"):
        config_from_args(build_parser().parse_args(["--target", "t", "--data", "d", "--eagle-role", "always"]))


def test_demo_scale_trains_the_largest_the_smallest_and_the_eagle_like_default_every_step():
    """At demo scale (a few hundred steps) each step's three passes go to the three subnets the search scores first:
    no random subnet, the EAGLE-like default every step (README, "Which subnets a demo step trains")."""
    from supernet.train import TrainConfig, sandwich, scale_defaults

    demo = scale_defaults("demo", "train")
    cfg = TrainConfig(target="t", data="d", out="o", n_random=demo["n_random"], eagle_role=demo["eagle_role"])
    net = DraftSupernet(SearchSpace.load("tiny"), TargetDims.of(tiny_target("tiny-llama")), 1)
    space = net.space
    for step in range(4):
        assert sandwich(net, step, cfg) == [("largest", space.largest(1)), ("smallest", space.smallest(1)),
                                            ("eagle", space.eagle_like(1))]


def test_repeated_sandwich_networks_train_once_with_the_same_gradient():
    """A one-network space (largest = smallest = sample, as space eagle) used to run three identical forward and
    backward passes per step; distinct_roles merges them into one pass weighted by its count, which must give the
    gradient of the three passes."""
    from supernet.train import TrainConfig, distinct_roles, sandwich

    target = tiny_target("tiny-llama")
    one = replace(SearchSpace.load("tiny"), fusion=("concat",), feature_layers=((-1,),), depth=(1,), heads=(2,),
                  ffn=(64,), draft_vocab=(None,), visual_keep=(1.0,))
    net = DraftSupernet(one, TargetDims.of(target), None).attach(target)
    net.float()
    roles = sandwich(net, 5, TrainConfig(target="t", data="d", out="o", n_random=1))
    assert len(roles) == 3 and len({a.tree for _, a in roles}) > 1  # the sample differs only in its tree
    merged = distinct_roles(roles)
    assert [(r, n) for r, _, n in merged] == [("largest", 3)]
    wide = distinct_roles(sandwich(DraftSupernet(SearchSpace.load("tiny"), TargetDims.of(target), 1), 5,
                                   TrainConfig(target="t", data="d", out="o", n_random=2)))
    assert [n for _, _, n in wide][:2] == [1, 1]  # largest and smallest of a real space stay separate

    torch.manual_seed(0)
    t = 12
    seq = {"input_ids": torch.randint(0, target.vocab_size, (t,)), "image_mask": torch.zeros(t, dtype=torch.bool),
           "attn_received": torch.zeros(t), "loss_mask": torch.ones(t, dtype=torch.bool), "prompt_len": torch.tensor(4),
           "hidden": {target.num_layers: torch.randn(t, target.hidden_size)}}
    logits = torch.randn(t, target.vocab_size)
    seq["topk_logits"], seq["topk_ids"] = logits.topk(8)
    seq["lse"] = logits.logsumexp(-1)
    cfg = LossConfig(unroll=2, loss="full")

    def grads(passes: list[float]) -> list[torch.Tensor]:
        net.zero_grad(set_to_none=True)
        for w in passes:
            net.set_active(roles[0][1])
            loss, _ = subnet_losses(net, seq, cfg)
            (loss * w).backward()
        return [p.grad.clone() for p in net.parameters() if p.grad is not None]

    for a, b in zip(grads([1 / 3, 1 / 3, 1 / 3]), grads([3 / 3]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_feature_noise_is_bounded_seeded_and_leaves_the_regression_target_alone():
    from supernet.unroll import noisy
    x = torch.randn(6, 16) * torch.arange(1, 7)[:, None]  # rows of different scale
    assert noisy(x, 0.0, 3) is x
    a = noisy(x, 0.1, 3)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    assert bool(((a - x).abs() <= 0.1 * rms + 1e-6).all()) and not torch.equal(a, x)
    torch.testing.assert_close(a, noisy(x, 0.1, 3))
    assert not torch.equal(a, noisy(x, 0.1, 4))
    # in the loss: the same seed gives the same noisy loss, another seed another one, and the stored target
    # features (also the regression target) are left as they were
    target = tiny_target("tiny-llama")
    net = _tiny_supernet(target)
    net.set_active(replace(net.space.largest(1), fusion="concat"))
    seq = _sequence(target, topk=8)
    before = {k: v.clone() for k, v in seq["hidden"].items()}
    cfg = LossConfig(unroll=2, answer_only=False, loss="full")
    clean, _ = subnet_losses(net, seq, cfg, seed=5)
    n1, _ = subnet_losses(net, seq, replace(cfg, feat_noise=0.5), seed=5)
    n2, _ = subnet_losses(net, seq, replace(cfg, feat_noise=0.5), seed=5)
    n3, _ = subnet_losses(net, seq, replace(cfg, feat_noise=0.5), seed=6)
    n1, n2, n3, clean = (float(x.detach()) for x in (n1, n2, n3, clean))
    assert n1 == n2 and n1 != clean and n1 != n3
    assert all(torch.equal(before[k], seq["hidden"][k]) for k in before)
    with pytest.raises(ValueError, match="feat_noise"):
        LossConfig(feat_noise=-1.0)
