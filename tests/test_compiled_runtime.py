"""The compiled runtime (decode/runtime/compiled.py): static cache, padded trees, torch.compile (CPU inductor).

Greedy output must equal eager vanilla decoding token for token for every draft kind and tree kind; the
static cache after a speculative run must hold what a dynamic cache of eager decoding holds; and after the
warm-up no tree size compiles again. (Sampling exactness on this runtime: tests/test_speculative_sampling.py.)
"""

from __future__ import annotations

import pytest
import torch
from conftest import single_thread, tiny_prompt, tiny_target

from decode.arch import TreeSpec
from decode.drafts import LayerSkipDraft, MergedDraft, PromptLookupDraft, make_draft
from decode.loop.speculative import speculative_generate
from decode.loop.tree import DraftTree, TreePolicy
from decode.loop.vanilla import vanilla_generate
from decode.runtime.compiled import BUCKETS, GRAIN, bucket, cache_len, graph_count

TEXT = "the cat sat on the mat and the cat sat on the"


@pytest.fixture(autouse=True)
def _eager_afterwards():
    """tiny_target() objects are shared by the whole session: hand them back on the default runtime."""
    yield
    for name in ("tiny-llava", "tiny-gemma3-text", "tiny-llama"):
        tiny_target(name).use_runtime("eager")


def _drafts(target, text: list[int] | None = None):
    """(label, draft, policy): every draft kind, over dynamic, chain and static trees; with `text` (token ids) also
    a merged draft with corpus chains under its leaves, from a corpus of that text."""
    from decode.drafts import LookupSpec
    from decode.drafts.corpus import NgramCorpus

    concat = make_draft("random:concat", target)
    out = [
        ("prompt-lookup", PromptLookupDraft(), None),
        ("neural concat, dynamic", concat, TreePolicy(spec=TreeSpec(3, 3, 12))),
        ("neural cross, static", make_draft("random:cross", target), TreePolicy.parse("static:3,2", TreeSpec(2, 3, 9))),
        ("layerskip, chain", LayerSkipDraft(1), TreePolicy.parse("chain", TreeSpec(3, 1, 3))),
        ("neural + lookup", MergedDraft(concat), None),
    ]
    if text is not None:
        spec = LookupSpec(max_ngram=3, tree_depth=2, top_k=1, total_tokens=2, leaf_depth=3, leaf_count=3)
        out.append(("neural + lookup, leaf chains", MergedDraft(concat, spec, corpus=NgramCorpus.build(
            [text], target.vocab_size)), TreePolicy(spec=TreeSpec(2, 2, 4))))
    return out


# every draft and tree kind on a VLM; the target-side cases (sliding-window layers, softcapped logits) on Gemma 3
@pytest.mark.parametrize("family,kinds", [("tiny-llava", 6), ("tiny-gemma3-text", 2)])
def test_compiled_runtime_is_token_identical_for_every_draft_kind(family, kinds):
    target = tiny_target(family)
    prompt = tiny_prompt(target, TEXT)
    with single_thread():
        ref = vanilla_generate(target, prompt, 24).tokens
        target.use_runtime("compiled")
        assert vanilla_generate(target, prompt, 24).tokens == ref
        padded = 0
        for label, draft, policy in _drafts(target, prompt.input_ids[0].tolist() + ref)[:kinds]:
            res = speculative_generate(target, draft, prompt, 24, policy=policy)
            assert res.tokens == ref, label
            padded += sum(bucket(n) != n for n in res.tree_sizes)
    assert padded > 0  # trees ran with dummy nodes, and no token changed


def test_bucket_sizes():
    assert [bucket(n) for n in (1, 2, 3, 5, 6, 8, 9, 11, 60, 128, 129)] == [1, 2, 4, 5, 8, 8, 9, 12, 64, 128, 256]
    assert list(BUCKETS) == sorted(BUCKETS)


