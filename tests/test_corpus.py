"""Corpus lookup (decode/drafts/corpus.py, decode/corpus.py): the n-gram counts, greedy branches, the file format and
its errors, the lookup trie with a corpus branch, lossless decoding with it, and the CLI that writes such a draft."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_prompt, tiny_target

from decode.corpus import main as corpus_main
from decode.drafts import make_draft
from decode.drafts.corpus import CORPUS_NAME, NgramCorpus
from decode.drafts.prompt_lookup import LookupSpec, NgramIndex, PromptLookupDraft, lookup_trie
from decode.errors import UserError
from decode.loop.speculative import speculative_generate
from decode.loop.vanilla import vanilla_generate


def test_counts_pick_the_most_frequent_next_token_of_the_longest_suffix():
    corpus = NgramCorpus.build([[1, 2, 3], [1, 2, 3], [1, 2, 4], [9, 2, 4], [7, 2, 5]], vocab_size=10)
    assert corpus.next_of([2]) == 3  # after "2": 3 twice, 4 twice, 5 once -> the smaller id on a tie
    assert corpus.next_of([1, 2]) == 3  # the 2-gram "1 2" knows better: 3 twice, 4 once
    assert corpus.next_of([9, 2]) == 4
    assert corpus.next_of([8, 8, 2]) == 3  # unknown 3- and 2-grams: the 1-gram "2"
    assert corpus.next_of([7, 2]) == 5
    assert corpus.next_of([8]) is None and corpus.next_of([]) is None
    assert corpus.info.tokens == 15 and corpus.info.sequences == 5


def test_ngrams_never_cross_a_sequence_boundary():
    corpus = NgramCorpus.build([[5, 6], [7, 8]], vocab_size=10)
    assert corpus.next_of([6]) is None  # 6 ends a sequence: "6 -> 7" is no n-gram
    assert corpus.next_of([5, 6, 7]) == 8


def test_chain_drafts_greedily_and_a_shorter_chain_is_a_prefix():
    corpus = NgramCorpus.build([[1, 2, 3, 4, 5, 6]] * 3 + [[2, 9]], vocab_size=10)
    assert corpus.chain([0, 1, 2], 3) == [3, 4, 5]
    assert corpus.chain([0, 1, 2], 2) == corpus.chain([0, 1, 2], 3)[:2]
    assert corpus.chain([6], 4) == []  # nothing ever followed 6


def test_runner_up_and_the_second_branch():
    corpus = NgramCorpus.build([[1, 2, 3, 4]] * 3 + [[1, 2, 5, 6]] * 2 + [[8, 2, 7]], vocab_size=10)
    assert corpus.next_of([1, 2]) == 3 and corpus.runner_up([1, 2]) == 5  # after "1 2": 3 three times, 5 twice
    assert corpus.branches([0, 1, 2], 3, 2) == [[3, 4], [5, 6]]  # the chain, then the runner-up and greedy again
    assert corpus.branches([0, 1, 2], 3, 1) == [[3, 4], [5]]
    assert corpus.branches([0, 1, 2], 3) == [[3, 4]]
    # "8 2" was only ever followed by 7: the runner-up comes from the shorter suffix "2" (best 3, not 7)
    assert corpus.next_of([8, 2]) == 7 and corpus.runner_up([8, 2]) == 3
    assert corpus.runner_up([4]) is None  # nothing ever followed 4


def test_min_count_drops_rare_longer_ngrams_and_lookups_back_off():
    seqs = [[1, 2, 3], [1, 2, 3], [9, 2, 4]]
    full, pruned = NgramCorpus.build(seqs, vocab_size=10), NgramCorpus.build(seqs, vocab_size=10, min_count=2)
    assert full.next_of([9, 2]) == 4  # seen once
    assert pruned.next_of([9, 2]) == 3  # dropped: the 1-gram "2" answers (3 twice, 4 once)
    assert pruned.next_of([1, 2]) == 3 and pruned.next_of([3]) is None
    assert pruned.next_of([9]) == 2  # 1-grams stay whatever their count
    assert pruned.keys.size < full.keys.size and pruned.info.min_count == 2
    with pytest.raises(UserError, match="min_count"):
        NgramCorpus.build(seqs, vocab_size=10, min_count=0)


def test_distilled_items_count_the_targets_own_next_token():
    """(ids, nexts): the token after each context is the given one (the target's prediction), not the text's next."""
    corpus = NgramCorpus.build([([1, 2, 3], [5, 6, -1]), [1, 2, 9]], vocab_size=10)
    assert corpus.next_of([1]) == 2  # plain "1 -> 2" once, distilled "1 -> 5" once: the tie goes to the smaller id
    assert corpus.runner_up([1]) == 5
    assert corpus.next_of([1, 2]) == 6  # distilled "1 2 -> 6" and plain "1 2 -> 9": a tie, 6 is smaller
    assert corpus.next_of([2, 3]) is None  # no next after the item's last position
    assert corpus.info.tokens == 6 and corpus.info.sequences == 2
    with pytest.raises(UserError, match="as many next tokens"):
        NgramCorpus.build([([1, 2, 3], [5, 6])], vocab_size=10)


def test_a_weighted_item_counts_as_that_item_repeated():
    """weights=[w, ...]: every n-gram count (min_count and runner-ups included) as if the item were there w times."""
    items = [[1, 2, 3, 4], ([1, 2, 5, 6], [2, 7, 6, -1]), [9, 2, 7], [1, 2, 3]]
    weighted = NgramCorpus.build(items, vocab_size=10, min_count=2, weights=[1, 4, 1, 2])
    repeated = NgramCorpus.build([items[0]] + [items[1]] * 4 + [items[2]] + [items[3]] * 2, vocab_size=10, min_count=2)
    for name in ("keys", "next_token", "count", "second"):
        assert (getattr(weighted, name) == getattr(repeated, name)).all(), name
    assert weighted.info.tokens == 14 and weighted.info.sequences == 4  # the corpus's real size, not the weighted one
    assert weighted.next_of([1, 2]) == 7  # distilled "1 2 -> 7" four times beats "1 2 -> 3" three times (1 + 1 x2)
    assert NgramCorpus.build(items, vocab_size=10).next_of([1, 2]) == 3  # unweighted: 3 twice, 7 once
    for bad in ([1, 1], [1, 0, 1, 1]):
        with pytest.raises(UserError, match="weights"):
            NgramCorpus.build(items, vocab_size=10, weights=bad)


def test_save_and_load_round_trip_and_bad_files(tmp_path):
    corpus = NgramCorpus.build([[1, 2, 3, 1, 2, 4]], vocab_size=300, sources=("test",))
    path = corpus.save(tmp_path / CORPUS_NAME)
    back = NgramCorpus.load(path, vocab_size=300)
    assert (back.keys == corpus.keys).all() and (back.next_token == corpus.next_token).all()
    assert back.info == corpus.info and back.chain([1, 2], 3) == corpus.chain([1, 2], 3)
    assert back.branches([1, 2], 3, 2) == corpus.branches([1, 2], 3, 2) and len(corpus.branches([1, 2], 3, 2)) == 2
    with pytest.raises(UserError, match="vocabulary of 300"):
        NgramCorpus.load(path, vocab_size=301)
    with pytest.raises(UserError, match="does not exist"):
        NgramCorpus.load(tmp_path / "nope.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError, match="not a readable corpus"):
        NgramCorpus.load(tmp_path / "bad.safetensors")
    with pytest.raises(UserError, match="0..9"):
        NgramCorpus.build([[1, 12]], vocab_size=10)
    with pytest.raises(UserError, match="no sequence"):
        NgramCorpus.build([[1]], vocab_size=10)


def test_a_v1_file_without_runner_ups_still_loads_and_drafts_one_branch(tmp_path):
    from safetensors.torch import save_file

    corpus = NgramCorpus.build([[1, 2, 3], [1, 2, 4]], vocab_size=10)
    save_file({"keys": torch.from_numpy(corpus.keys), "next": torch.from_numpy(corpus.next_token),
               "count": torch.from_numpy(corpus.count)}, str(tmp_path / "v1.safetensors"),
              metadata={"format": "vlm-draft-nas/corpus-v1", "info": json.dumps(corpus.info.to_dict())})
    old = NgramCorpus.load(tmp_path / "v1.safetensors")
    assert old.branches([1, 2], 2, 2) == [[3]] and corpus.branches([1, 2], 2, 2) == [[3], [4]]


def test_lookup_trie_adds_the_corpus_branch_with_room_of_its_own():
    corpus = NgramCorpus.build([[3, 7, 8, 9]] * 2, vocab_size=20)
    index = NgramIndex(1, 2)
    index.extend([1, 2, 3, 4, 5, 6, 3])  # "3" was followed by 4 5 6 in the history
    spec = LookupSpec(max_ngram=2, tree_depth=3, top_k=1, total_tokens=3, corpus_depth=2)
    tree = lookup_trie(index, 3, spec, spec.tree, 1, corpus)
    assert tree.tokens.tolist() == [3, 4, 5, 6, 7, 8]  # the lookup branch, then the corpus's 7 8 (a second branch)
    assert tree.parents.tolist() == [-1, 0, 1, 2, 0, 4]
    plain = lookup_trie(index, 3, spec, spec.tree, 1, None)
    assert plain.tokens.tolist() == [3, 4, 5, 6]
    draft = PromptLookupDraft(spec=spec, corpus=corpus)
    from decode.loop.tree import TreePolicy
    assert draft.max_nodes(TreePolicy(spec=spec.tree)) == 3 + 2 + 1
    with pytest.raises(UserError, match="needs a corpus"):
        PromptLookupDraft(spec=spec)


def test_lookup_trie_merges_a_second_corpus_branch():
    corpus = NgramCorpus.build([[3, 7, 8, 9]] * 2 + [[3, 4, 5, 1]], vocab_size=20)
    index = NgramIndex(1, 2)
    index.extend([1, 2, 3, 4, 5, 6, 3])  # lookup proposes 4 5 6 after "3"
    spec = LookupSpec(max_ngram=2, tree_depth=3, top_k=1, total_tokens=3, corpus_depth=2, corpus_second=2)
    tree = lookup_trie(index, 3, spec, spec.tree, 1, corpus)
    # corpus: 7 8 (best after "3"), runner-up 4 then 5 -- which the lookup branch holds already: shared, no new node
    assert tree.tokens.tolist() == [3, 4, 5, 6, 7, 8] and tree.parents.tolist() == [-1, 0, 1, 2, 0, 4]
    spec1 = LookupSpec(max_ngram=2, tree_depth=1, top_k=1, total_tokens=1, corpus_depth=2, corpus_second=2)
    index2 = NgramIndex(1, 2)
    index2.extend([6, 3, 9])  # lookup proposes 9 after "3"
    tree = lookup_trie(index2, 3, spec1, spec1.tree, 1, corpus)
    assert tree.tokens.tolist() == [3, 9, 7, 8, 4, 5] and tree.parents.tolist() == [-1, 0, 0, 2, 0, 4]
    assert spec1.nodes == 5
    # the compiled runtime reserves cache room for max_nodes: the second branch's nodes count too
    from decode.loop.tree import TreePolicy
    assert PromptLookupDraft(spec=spec1, corpus=corpus).max_nodes(TreePolicy(spec=spec1.tree)) == tree.size == 6
    with pytest.raises(UserError, match="corpus_second"):
        LookupSpec(corpus_depth=2, corpus_second=3)


@pytest.mark.parametrize("merged,second", [(False, 0), (True, 0), (False, 2), (True, 2)])
def test_decoding_with_a_corpus_branch_is_lossless_and_accepts_more(tmp_path, merged, second):
    """A corpus holding the target's own answer: the corpus branch gets accepted (fewer cycles than lookup alone) and
    the output stays the target's, token for token (with a runner-up branch too)."""
    target = tiny_target("tiny-llama")
    prompt = tiny_prompt(target, "Count: one two three four")
    ref = vanilla_generate(target, prompt, 24).tokens
    corpus = NgramCorpus.build([ref, ref[::-1]], target.vocab_size)
    spec = LookupSpec(max_ngram=2, tree_depth=2, top_k=1, total_tokens=2, corpus_depth=4, corpus_second=second)
    if merged:
        from decode.drafts import MergedDraft
        with_corpus = MergedDraft(make_draft("random:concat", target), spec, corpus=corpus)
        without = MergedDraft(make_draft("random:concat", target), LookupSpec(max_ngram=2, tree_depth=2, top_k=1,
                                                                                total_tokens=2))
    else:
        with_corpus = PromptLookupDraft(spec=spec, corpus=corpus)
        without = PromptLookupDraft(spec=LookupSpec(max_ngram=2, tree_depth=2, top_k=1, total_tokens=2))
    a = speculative_generate(target, with_corpus, prompt, 24)
    b = speculative_generate(target, without, prompt, 24)
    assert a.tokens == ref and b.tokens == ref
    assert a.cycles < b.cycles


def test_the_cli_writes_a_draft_folder_that_decodes_losslessly(tmp_path, capsys):
    target = tiny_target("tiny-llama")
    out = tmp_path / "corpus-draft"
    assert corpus_main(["--target", "tiny-llama", "--sharegpt", "30", "--out", str(out), "--corpus-depth", "3"]) == 0
    config = json.loads((out / "draft_config.json").read_text())
    assert config["kind"] == "prompt-lookup" and config["lookup"]["corpus_depth"] == 3
    assert config["metadata"]["corpus"]["sequences"] == 30
    draft = make_draft(str(out), target)
    assert isinstance(draft, PromptLookupDraft) and draft.corpus is not None
    prompt = tiny_prompt(target)
    assert speculative_generate(target, draft, prompt, 16).tokens == vanilla_generate(target, prompt, 16).tokens
    # a folder whose lookup needs the corpus file but lost it: one clear error
    (out / CORPUS_NAME).unlink()
    with pytest.raises(UserError, match="no corpus.safetensors"):
        make_draft(str(out), target)


@pytest.mark.parametrize("argv,match", [
    (["--corpus-depth", "0"], "corpus-depth"),
    (["--min-count", "0"], "min-count"),
    (["--own-weight", "0"], "own-weight"),
    (["--corpus-depth", "2", "--corpus-second", "3"], "corpus_second"),
    (["--sharegpt", "-1"], "sharegpt"),
    (["--sharegpt", "0"], "no corpus"),
    (["--data", "/nonexistent/folder"], "not a folder"),
])
def test_cli_bad_input_is_one_error(tmp_path, argv, match):
    with pytest.raises(UserError, match=match):
        corpus_main(["--target", "tiny-llama", "--out", str(tmp_path / "x"), *argv])


def test_data_folders_contribute_the_targets_next_tokens(tmp_path):
    """--data reads a feature-data folder's positions with the stored top-1 after each (-1 on image positions), or
    its answer tokens (positions from prompt_len on) where the shards hold no top-k."""
    from safetensors.torch import save_file

    from decode.corpus import data_items

    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7], dtype=torch.int32)
    index = {"offsets": torch.tensor([0, 4, 7]), "prompt_len": torch.tensor([2, 1])}
    plain, distilled = tmp_path / "plain", tmp_path / "distilled"
    plain.mkdir()
    distilled.mkdir()
    save_file({"input_ids": ids, **index}, str(plain / "shard-00000.safetensors"))
    assert data_items(plain) == [[3, 4], [6, 7]]
    topk = torch.stack([torch.tensor([9, 8, 7, 6, 5, 4, 3]), torch.zeros(7, dtype=torch.long)], dim=1)  # (T, 2)
    save_file({"input_ids": ids, "topk_ids": topk, "image_mask": torch.tensor([0, 1, 0, 0, 0, 0, 0]).bool(), **index},
              str(distilled / "shard-00000.safetensors"))
    assert data_items(distilled) == [([1, 2, 3, 4], [9, -1, 7, 6]), ([5, 6, 7], [5, 4, 3])]
    (plain / "shard-00001.safetensors").write_bytes(b"junk")
    with pytest.raises(UserError, match="not a readable data shard"):
        data_items(plain)


