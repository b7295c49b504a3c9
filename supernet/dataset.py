"""Reading (and the format of) the feature shards that `supernet.data` writes.

A data directory holds `manifest.json`, `token_counts.safetensors` ((V,) int64 counts of the
tokens the draft has to predict) and shards `shard-00000.safetensors`, ... Each shard holds S
sequences concatenated along the token axis (N tokens in all):

    offsets       (S+1,) int64   sequence s is rows offsets[s]:offsets[s+1]
    prompt_len    (S,)   int64   templated prompt tokens (image included); the answer follows
    input_ids     (N,)   int32
    topk_ids      (N, K) int32   target's top-k next-token ids at each position
    topk_logits   (N, K) fp32    their logits; p = exp(logit - lse) exactly
    lse           (N,)   fp32    logsumexp of the full next-token logits
    loss_mask     (N,)   bool    position t's next token is trained (text -> text, t < T-1)
    image_mask    (N,)   bool    image placeholder tokens
    attn_entropy  (N, L) fp32    per decoder layer attention entropy of each query (nats)
    attn_received (N,)   fp32    attention each token receives (mean over layers/heads/queries)
    hidden.<h>    (N, H) bf16    HF hidden state h (non-negative index; L = after the final norm)

Shard metadata (strings): format, content (hash of the settings that shape the data),
fingerprint (target weights digest), prompt_ids / sequence_ids (JSON lists), skipped (JSON).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import os
import random
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from decode.errors import UserError
from decode.targets.compat import check_fingerprint


@contextlib.contextmanager
def open_shard(path: Path):
    """safe_open with a one-line UserError for a missing, truncated or garbage file."""
    try:
        with safe_open(str(path), "pt") as f:
            yield f
    except (SafetensorError, OSError) as err:
        raise UserError(f"data file {path} cannot be read ({str(err).splitlines()[0][:120]}); rebuild the data with "
                        "supernet.data (it resumes from the intact shards)") from None


logger = logging.getLogger(__name__)

FORMAT = "1"
MANIFEST = "manifest.json"
COUNTS = "token_counts.safetensors"
SEQ_KEYS = ("input_ids", "topk_ids", "topk_logits", "lse", "loss_mask", "image_mask", "attn_entropy", "attn_received")
_STORE_DTYPES = {"input_ids": torch.int32, "topk_ids": torch.int32, "topk_logits": torch.float32, "lse": torch.float32,
                 "loss_mask": torch.bool, "image_mask": torch.bool, "attn_entropy": torch.float32,
                 "attn_received": torch.float32}
_LOAD_DTYPES = {"input_ids": torch.long, "topk_ids": torch.long}
HIDDEN_DTYPE = torch.bfloat16


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def write_shard(path: Path, seqs: list[dict], meta: dict[str, str]) -> int:
    """Write sequences (dicts as features_on_the_fly returns them) atomically; returns the file size."""
    lens = [int(s["input_ids"].numel()) for s in seqs]
    offsets = torch.tensor([0, *lens], dtype=torch.long).cumsum(0)  # (S+1,)
    tensors = {"offsets": offsets,
               "prompt_len": torch.tensor([int(s["prompt_len"]) for s in seqs], dtype=torch.long)}
    for key in SEQ_KEYS:
        parts = [s[key].to(_STORE_DTYPES[key]) for s in seqs]
        tensors[key] = torch.cat(parts) if parts else torch.zeros(0, dtype=_STORE_DTYPES[key])
    layers = sorted(seqs[0]["hidden"]) if seqs else []
    for h in layers:
        tensors[f"hidden.{h}"] = torch.cat([s["hidden"][h].to(HIDDEN_DTYPE) for s in seqs])  # (N, H)
    save_atomic(path, tensors, {"format": FORMAT, **meta})
    return path.stat().st_size


def save_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """safetensors file written to a temporary name, then renamed: the file is either absent or complete."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.chmod(tmp, 0o644)  # safetensors creates 0600 files
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def bytes_per_token(layers: int, hidden: int, topk: int, num_layers: int) -> int:
    """Disk bytes one token takes in a shard (for the size estimate logged before a build)."""
    # hidden bf16 + top-k (int32 id + fp32 logit) + lse, received (fp32) + id (int32) + 2 masks
    # + entropy (fp32 per layer)
    return 2 * hidden * layers + 8 * topk + 4 + 4 + 4 + 2 + 4 * num_layers


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def summarize_shards(out: Path, shards: list[dict], vocab: int, num_layers: int, top_n: int) -> dict:
    """Counts, token frequencies (also written to token_counts.safetensors) and the dataset's mean attention
    entropy per layer, read back from the complete shards."""
    counts = torch.zeros(vocab, dtype=torch.long)
    ent = torch.zeros(num_layers, dtype=torch.float64)
    tokens = loss_tokens = image_tokens = 0
    for s in shards:
        with open_shard(out / s["file"]) as f:
            ids, loss = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask")
            image, e = f.get_tensor("image_mask"), f.get_tensor("attn_entropy")
        # loss_mask is False at each sequence's last position, so a global shift never crosses sequences
        counts += torch.bincount(ids[1:][loss[:-1]], minlength=vocab)[:vocab]
        ent += e.double().sum(0) if e.numel() else 0
        tokens += ids.numel()
        loss_tokens += int(loss.sum())
        image_tokens += int(image.sum())
    save_atomic(out / COUNTS, {"counts": counts})
    mean = (ent / max(tokens, 1)).tolist()
    return {"counts": {"sequences": sum(s["sequences"] for s in shards), "tokens": tokens, "loss_tokens": loss_tokens,
                       "image_tokens": image_tokens},
            "top_tokens": torch.sort(-counts, stable=True).indices[:top_n].tolist(),  # most frequent first
            "dataset_mean_entropy": [round(v, 5) for v in mean]}


