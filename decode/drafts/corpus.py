"""A corpus n-gram model that drafts like prompt lookup, from text the prompt does not hold.

Prompt lookup only finds what the prompt and the output so far already contain; most answers are new text. Yet a
chat model's answers are full of stock phrasing ("Here is a", "I'm sorry, but", "In conclusion, ..."), and those
spans are in any large set of answers. NgramCorpus counts, over a corpus of token sequences (ShareGPT answers
tokenised by the target's tokenizer, and the target's own answers where a pipeline has them), which token follows
each 1..max_n-gram most often; `chain(history, depth)` then drafts greedily: the longest suffix of the history (plus
what it drafted so far) that the corpus holds picks the next token. Deterministic given the history, so the
search's replay of it is exact, and verified as a point mass, so decoding stays lossless.

Measured (exact greedy replay on the 168 demo held-out sequences, 4-token branches; /tmp probes, README): prompt
lookup alone tau 1.29; the corpus chain alone 1.37 from 3.2M tokens of ShareGPT answers (no model forward at all),
1.45 with 49k tokens of the target's own answers added; both merged into one tree 1.71 and 1.80.

What follows what. A plain sequence predicts each token from the tokens before it. A *distilled* item (ids, nexts)
pairs each context with the token the target itself predicts after it (nexts[j]: the target's argmax after ids[..j],
from a teacher-mode data folder's stored top-k): what the target would say, counted over every position of text it
merely read. In a probe on the cpu scale's 168 held-out sequences (lookup + a 4-token chain) the 443k distilled
positions of its training data made a better corpus than 3.2M tokens of ShareGPT answers (tau 1.826 against 1.804,
with 15x fewer n-grams); both together 1.833.

Two branches. Each n-gram also keeps its second most frequent next token, so a proposal can hold a second branch
(`branches`): the runner-up at the root, then greedy again. In the same probe a 2-token second branch beside the
4-token chain took tau from 1.833 to 1.940 for 1.5 more verified tokens per cycle; the search's replay (nas/kinds.py)
on the cpu profile preferred a 2-token chain and a 1-token second branch: predicted 1.609x -> 1.714x (tau 1.74 ->
1.88) against the corpus of answers with one branch.

Weights. Counting the target's own greedy answers (a regenerated folder) several times over pays: held-out decoding
continues the target's own text, and those answers are that text. On the cpu scale's 168 held-out sequences (lookup
n<=2 4x1/4 + corpus 2+1, exact replay): 88.8k positions of the target's answers to 480 prompts took tau from 1.816
(ShareGPT answers + 443k distilled teacher-forced positions) to 1.870, where those 443k had added only 0.032 to the
answers alone; the same answers counted 2 / 4 / 8 / 16 times: 1.886 / 1.889 / 1.894 / 1.890 (decode/corpus.py counts
them OWN_WEIGHT = 8 times). A position with weight w counts as w occurrences, min_count included.

Storage: one safetensors file (never a pickle): sorted int64 n-gram codes, the most frequent next token of each and
its count, and the runner-up (-1: none). A code packs n (2 bits) and the n token ids (`bits` each,
enough for the target's vocabulary); max_n is at most 3 so that every code fits in 63 bits for vocabularies up to
2^20 tokens. `min_count` drops rarely seen 2- and 3-grams (decode/corpus.py keeps those seen twice: 2.5x smaller).
Lookups are binary searches in those arrays (numpy), a few microseconds per drafted token.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from decode.errors import UserError

CORPUS_NAME = "corpus.safetensors"
FORMAT = "vlm-draft-nas/corpus-v2"
FORMATS = ("vlm-draft-nas/corpus-v1", FORMAT)  # v1 files (no runner-ups) still load: they draft no second branch
MAX_N = 3


@dataclass(frozen=True)
class CorpusInfo:
    """What a corpus file was built from (stored in its metadata)."""

    max_n: int
    bits: int
    vocab_size: int
    sequences: int
    tokens: int
    sources: tuple[str, ...] = ()
    target_digest: str = ""  # the target's weights digest: token ids mean something only for its tokenizer
    min_count: int = 1  # 2- and 3-grams seen fewer times were dropped

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sources"] = list(self.sources)
        return d


def _bits_for(vocab_size: int) -> int:
    return max(16, math.ceil(math.log2(max(2, vocab_size))))


def _codes(windows: np.ndarray, n: int, bits: int) -> np.ndarray:
    """(m, n) token ids -> (m,) int64 codes: n in the low 2 bits, then the tokens oldest first."""
    code = np.full(windows.shape[0], n, dtype=np.int64)
    for i in range(n):
        code |= windows[:, i].astype(np.int64) << (2 + bits * i)
    return code


class NgramCorpus:
    """The most frequent next token after every 1..max_n-gram of a corpus (module docstring)."""

    def __init__(self, keys: np.ndarray, next_token: np.ndarray, count: np.ndarray, info: CorpusInfo,
                 second: np.ndarray | None = None):
        self.keys, self.next_token, self.count, self.info = keys, next_token, count, info
        self.second = second if second is not None else np.full(keys.size, -1, dtype=np.int32)  # runner-up; -1: none
        self.max_n, self.bits = info.max_n, info.bits

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, sequences: Iterable[Sequence[int] | tuple[Sequence[int], Sequence[int]]], vocab_size: int,
              max_n: int = MAX_N, sources: tuple[str, ...] = (), target_digest: str = "",
              min_count: int = 1, weights: Sequence[int] | None = None) -> "NgramCorpus":
        """Count next tokens over items (n-grams never cross an item boundary): a plain token sequence, or a distilled
        pair (ids, nexts) of equal length where nexts[j] follows ids[..j] (-1: no next there; module docstring).
        min_count > 1 drops the n-grams (n >= 2) seen fewer times than that: lookups back off to a shorter suffix.
        weights: per item, how many times each of its positions counts (None: once; the same counts as the item
        repeated that often), e.g. more for the target's own answers (module docstring, "Weights")."""
        if not 1 <= max_n <= MAX_N:
            raise UserError(f"corpus n-grams must be 1..{MAX_N} tokens long, got {max_n}")
        if min_count < 1:
            raise UserError(f"a corpus n-gram's min_count must be >= 1, got {min_count}")
        bits = _bits_for(vocab_size)
        if max_n * bits + 2 > 63:
            raise UserError(f"a vocabulary of {vocab_size} tokens is too large for {max_n}-gram codes; "
                            "use a smaller max_n")
        sequences = list(sequences)
        weights = [1] * len(sequences) if weights is None else [int(w) for w in weights]
        if len(weights) != len(sequences) or min(weights, default=1) < 1:
            raise UserError(f"corpus weights must be one integer >= 1 per item ({len(sequences)} items), "
                            f"got {len(weights)} weights, smallest {min(weights, default=1)}")
        ids, nexts, wts = [], [], []  # per item: (T_i,) context tokens, (T_i,) the token after each (-1: none), weight
        for item, w in zip(sequences, weights):
            if isinstance(item, tuple):
                a, b = np.asarray(item[0], dtype=np.int64), np.asarray(item[1], dtype=np.int64)
                if a.shape != b.shape:
                    raise UserError(f"a distilled corpus item needs as many next tokens as ids, got {b.size} "
                                    f"for {a.size}")
            else:
                a = np.asarray(item, dtype=np.int64)
                b = np.append(a[1:], -1)
            if a.size >= 1 and (b >= 0).any():
                ids.append(a)
                nexts.append(b)
                wts.append(w)
        if not ids:
            raise UserError("the corpus has no sequence of two tokens or more")
        flat, after = np.concatenate(ids), np.concatenate(nexts)  # (T,), (T,)
        weight = np.repeat(np.asarray(wts, dtype=np.int64), [a.size for a in ids])  # (T,) each position's weight
        if flat.min() < 0 or max(flat.max(), after.max()) >= vocab_size:
            raise UserError(f"corpus token ids must lie in 0..{vocab_size - 1} (the target's vocabulary)")
        starts = np.repeat(np.cumsum([0] + [a.size for a in ids[:-1]]), [a.size for a in ids])  # (T,) own start
        pos = np.flatnonzero(after >= 0)  # context windows end at pos; the token after them is after[pos]
        keys, nxts, ws = [], [], []
        for n in range(1, max_n + 1):
            end = pos[pos - n + 1 >= starts[pos]]  # the n-gram ending there lies within its own item
            windows = np.stack([flat[end - n + 1 + i] for i in range(n)], axis=1)  # (m, n) oldest first
            keys.append(_codes(windows, n, bits))
            nxts.append(after[end])
            ws.append(weight[end])
        key, nxt, w = np.concatenate(keys), np.concatenate(nxts), np.concatenate(ws)
        # count (key, next) pairs (weighted), then keep each key's two most frequent nexts (ties: the smaller id first)
        order = np.lexsort((nxt, key))
        key, nxt, w = key[order], nxt[order], w[order]
        new_pair = np.ones(key.size, dtype=bool)
        new_pair[1:] = (key[1:] != key[:-1]) | (nxt[1:] != nxt[:-1])
        first = np.flatnonzero(new_pair)
        pair_count = np.add.reduceat(w, first)
        pair_key, pair_next = key[first], nxt[first]
        # per key by falling count (a stable sort keeps the smaller id first on ties)
        order = np.lexsort((-pair_count, pair_key))
        pair_key, pair_next, pair_count = pair_key[order], pair_next[order], pair_count[order]
        head = np.ones(pair_key.size, dtype=bool)
        head[1:] = pair_key[1:] != pair_key[:-1]
        at = np.flatnonzero(head)  # (K,) each key's best pair
        if min_count > 1:  # a key's occurrences: the sum of its pairs' counts; 1-grams (code & 3 == 1) always stay
            seen = np.add.reduceat(pair_count, at)
            at = at[(seen >= min_count) | ((pair_key[at] & 3) == 1)]
        nxt_at = np.minimum(at + 1, pair_key.size - 1)  # the pair after it: the runner-up when it has the same key
        has2 = (at + 1 < pair_key.size) & (pair_key[nxt_at] == pair_key[at])
        second = np.where(has2, pair_next[nxt_at], -1).astype(np.int32)
        info = CorpusInfo(max_n, bits, int(vocab_size), len(ids), int(flat.size), tuple(sources), target_digest,
                          min_count)
        return cls(pair_key[at], pair_next[at].astype(np.int32), pair_count[at].astype(np.int32), info, second)

    # ------------------------------------------------------------------ drafting
    def _known(self, context: Sequence[int]) -> list[int]:
        """The indices of the suffixes of `context` (up to max_n tokens) that the corpus holds, longest first (one
        binary search for all of them)."""
        m = min(self.max_n, len(context))
        codes = []  # longest suffix first, packed as _codes packs them
        for n in range(m, 0, -1):
            code = n
            for i, tok in enumerate(context[-n:]):
                code |= int(tok) << (2 + self.bits * i)
            codes.append(code)
        at = np.searchsorted(self.keys, codes).tolist() if codes else []
        return [i for code, i in zip(codes, at) if i < self.keys.size and int(self.keys[i]) == code]

    def next_of(self, context: Sequence[int]) -> int | None:
        """The corpus's next token after the longest suffix of `context` (up to max_n tokens) it holds; None if none."""
        known = self._known(context)
        return int(self.next_token[known[0]]) if known else None

    def chain(self, context: Sequence[int], depth: int) -> list[int]:
        """Up to `depth` tokens drafted greedily after `context` (history + root)."""
        ctx = list(context[-self.max_n:])
        out: list[int] = []
        while len(out) < depth:
            tok = self.next_of(ctx)
            if tok is None:
                break
            out.append(tok)
            ctx = (ctx + [tok])[-self.max_n:]
        return out

    def runner_up(self, context: Sequence[int]) -> int | None:
        """The second most likely next token after `context`: the runner-up of its longest known suffix, or, where
        that suffix was only ever followed by one token, the best next of a shorter suffix that differs from it."""
        known = self._known(context)
        if not known:
            return None
        best = int(self.next_token[known[0]])
        for i in known:  # the longest suffix's runner-up, else a shorter one's best or runner-up that is not `best`
            for tok in (int(self.next_token[i]), int(self.second[i])):
                if tok >= 0 and tok != best:
                    return tok
        return None

    def branches(self, context: Sequence[int], depth: int, second_depth: int = 0) -> list[list[int]]:
        """The greedy chain of `depth` tokens and, with second_depth > 0, a second branch of that many tokens: the
        runner-up after `context`, then greedy. Each is a prefix of the same call's with a larger depth."""
        out = [self.chain(context, depth)]
        if second_depth > 0:
            tok = self.runner_up(context)
            if tok is not None:
                out.append([tok] + self.chain(list(context) + [tok], second_depth - 1))
        return out

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"keys": torch.from_numpy(self.keys), "next": torch.from_numpy(self.next_token),
                   "count": torch.from_numpy(self.count), "next2": torch.from_numpy(self.second)}, str(tmp),
                  metadata={"format": FORMAT, "info": json.dumps(self.info.to_dict())})
        tmp.replace(path)  # atomic: a reader never sees half a corpus
        return path

    @staticmethod
    def read_info(path: str | Path) -> CorpusInfo:
        """A corpus file's CorpusInfo from its header alone (the arrays are not read)."""
        path = Path(path)
        if not path.is_file():
            raise UserError(f"corpus file {path} does not exist; build one with python -m decode.corpus")
        try:
            with safe_open(str(path), "pt") as f:
                meta, names = f.metadata() or {}, set(f.keys())
        except (SafetensorError, OSError) as err:
            raise UserError(f"{path} is not a readable corpus file ({str(err).splitlines()[0][:120]}); "
                            "build it again with python -m decode.corpus") from None
        if meta.get("format") not in FORMATS or not {"keys", "next", "count"} <= names:
            raise UserError(f"{path} is not a corpus file of format {FORMAT}; "
                            "build it again with python -m decode.corpus")
        raw = json.loads(meta.get("info", "{}"))
        return CorpusInfo(**{**raw, "sources": tuple(raw.get("sources", ()))})

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None) -> "NgramCorpus":
        info = cls.read_info(path)
        if vocab_size is not None and info.vocab_size != vocab_size:
            raise UserError(f"corpus {path} was built for a vocabulary of {info.vocab_size} tokens, not {vocab_size}; "
                            "build one with this target's tokenizer")
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as err:
            raise UserError(f"{path} is not a readable corpus file ({str(err).splitlines()[0][:120]}); "
                            "build it again with python -m decode.corpus") from None
        second = tensors["next2"].numpy() if "next2" in tensors else None  # none in v1 files
        return cls(tensors["keys"].numpy(), tensors["next"].numpy(), tensors["count"].numpy(), info, second)


def corpus_file(path: str | Path) -> Path:
    """A corpus file given as itself or as a draft folder holding one (DIR/corpus.safetensors)."""
    path = Path(path)
    return path / CORPUS_NAME if path.is_dir() else path