def test_the_targets_own_answers_count_own_weight_times(tmp_path):
    """A folder built in regenerate mode (its manifest says so) counts OWN_WEIGHT times (or --own-weight),
    teacher-forced data once; the corpus's sources say how often."""
    from safetensors.torch import save_file

    from decode.corpus import OWN_WEIGHT, build_corpus, data_weight

    target = tiny_target("tiny-llama")
    folders = {}
    for mode, nexts in (("teacher", [3, 4, 5, 0]), ("regenerate", [3, 6, 5, 0])):  # after "1 2": 4 or 6
        folders[mode] = tmp_path / mode
        folders[mode].mkdir()
        save_file({"input_ids": torch.tensor([1, 2, 3, 4]), "offsets": torch.tensor([0, 4]),
                   "prompt_len": torch.tensor([1]), "topk_ids": torch.tensor(nexts).reshape(4, 1)},
                  str(folders[mode] / "shard-00000.safetensors"))
        (folders[mode] / "manifest.json").write_text(json.dumps({"content": {"mode": mode}}))
    teacher, own = folders["teacher"], folders["regenerate"]
    assert data_weight(teacher) == 1 and data_weight(own) == OWN_WEIGHT > 1 and data_weight(own, 3) == 3
    assert data_weight(tmp_path) == 1  # no manifest: once
    # the teacher folder twice against the own answers once: the own answers win only when weighted
    corpus = build_corpus(target, 0, [teacher, teacher, own], min_count=1)
    assert corpus.next_of([1, 2]) == 6 and corpus.runner_up([1, 2]) == 4
    assert corpus.info.sources[2] == f"{own} (1 sequences x{OWN_WEIGHT})" and corpus.info.sources[0].endswith("ces)")
    corpus = build_corpus(target, 0, [teacher, teacher, own], min_count=1, own_weight=1)
    assert corpus.next_of([1, 2]) == 4 and corpus.info.sources[2] == f"{own} (1 sequences)"