def read_shard_meta(path: Path) -> dict[str, str] | None:
    """The metadata of a complete shard, or None when the file is missing or unreadable."""
    try:
        with safe_open(str(path), "pt") as f:
            return dict(f.metadata() or {})
    except (OSError, SafetensorError) as err:
        if path.exists():
            logger.warning("shard %s is unreadable (%s); it will be rebuilt", path.name, err)
        return None


def read_manifest(directory: Path) -> dict | None:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {path} ({err.__class__.__name__}); delete the directory and build it "
                        "again") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{path} is not a data manifest (a JSON {type(manifest).__name__}, an object expected); "
                        "delete the directory and build it again with python -m supernet.data")
    return manifest


def check_target(manifest: dict, fingerprint: dict, target_name: str, directory: Path,
                 hint: str = "use another --out or the matching target") -> None:
    """One-line UserError when a data directory was made for another target; `hint`: what the caller's user
    can do about it (supernet.data: write elsewhere; a reader such as supernet.train: pass the right target)."""
    theirs = manifest.get("target", {})
    if check_fingerprint(theirs.get("fingerprint") or {}, fingerprint, f"data {directory}"):
        def show(fp: dict) -> str:
            return f"{fp.get('family')}, {fp.get('num_layers')} layers, config {fp.get('config_hash')}, " \
                   f"weights {fp.get('weights_digest')}"

        raise UserError(f"{directory} holds features of target '{theirs.get('name')}' "
                        f"({show(theirs.get('fingerprint') or {})}), not of '{target_name}' ({show(fingerprint)}); "
                        + hint)


