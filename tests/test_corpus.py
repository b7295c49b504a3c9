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


def test_save_and_load_round_trip_and_bad_files(tmp_path):
    corpus = NgramCorpus.build([[1, 2, 3, 1, 2, 4]], vocab_size=300, sources=("test",))
    path = corpus.save(tmp_path / CORPUS_NAME)
    back = NgramCorpus.load(path, vocab_size=300)
    assert (back.keys == corpus.keys).all() and (back.next_token == corpus.next_token).all()
    assert back.info == corpus.info and back.chain([1, 2], 3) == corpus.chain([1, 2], 3)
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


@pytest.mark.parametrize("merged", [False, True])
def test_decoding_with_a_corpus_branch_is_lossless_and_accepts_more(tmp_path, merged):
    """A corpus holding the target's own answer: the corpus branch gets accepted (fewer cycles than lookup alone) and
    the output stays the target's, token for token."""
    target = tiny_target("tiny-llama")
    prompt = tiny_prompt(target, "Count: one two three four")
    ref = vanilla_generate(target, prompt, 24).tokens
    corpus = NgramCorpus.build([ref, ref[::-1]], target.vocab_size)
    spec = LookupSpec(max_ngram=2, tree_depth=2, top_k=1, total_tokens=2, corpus_depth=4)
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
    (["--sharegpt", "-1"], "sharegpt"),
    (["--sharegpt", "0"], "no corpus"),
    (["--data", "/nonexistent/folder"], "not a folder"),
])
def test_cli_bad_input_is_one_error(tmp_path, argv, match):
    with pytest.raises(UserError, match=match):
        corpus_main(["--target", "tiny-llama", "--out", str(tmp_path / "x"), *argv])


def test_data_folders_contribute_their_answers(tmp_path):
    """--data reads a feature-data folder's answer tokens (positions from prompt_len on)."""
    from safetensors.torch import save_file

    from decode.corpus import data_answers

    folder = tmp_path / "data"
    folder.mkdir()
    save_file({"input_ids": torch.tensor([1, 2, 3, 4, 5, 6, 7], dtype=torch.int32),
               "offsets": torch.tensor([0, 4, 7]), "prompt_len": torch.tensor([2, 1])},
              str(folder / "shard-00000.safetensors"))
    assert data_answers(folder) == [[3, 4], [6, 7]]
    (folder / "shard-00001.safetensors").write_bytes(b"junk")
    with pytest.raises(UserError, match="not a readable data shard"):
        data_answers(folder)