def test_the_pipeline_corpus_stage_counts_its_data_folders_and_rebuilds_when_they_change(tmp_path, monkeypatch):
    """nas.pipeline.corpus_stage: ShareGPT answers + the distilled positions of the given data folders; reused while
    its sources are the same, rebuilt when a folder joins, the train split's answers change in number or the file
    predates distilled sources."""
    from safetensors.torch import save_file

    import decode.corpus as corpus_cli
    from decode.corpus import OWN_WEIGHT
    from nas.pipeline import PipelineConfig, corpus_stage

    target = tiny_target("tiny-llama")
    monkeypatch.setattr(corpus_cli, "sharegpt_answers", lambda tokenizer, n, cache_dir=None: [[1, 2, 3, 4]] * 3)
    monkeypatch.setattr(corpus_cli, "train_answer_count", lambda cache_dir=None: 3)
    data = tmp_path / "data"
    data.mkdir()
    topk = torch.tensor([[2], [7], [8], [9], [0]])  # the "target" predicted 7 after "1 2" where the text has 3
    save_file({"input_ids": torch.tensor([1, 2, 3, 4, 5]), "offsets": torch.tensor([0, 5]),
               "prompt_len": torch.tensor([2]), "topk_ids": topk}, str(data / "shard-00000.safetensors"))
    cfg = PipelineConfig(target="tiny-llama", root=str(tmp_path / "run"))
    out = corpus_stage(cfg, target, [])
    assert NgramCorpus.load(out).next_of([1, 2]) == 3 and len(NgramCorpus.read_info(out).sources) == 1
    stamp = out.stat().st_mtime_ns
    assert corpus_stage(cfg, target, []) == out and out.stat().st_mtime_ns == stamp  # reused
    out = corpus_stage(cfg, target, [data])  # a data folder joined: rebuilt, with the target's own next tokens
    info = NgramCorpus.read_info(out)
    assert info.sources[1] == f"{data} (1 sequences)" and info.min_count == 2
    back = NgramCorpus.load(out)
    assert back.next_of([5, 1, 2]) == 3 and back.runner_up([5, 1, 2]) == 7  # 3 three times (ShareGPT), 7 once
    stamp = out.stat().st_mtime_ns
    assert corpus_stage(cfg, target, [data]) == out and out.stat().st_mtime_ns == stamp
    # the train split holds another number of answers now (e.g. a corpus counted before the held-out reserve): rebuilt
    monkeypatch.setattr(corpus_cli, "train_answer_count", lambda cache_dir=None: 2)
    monkeypatch.setattr(corpus_cli, "sharegpt_answers", lambda tokenizer, n, cache_dir=None: [[1, 2, 3, 4]] * 2)
    corpus_stage(cfg, target, [data])
    assert NgramCorpus.read_info(out).sources[0] == "sharegpt train answers (2)" and out.stat().st_mtime_ns != stamp
    stamp = out.stat().st_mtime_ns
    assert corpus_stage(cfg, target, [data]) == out and out.stat().st_mtime_ns == stamp
    # a corpus of the answers-only kind (its sources say "(N answers)") is built again
    NgramCorpus.build([[1, 2, 3]], target.vocab_size, sources=("sharegpt train answers (3)", f"{data} (1 answers)")
                      ).save(out)
    corpus_stage(cfg, target, [data])
    assert NgramCorpus.read_info(out).sources[1].endswith("(1 sequences)")
    # the same folder now holds the target's own answers (regenerate mode): counted OWN_WEIGHT times, so rebuilt
    (data / "manifest.json").write_text(json.dumps({"content": {"mode": "regenerate"}}))
    corpus_stage(cfg, target, [data])
    assert NgramCorpus.read_info(out).sources[1] == f"{data} (1 sequences x{OWN_WEIGHT})"
    stamp = out.stat().st_mtime_ns
    assert corpus_stage(cfg, target, [data]) == out and out.stat().st_mtime_ns == stamp