class FeatureData:
    """The sequences of a data directory, read lazily: one sequence's rows per read (shards memory-mapped)."""

    def __init__(self, directory: str | Path, target: object = None):
        self.dir = Path(directory)
        manifest = read_manifest(self.dir)
        if manifest is None:
            raise UserError(f"no {MANIFEST} in {self.dir}; build the data with: python -m supernet.data "
                            f"--out {self.dir}")
        if not isinstance(manifest.get("target"), dict) or not isinstance(manifest.get("shards"), list):
            raise UserError(f"{self.dir / MANIFEST} is not a data manifest ('target' and 'shards' missing or "
                            "malformed); delete the directory and build it again with python -m supernet.data")
        if manifest.get("format") != FORMAT:
            raise UserError(f"{self.dir} has data format {manifest.get('format')!r}, this code reads {FORMAT!r}; "
                            "rebuild it")
        if target is not None:
            check_target(manifest, target.fingerprint().to_dict(), target.name, self.dir,
                         hint=f"pass --target {manifest['target'].get('name')}, or build data for '{target.name}' "
                              "with python -m supernet.data")
        self.manifest = manifest
        self.shards = [s for s in manifest["shards"] if s["complete"]]
        if len(self.shards) < len(manifest["shards"]):
            logger.warning("%s: %d of %d shards are incomplete; rerun supernet.data to finish them", self.dir,
                           len(manifest["shards"]) - len(self.shards), len(manifest["shards"]))
        self._starts = [0]
        for s in self.shards:
            self._starts.append(self._starts[-1] + s["sequences"])
        self.ids: list[str] = [i for s in self.shards for i in s["sequence_ids"]]  # prompt id of each sequence
        self._open: dict[int, tuple] = {}  # shard index -> (safe_open handle, offsets, prompt_len)
        self._counts: torch.Tensor | None = None

    # ------------------------------------------------------------------ description
    @property
    def layers(self) -> tuple[int, ...]:
        """Stored hidden-state indices (non-negative; num_layers = after the final norm)."""
        return tuple(self.manifest["layers"])

    @property
    def entropy_layer(self) -> int:
        return int(self.manifest["entropy"]["layer"])

    @property
    def num_layers(self) -> int:
        return int(self.manifest["target"]["fingerprint"]["num_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["target"]["fingerprint"]["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["target"]["fingerprint"]["vocab_size"])

    @property
    def topk(self) -> int:
        return int(self.manifest["config"]["topk"])

    @property
    def config(self):  # -> supernet.data.DataConfig with the entropy layer filled in
        from supernet.data import DataConfig

        return DataConfig(**{**self.manifest["config"], "entropy_layer": self.entropy_layer})

    def layer_index(self, layer: int) -> int:
        """The stored key of a (possibly negative) HF hidden-state index: -1 -> num_layers."""
        h = layer if layer >= 0 else self.num_layers + 1 + layer
        if h not in self.layers:
            raise UserError(f"hidden state {layer} is not stored in {self.dir} (stored: {list(self.layers)}); "
                            "rebuild the data with a search space that uses it")
        return h

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return self._starts[-1]

    def _shard(self, j: int):
        """Shard j opened for reading slices -> (handle, offsets (S+1,), prompt_len (S,)). The first opening reads
        the whole shard once to refuse non-finite values (NaN features would train NaN weights silently); later
        reads take only one sequence's rows (a training run's random order then costs one sequence per read, not
        a whole shard: at cpu scale 64 sequences and ~70 MB, ~100 ms a read, which was half of a fine-tuning step)."""
        entry = self._open.get(j)
        if entry is None:
            path = self.dir / self.shards[j]["file"]
            try:
                handle = safe_open(str(path), "pt")  # kept open: later reads slice it
                for k in handle.keys():
                    v = handle.get_tensor(k)
                    if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                        raise UserError(f"data shard {path} holds non-finite values (NaN/inf) in '{k}'; delete it "
                                        "and rebuild the data with supernet.data")
                    del v
                offsets, plen = handle.get_tensor("offsets"), handle.get_tensor("prompt_len")
            except (SafetensorError, OSError) as err:
                raise UserError(f"data file {path} cannot be read ({str(err).splitlines()[0][:120]}); rebuild the "
                                "data with supernet.data (it resumes from the intact shards)") from None
            entry = self._open[j] = (handle, offsets, plen)
        return entry

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range ({len(self)} sequences)")
        i %= len(self)
        j = bisect.bisect_right(self._starts, i) - 1
        f, offsets, plen = self._shard(j)
        s = i - self._starts[j]
        a, b = int(offsets[s]), int(offsets[s + 1])
        out: dict = {}
        for k in SEQ_KEYS:
            rows = f.get_slice(k)[a:b]  # a copy of rows a:b in the stored dtype
            out[k] = rows.to(_LOAD_DTYPES[k]) if k in _LOAD_DTYPES else rows
        out["hidden"] = {h: f.get_slice(f"hidden.{h}")[a:b].float() for h in self.layers}  # {h: (T, H)} fp32
        out["prompt_len"] = plen[s].clone()
        return out

    def scored_positions(self, answer_only: bool = True) -> list[int]:
        """Per sequence, how many positions a training loss scores (loss_mask, from the answer start when
        answer_only); reads only the small per-token masks of each shard, not the features."""
        out: list[int] = []
        for s in self.shards:
            with open_shard(self.dir / s["file"]) as f:
                offsets, plen, mask = f.get_tensor("offsets"), f.get_tensor("prompt_len"), f.get_tensor("loss_mask")
            for k in range(offsets.numel() - 1):
                a, b = int(offsets[k]), int(offsets[k + 1])
                start = a + max(int(plen[k]) - 1, 0) if answer_only else a
                out.append(int(mask[start:b].sum()) if start < b else 0)
        return out

    def token_counts(self) -> torch.Tensor:
        """(V,) int64: how often each token is a trained next token."""
        if self._counts is None:
            with open_shard(self.dir / COUNTS) as f:
                self._counts = f.get_tensor("counts")
        return self._counts

    def hot_tokens(self, n: int) -> torch.Tensor:
        """(n,) long: the n most frequent next tokens, by count (ties: lower id first)."""
        return most_frequent(self.token_counts(), n)

    # ------------------------------------------------------------------ train / validation
    def split(self, val_fraction: float = 0.05, min_val: int = 1, seed: int = 0) -> tuple[list[int], list[int]]:
        """(train, val) sequence indices; val is picked by a seeded hash of the prompt id (stable as data grows)."""
        n = len(self)
        n_val = min(max(min_val, round(val_fraction * n)), n - 1) if n > 1 else 0
        score = [hashlib.sha256(f"{seed}:{pid}".encode()).hexdigest() for pid in self.ids]
        val = set(sorted(range(n), key=lambda i: (score[i], i))[:n_val])
        return [i for i in range(n) if i not in val], sorted(val)

    def shard_grouped(self, indices: list[int], rng: random.Random) -> list[int]:
        """Shuffle `indices` shard by shard (shards in random order, sequences shuffled inside each)
        so that iterating loads each shard once."""
        groups: dict[int, list[int]] = {}
        for i in indices:
            groups.setdefault(bisect.bisect_right(self._starts, i) - 1, []).append(i)
        order = list(groups)
        rng.shuffle(order)
        out: list[int] = []
        for j in order:
            rng.shuffle(groups[j])
            out.extend(groups[j])
        return out


def most_frequent(counts: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) long: the n largest entries of counts (V,), ties to the lower id."""
    if not 1 <= n <= counts.numel():
        raise UserError(f"hot vocabulary of {n} tokens asked, the target vocabulary has {counts.numel()}")
    order = torch.sort(-counts, stable=True).indices  # (V,)
    return order[:n].clone()


class MixedData:
    """Several data folders of one target read as one: sequence i is the first folder's i-th, then the next
    folder's (len(first) + j is the second's j-th) ... Fine-tuning reads the supernet's training data together
    with the target's own answers this way; the shared negatives of the topk loss come from the summed counts."""

    def __init__(self, parts: list[FeatureData]):
        if not parts:
            raise ValueError("MixedData needs at least one data folder")
        vocab = {p.vocab_size for p in parts}
        if len(vocab) > 1:
            raise UserError(f"data folders {', '.join(str(p.dir) for p in parts)} were made for different targets "
                            f"(vocabularies {sorted(vocab)}); mix folders of one target")
        self.parts = parts
        self._starts = [0]
        for p in parts:
            self._starts.append(self._starts[-1] + len(p))

    @property
    def vocab_size(self) -> int:
        return self.parts[0].vocab_size

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range ({len(self)} sequences)")
        j = bisect.bisect_right(self._starts, i) - 1
        return self.parts[j][i - self._starts[j]]

    def token_counts(self) -> torch.Tensor:
        return sum(p.token_counts() for p in self.parts)

    def hot_tokens(self, n: int) -> torch.Tensor:
        return most_frequent(self.token_counts(), n)