def test_static_cache_after_cycles_equals_the_dynamic_cache_of_vanilla_decoding():
    target = tiny_target("tiny-llava")
    prompt = tiny_prompt(target, TEXT)
    with single_thread():
        target.use_runtime("compiled")
        res = speculative_generate(target, PromptLookupDraft(), prompt, 20)
        assert res.cycles < len(res.tokens) - 1  # some cycles accepted drafted tokens (entries moved in place)
        n = target.seq_len
        static = [(k.clone(), v.clone()) for k, v in target.static.committed(target.num_layers, n)]
        target.use_runtime("eager")
        van = vanilla_generate(target, prompt, 20)
        assert van.tokens == res.tokens
        assert target.seq_len == n  # prompt + every emitted token but the last
        for (ks, vs), layer in zip(static, target.cache.layers):
            torch.testing.assert_close(ks, layer.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(vs, layer.values, rtol=1e-4, atol=1e-5)


def test_no_recompilation_after_warm_up():
    target = tiny_target("tiny-llava")
    draft = PromptLookupDraft()  # accepts 0..8 tokens a cycle on repetitive text: trees of every size up to 9
    policy = TreePolicy(spec=draft.default_tree)
    with single_thread():
        target.use_runtime("compiled")
        speculative_generate(target, draft, tiny_prompt(target, TEXT), 8, policy=policy)
        assert target.warm_buckets(draft.default_tree.total_tokens + 1, draft.feature_layers) == [1, 2, 4, 5, 8, 9]
        before = graph_count()
        cycles, accepted = 0, set()
        for text in (TEXT, "Once upon a time there was", "one two three one two three one two three one"):
            res = speculative_generate(target, draft, tiny_prompt(target, text), 30, policy=policy)
            cycles += res.cycles
            accepted |= set(res.accept_hist)
        assert cycles >= 20 and len(accepted) >= 2  # 20+ cycles with different accepted lengths
        assert graph_count() == before  # none of them compiled anything


def test_compiled_draft_levels_propose_the_eager_trees_and_do_not_recompile_after_warm_up():
    """The draft's compiled level steps (decode/runtime/draft_step.py) over its static buffers: the same trees,
    cycle by cycle, as its eager level forwards on a DraftKV, the same committed cache entries afterwards, and
    after `warm` no generation compiles anything. Hybrid fusion runs both the concat input and the cross memory."""
    target = tiny_target("tiny-llava")
    draft = make_draft("random:hybrid", target)
    policy = TreePolicy(spec=TreeSpec(2, 2, 4))
    prompt = tiny_prompt(target, TEXT)
    trees, caches, tokens = {}, {}, {}
    with single_thread():
        target.use_runtime("compiled")
        for compiled in (False, True):
            draft.compile_levels = compiled
            proposed, propose = [], draft.propose

            def record(*args, **kwargs):
                tree = propose(*args, **kwargs)
                proposed.append(tree.tokens.tolist())
                return tree

            draft.propose = record
            tokens[compiled] = speculative_generate(target, draft, prompt, 20, policy=policy).tokens
            del draft.propose
            trees[compiled] = proposed
            caches[compiled] = [(k.clone(), v.clone()) for k, v in draft.cache.kv]
        # depth 2: a root level and one more per tree, every one compiled but the first (the whole prompt)
        assert draft.runner.calls == {"compiled": 2 * len(trees[True]) - 1, "eager": 1}
        assert trees[True] == trees[False] and tokens[True] == tokens[False]
        for (ks, vs), (ke, ve) in zip(caches[True], caches[False]):
            torch.testing.assert_close(ks, ke, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(vs, ve, rtol=1e-4, atol=1e-5)
        assert draft.warm(policy) == [1, 2, 4]  # levels of top_k = 2 rows, a root level of up to depth + 2
        target.warm_buckets(draft.max_nodes(policy), draft.feature_layers)
        before = graph_count()
        for text in ("Once upon a time there was", "one two three one two three one"):
            speculative_generate(target, draft, tiny_prompt(target, text), 16, policy=policy)
        assert graph_count() == before


def test_bench_runs_every_method_on_both_runtimes_against_same_runtime_vanilla():
    from decode.bench import BenchConfig, format_table, run_bench
    from decode.datasets import PromptItem

    cfg = BenchConfig(target="tiny-llama", drafts=("prompt-lookup",), runtimes=("eager", "compiled"),
                      max_new_tokens=12, repeats=1, device="cpu")
    with single_thread():
        res = run_bench(cfg, prompts=[PromptItem("a", TEXT, None, None)])
    summary = {r["method"]: r for r in res["summary"]}
    assert list(summary) == ["vanilla", "vanilla@compiled", "prompt-lookup", "prompt-lookup@compiled"]
    assert summary["prompt-lookup@compiled"]["runtime"] == "compiled"
    assert summary["prompt-lookup@compiled"]["baseline"] == "vanilla@compiled"
    assert summary["prompt-lookup"]["baseline"] == "vanilla"
    assert summary["vanilla@compiled"]["baseline"] == "vanilla@compiled"
    for name in ("vanilla@compiled", "prompt-lookup", "prompt-lookup@compiled"):
        assert summary[name]["identical_rate"] == 1.0  # against eager vanilla, token for token
    row = next(r for r in res["per_prompt"] if r["method"] == "prompt-lookup@compiled")
    van = {r["method"]: r for r in res["per_prompt"]}
    assert row["speedup"] == pytest.approx(row["tokens_per_s"] / van["vanilla@compiled"]["tokens_per_s"])
    assert row["speedup_vs_eager"] == pytest.approx(row["tokens_per_s"] / van["vanilla"]["tokens_per_s"])
    assert "vs eager vanilla" in format_table(res["summary"])


def test_compiled_profile_records_its_runtime_and_search_refuses_a_profile_of_another(tmp_path):
    from decode.errors import UserError
    from hwprofile.profile import main as profile_main
    from hwprofile.schema import Profile, default_profile_path
    from nas.hardware import resolve_profile

    assert default_profile_path("cpu", "tiny-llama", tmp_path, "compiled").name == "cpu-tiny-llama-compiled.json"
    out = tmp_path / "p.json"
    with single_thread():
        assert profile_main(["--target", "tiny-llama", "--quick", "--threads", "1", "--runtime", "compiled",
                             "--no-plot", "--out", str(out)]) == 0
    prof = Profile.load(out)
    assert prof.runtime == "compiled" and prof.config["runtime"] == "compiled"
    assert prof.tables["verify"].ms and all(v > 0 for v in prof.tables["verify"].ms.values())
    target = tiny_target("tiny-llama")
    with pytest.raises(UserError, match="compiled runtime, not eager"):
        resolve_profile(target, None, str(out), [], tmp_path, runtime="eager")
    assert resolve_profile(target, None, str(out), [], tmp_path, runtime="compiled").path == out
    with pytest.raises(UserError, match="eager runtime only"):
        profile_main(["--hardware", "h200", "--target", "tiny-llama", "--quick", "--predict", "--runtime", "compiled"])


def test_compiled_prefill_equals_the_eager_one_and_fills_the_static_cache():
    """The compiled runtime prefills on a dynamic cache and copies it into the static one: the same logits,
    features and attention statistics as eager (computed over the prompt's keys, not the whole static cache),
    and the static cache's first T entries are the prompt's KV."""
    target = tiny_target("tiny-llava")
    prompt = tiny_prompt(target, TEXT)
    with single_thread():
        eager = target.prefill(prompt, feature_layers=(1, -1), attention_stats=True)
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in target.cache.layers]
        target.use_runtime("compiled")
        comp = target.prefill(prompt, feature_layers=(1, -1), attention_stats=True)
    t = prompt.length
    assert target.seq_len == t and target.static.max_len > t
    torch.testing.assert_close(comp.logits, eager.logits)
    for k in (1, -1):
        torch.testing.assert_close(comp.hidden[k], eager.hidden[k])
    assert comp.attn_received.shape == (t,)
    torch.testing.assert_close(comp.attn_received, eager.attn_received)
    torch.testing.assert_close(comp.attn_entropy, eager.attn_entropy)
    for (k, v), (ks, vs) in zip(kv, target.static.committed(target.num_layers, t)):
        assert torch.equal(ks, k) and torch.equal(vs, v)


def test_cpu_attention_reads_only_the_window_of_the_static_cache_without_recompiling():
    """On a CPU the tree forward's mask (and so the keys attention reads) spans past + bucket positions, not the
    whole static cache; the window's length is a dynamic dimension, so it grows every cycle without compiling."""
    target = tiny_target("tiny-llava")
    prompt = tiny_prompt(target, TEXT)
    with single_thread():
        target.use_runtime("compiled")
        runner = target.static
        assert runner.windowed
        vanilla_generate(target, prompt, 4)  # compiles the one-token graph
        seen = []
        inner = runner._compiled

        def spy(tokens, mask, positions, feature_layers):
            seen.append((mask.shape[-1], runner.length, tokens.shape[1]))
            return inner(tokens, mask, positions, feature_layers)

        runner._compiled = spy
        try:
            before = graph_count()
            res = vanilla_generate(target, prompt, 30)
            assert graph_count() == before
        finally:
            runner._compiled = inner
    assert len(seen) == res.target_forwards >= 20
    assert all(width == past + b for width, past, b in seen)  # the window: committed entries + this tree
    assert len({width for width, _, _ in seen}) == len(seen) and max(w for w, _, _ in seen) < runner.max_len


def test_static_cache_is_sized_to_the_generation_and_grows_when_outrun():
    """The static cache holds prompt + reserve + 1 rounded up to GRAIN (CUDA graphs attend over all of it every
    step, so it is kept short); a generation that outruns its reserve gets a larger cache holding the committed
    entries and decodes on, token for token as eager."""
    target = tiny_target("tiny-llama")
    prompt = tiny_prompt(target, TEXT)
    t = prompt.length
    with single_thread():
        target._static = None  # a fresh runner: earlier tests sized the shared target's cache for their prompts
        target.use_runtime("compiled")
        vanilla_generate(target, prompt, 6)
        size = target.static.max_len
        assert size == cache_len(t + 7) and size % GRAIN == 0 and size - GRAIN < t + 7 <= size
        n = size - t + 4  # 4 tokens past the end of the cache
        target.use_runtime("eager")
        ref = vanilla_generate(target, prompt, n).tokens
        target.use_runtime("compiled")
        tokens = [int(target.prefill(prompt, reserve=0).logits[-1].argmax())]
        while len(tokens) < len(ref):
            tokens.append(int(target.step(tokens[-1]).logits[-1].argmax()))
    assert target.static.max_len == size + GRAIN  # grew once, by one grain
    assert tokens == ref


def test_static_draft_cache_reads_as_the_dynamic_one_and_grows_keeping_entries():
    from decode.drafts.blocks import DraftKV
    from decode.drafts.static_kv import UNUSED, StaticDraftKV

    static, dynamic = StaticDraftKV(2, capacity=4, mem_capacity=2), DraftKV(2)
    for step in range(3):  # 3 appends of 2 entries each outgrow the 4 entries it starts with
        for layer in range(2):
            kv = (torch.randn(3, 2, 5), torch.randn(3, 2, 5))
            static.append(layer, kv)
            dynamic.append(layer, kv)
            mem = (torch.randn(3, 1, 5), torch.randn(3, 1, 5))
            static.append_memory(layer, mem)
            dynamic.append_memory(layer, mem)
        static.append_positions(torch.tensor([step]))
        dynamic.append_positions(torch.tensor([step]))
        if step == 1:
            static.commit()
            dynamic.commit()
    assert static.capacity >= 6 and static.length == dynamic.length == 6
    for a, b in zip(static.kv + static.mem_kv, dynamic.kv + dynamic.mem_kv):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert static.mem_pos.tolist() == dynamic.mem_pos.tolist() == [0, 1, 2]
    assert (static.mem_pos_buf[3:] == UNUSED).all()  # unused memory is never visible to a mask pos < query
    static.drop_tentative()
    dynamic.drop_tentative()
    assert static.length == dynamic.length == 4 and torch.equal(static.kv[0][0], dynamic.kv[0][0])
    buffers = static.k[0]
    static.reset()
    assert static.length == 0 and static.mem_pos is None and static.k[0] is buffers  # same buffers, emptied


def test_merged_switch_draft_does_not_recompile_after_a_run_of_lookup_only_cycles():
    """Switch rule: in a lookup-only cycle the neural draft does not run, so its next root level feeds every token
    emitted since (here 20 lookup-only cycles in a row: a 21-row root level, bucket 32). `warm` must have compiled
    that bucket: measured on the default target, such a bucket compiled inside timed generations made the compiled
    designed draft's drafting 4.6x its eager time."""
    target = tiny_target("tiny-llava")
    policy = TreePolicy(spec=TreeSpec(2, 1, 2))
    prompt = tiny_prompt(target, TEXT)
    with single_thread():
        ref = vanilla_generate(target, prompt, 40).tokens
        target.use_runtime("compiled")
        draft = MergedDraft(make_draft("random:concat", target), rule="switch")
        speculative_generate(target, draft, prompt, 8, policy=policy)  # makes the buffers and graphs, then warm
        draft.warm(policy)
        target.warm_buckets(draft.max_nodes(policy), draft.feature_layers)
        cycle, lookup_tree = [0], draft.lookup.lookup_tree

        def forced(root, spec):  # cycles 3-22: a one-token "match" (right or wrong: lossless either way)
            cycle[0] += 1
            if 3 <= cycle[0] <= 22:
                return DraftTree(torch.tensor([root, 7]), torch.tensor([-1, 0]))
            return lookup_tree(root, spec)

        draft.lookup.lookup_tree = forced
        rows, step = [], draft.neural.runner.step
        draft.neural.runner.step = lambda tokens, *a, **k: rows.append(tokens.numel()) or step(tokens, *a, **k)
        before = graph_count()
        res = speculative_generate(target, draft, prompt, 40, policy=policy)
    assert res.tokens == ref
    assert rows[0] > 32 and max(rows[1:]) > 16, rows  # the prompt (eager), then a root level past bucket 16
    assert graph_count() == before


def test_gpu_buckets_pad_far_and_change_no_token(monkeypatch):
    """A GPU pads every tree of 2-64 nodes to 64 and draft levels to 8 or 32 rows (decode/runtime/compiled.py):
    forced here on the CPU, the neural and merged drafts with mostly dummy nodes still decode vanilla's tokens."""
    from decode.runtime import compiled, draft_step

    monkeypatch.setattr(compiled, "buckets", lambda device_type="cpu": compiled.CUDA_BUCKETS)
    monkeypatch.setattr(draft_step, "draft_buckets", lambda device_type="cpu": draft_step.CUDA_DRAFT_BUCKETS)
    target = tiny_target("tiny-llava")
    prompt = tiny_prompt(target, TEXT)
    with single_thread():
        ref = vanilla_generate(target, prompt, 24).tokens
        target.use_runtime("compiled")
        sizes = []
        for label, draft, policy in [d for d in _drafts(target) if d[0].startswith("neural")]:
            res = speculative_generate(target, draft, prompt, 24, policy=policy)
            assert res.tokens == ref, label
            sizes += res.tree_sizes
    assert {bucket(n) for n in sizes if n > 1} == {64} and min(sizes) < 16  # one graph, padded by 48+ dummies


def test_frozen_guards_drop_only_what_is_reached_through_the_named_attribute():
    from types import SimpleNamespace

    from decode.runtime.compiled import frozen_guards

    names = ["self.target", "self.target.decoder.layers[0].weight", "self.target[0]", "self.targets", "self.cache",
             "self", "tokens", "self._store", "G['torch']"]
    keep = frozen_guards("target")([SimpleNamespace(name=n) for n in names])
    assert keep == [False, False, False, True, True, True, True, True, True]


def test_runners_of_two_targets_never_share_a_graph():
    """Without guards on the model (frozen_guards), a graph traced for one target would pass every remaining guard
    of another of the same shapes: each runner's serial number keeps their graphs apart."""
    from decode.targets.loader import load_target

    first = tiny_target("tiny-llama")
    prompt = tiny_prompt(first, TEXT)
    with single_thread():
        torch.manual_seed(0)
        second = load_target("tiny-llama", device="cpu", dtype="float32")  # the same shapes and config
        with torch.no_grad():
            second.lm_head.weight.mul_(-1.0)  # other weights: other tokens
        ref = vanilla_generate(second, prompt, 12).tokens
        first.use_runtime("compiled")
        assert vanilla_generate(first, prompt, 12).tokens != ref
        before = graph_count()
        second.use_runtime("compiled")
        assert vanilla_generate(second, prompt, 12).tokens == ref
        assert graph_count() > before  # its own graphs, not the first target's


def test_compiled_features_follow_the_feature_layers_asked_for_when_they_change_and_come_back():
    """Hidden-state hooks are re-registered per feature-layer tuple, which the graph guards on: (1,), (2,) and (1,)
    again each capture their own layer, as eager does."""
    target = tiny_target("tiny-llava")
    prompt = tiny_prompt(target, TEXT)
    tokens = torch.tensor([5, 6, 7])
    chain = torch.ones(3, 3, dtype=torch.bool).tril()

    def features(runtime, layers):
        target.use_runtime(runtime)
        target.prefill(prompt)
        out = target.forward_tree(tokens, tree_mask=chain, feature_layers=layers)
        target.keep([0])
        return out.hidden

    with single_thread():
        for layers in ((1,), (2,), (1,), (1, 2)):
            eager, compiled = features("eager", layers), features("compiled", layers)
            assert sorted(compiled) == sorted(eager) == sorted(layers)
            for k in layers:
                torch.testing.assert_close(compiled[k], eager[k], rtol=1e-4, atol=1e-5)