def test_the_pipeline_corpus_stage_is_rebuilt_when_an_answers_folder_holds_other_answers(tmp_path, monkeypatch):
    """A corpus whose answers folder went on (a larger time budget) or lost answers (answered again) since it was
    counted is stale: its sources name the same folder, but with another number of sequences."""
    from safetensors.torch import save_file

    import decode.corpus as corpus_cli
    from decode.answers import FORMAT, MANIFEST
    from nas.pipeline import PipelineConfig, corpus_stage

    target = tiny_target("tiny-llama")
    monkeypatch.setattr(corpus_cli, "sharegpt_answers", lambda tokenizer, n, cache_dir=None: [[1, 2, 3, 4]] * 3)
    monkeypatch.setattr(corpus_cli, "train_answer_count", lambda cache_dir=None: 3)
    answers = tmp_path / "answers"
    answers.mkdir()
    save_file({"tokens": torch.tensor([5, 6, 7, 5, 6, 8], dtype=torch.int32), "offsets": torch.tensor([0, 3, 6])},
              str(answers / "chunk-00000.safetensors"))

    def manifest(complete: bool) -> None:
        (answers / MANIFEST).write_text(json.dumps({"format": FORMAT, "chunks": [
            {"file": "chunk-00000.safetensors", "prompt_ids": ["a", "b"], "complete": complete}]}))

    manifest(False)
    cfg = PipelineConfig(target="tiny-llama", root=str(tmp_path / "run"))
    out = corpus_stage(cfg, target, [answers])
    assert NgramCorpus.read_info(out).sources[1].startswith(f"{answers} (0 sequences")
    stamp = out.stat().st_mtime_ns
    assert corpus_stage(cfg, target, [answers]) == out and out.stat().st_mtime_ns == stamp  # reused
    manifest(True)  # the chunk finished since
    corpus_stage(cfg, target, [answers])
    assert NgramCorpus.read_info(out).sources[1].startswith(f"{answers} (2 sequences")
    assert NgramCorpus.load(out).next_of([5, 6]) in (7, 8)
