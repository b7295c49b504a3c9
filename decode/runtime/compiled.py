"""The compiled runtime: a static KV cache, trees padded to fixed buckets, torch.compile'd target forwards.

The eager runtime (TargetModel's default) grows a DynamicCache by concatenation and runs every tree at
its own size, so each cycle has new shapes and the host does a little work per layer. Here:

- the target's KV cache is allocated once per TargetModel (`max_len` positions, every layer a full
  StaticLayer; sliding windows still come from the masks) and reused by every prompt at the same
  addresses. The cache is sized to what the generation asks for (`reserve`: prompt + answer + the largest
  tree, plus one, rounded up to GRAIN) and grows, with one recompilation, only for a longer prompt or
  answer; it never shrinks (a tree that outgrows it anyway gets a larger one holding the committed
  entries). On a CPU, attention reads only the window of the first past + B positions: the mask is that
  long, its length a dynamic dimension of the graph (no recompilation as it grows), and the attention
  function (decode.targets.attention) slices the cache's keys to it. Attending over all max_len positions
  (masked), as the CUDA graphs still do (their shapes must be fixed), cost the default target 23.0 ms per
  vanilla step and 32.9 ms per speculative cycle on 5 held-out prompts on a 2-core AMD EPYC, against 19.8
  and 28.9 ms with the window (the warm-up prompt, the longest, sizes the cache for all). A tree's N tokens
  are written at committed..committed+B-1 (B = N padded to a bucket), committing the accepted path is an in-place
  copy of its m entries to committed..committed+m-1, and entries beyond the committed length are stale
  but always masked out;
- a tree of N nodes runs as B >= N tokens (buckets 1, 2, 4, 5, 8, 16, ...): the B - N dummy nodes attend only
  to themselves and their outputs are dropped, so they never change a token (tested);
- the decoder forward + LM head of one bucket is one torch.compile graph (inductor on a CPU, CUDA graphs
  through mode "reduce-overhead" on a GPU); on a CPU its few-row linear layers take the product measured
  faster on this machine before the bucket is traced (decode.runtime.small_rows); positions, masks and
  cache writes are tensors, so the committed length changes nothing but their values: one compilation per
  (bucket, feature layers), in the untimed warm-up, none per cycle.

The prefill stays eager (one call per prompt, its own length) on a DynamicCache whose entries are then copied
into the static cache (`load`). Drafts keep their own eager forwards.
"""

from __future__ import annotations

import itertools
import logging

import torch
from transformers.cache_utils import Cache, StaticLayer

from decode.errors import UserError
from decode.runtime.small_rows import measure_linears
from decode.targets.attention import PACKED_SDPA
from decode.targets.capture import register_capture
from decode.targets.compat import cache_arg

logger = logging.getLogger(__name__)

RUNTIMES = ("eager", "compiled")
ANSWER_ROOM = 384  # positions a prefill leaves free for the answer and its trees when the caller names none
GRAIN = 128  # the static cache's length is a multiple of this
# 5: a root and 4 drafted tokens (4x1/4, 2x2/4: the trees a CPU profile picks) padded to 8 cost 1.32x a compiled
# step, run as 5 rows 0.99x, on a 2-core AMD EPYC (benchmarks/results/runtime-verify-ab-cpu.json); 6-7 rows cost
# about what 8 cost there, so they stay padded. 9 and 12: since the native kernel takes up to 12 rows in one pass over
# the weights, 9 rows cost 1.22 eager steps and 12 1.40 where 16 cost 1.81 (benchmarks/results/
# native-kernel-ab-tiles-cpu.json): a neural tree of 5 merged with a 4-token lookup branch (9) was padded to 16
BUCKETS = (1, 2, 4, 5, 8, 9, 12, 16, 32, 64, 128)
# On a GPU a tree forward of this target is launch-bound far beyond 64 tokens (H200, eager: 24.6 ms at 1 token,
# 26.5-28.7 ms at every size from 2 to 128; profiles/h200-smolvlm-135m.json), so padding costs next to nothing there,
# while every bucket is one more CUDA-graph compilation at start-up: measured on an H200 (torch 2.11), compiling the
# 7 buckets and 12 draft-level graphs of a 2x8/32 + lookup design took over 2 minutes. Two buckets cover its trees.
CUDA_BUCKETS = (1, 64, 128)
RECOMPILE_LIMIT = 256


def buckets(device_type: str = "cpu") -> tuple[int, ...]:
    """The tree sizes the compiled runtime pads to on a device type ("cpu", "cuda", ...)."""
    return CUDA_BUCKETS if device_type == "cuda" else BUCKETS


def bucket(n: int, device_type: str = "cpu") -> int:
    """The padded size of an n-node tree on a device type: the smallest bucket >= n (then multiples of 128)."""
    sizes = buckets(device_type)
    for b in sizes:
        if n <= b:
            return b
    return -(-n // sizes[-1]) * sizes[-1]


def cache_len(needed: int) -> int:
    """Positions of a static cache that must hold `needed`: rounded up to GRAIN (also hf-compiled's size)."""
    return -(-needed // GRAIN) * GRAIN


def check_runtime(name: str) -> str:
    if name not in RUNTIMES:
        raise UserError(f"--runtime must be one of {', '.join(RUNTIMES)}, got {name!r}")
    return name


def graph_count() -> int:
    """Graphs torch.compile has built in this process (dynamo's counter): a recompilation adds one."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def allow_many_graphs() -> None:
    """One graph per (bucket, feature layers, target) here and per (bucket, logits rows) for a draft: dynamo's
    default limit of 8 graphs per function would silently fall back to eager after the 8th."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)


# Inductor's own CPU kernels (the norms, rotary, activations and residual adds fused between the linear layers) run
# on one thread: a decoding graph feeds them 1-16 rows, far too little work to split, and splitting it cost a
# synchronisation per kernel. In-process timings of the default target's compiled tree forward on a 2-core AMD EPYC
# (median of 4, after warm-up): 29.9 / 33.2 / 36.2 ms for 1 / 5 / 8 tokens with inductor's default threads, 28.0 /
# 28.0 / 28.9 with one (the fused kernels' own time 3.7 / 6.3 / 6.3 -> 2.6 / 3.1 / 4.0 ms). The linear layers (the
# native kernel, its own threads) and attention (aten) keep every core.
CPU_OPTIONS = {"cpp.threads": 1}


def compile_tag(device_type: str) -> str:
    """How compile_step compiles on `device_type`: profiles of the compiled runtime record it (nas.hardware checks)."""
    if device_type == "cuda":
        return "reduce-overhead"
    # "+window": attention over the window of the static cache that holds entries (StaticRunner.windowed); profiles
    # measured before it priced every step's attention over the whole cache. "+frozen-guards": no guards on the
    # target's modules (frozen_guards), 1.2 ms less per call
    return "inductor:" + ",".join(f"{k}={v}" for k, v in sorted(CPU_OPTIONS.items())) + "+window+frozen-guards"


_OWNERS = itertools.count(1)  # runner serial numbers: graphs guard on their owner's (frozen_guards)


def frozen_guards(attr: str):
    """A torch.compile guard filter for a runner's method that drops every guard on what it reaches through
    `self.<attr>`: a model whose modules, weights, hooks and config never change while it decodes (a new model
    is a new runner). Guards on the method's arguments, the runner's own state (the static cache, the feature
    store) and globals stay. The default target's compiled forward carried 6,938 guards, 6,133 of them on the
    model (empty hook dicts, attributes absent from module dicts, types), and checking them took 1.46 ms of every
    call on a 2-core AMD EPYC, 0.28 ms without them. Hidden-state hooks are re-registered only with a new
    feature-layer tuple, an argument the graph is guarded on (tests/test_compiled_runtime.py). Runners of one class
    share their method's code and so dynamo's graphs: the traced method reads its runner's `owner` serial number,
    a guarded constant, so that no runner takes a graph traced on another's model (check_owner)."""
    prefix = f"self.{attr}"

    def keep(entries) -> list[bool]:
        return [not (e.name == prefix or e.name.startswith((prefix + ".", prefix + "["))) for e in entries]

    return keep


def new_owner() -> int:
    """A serial number for a compiled runner (check_owner)."""
    return next(_OWNERS)


def check_owner(runner) -> None:
    """Called inside a traced method: its graph then guards on the runner's serial number (frozen_guards)."""
    if runner.owner <= 0:
        raise RuntimeError("a compiled runner without its serial number")


def compile_step(fn, device_type: str, frozen: str | None = None):
    """torch.compile for a decoding step on `device_type`: CUDA graphs on a GPU; inductor with CPU_OPTIONS on a CPU,
    without guards on self.<frozen> (frozen_guards) when named. -> (the compiled function, whether it replays CUDA
    graphs). On a GPU every guard stays: mode="reduce-overhead" and options exclude each other (not measured there)."""
    allow_many_graphs()
    if device_type == "cuda":
        return torch.compile(fn, dynamic=False, mode="reduce-overhead"), True
    options = dict(CPU_OPTIONS) | ({"guard_filter_fn": frozen_guards(frozen)} if frozen else {})
    return torch.compile(fn, dynamic=False, options=options), False


class StaticRunner:
    """The compiled tree forward of one TargetModel over its static cache."""

    def __init__(self, target):
        self.target = target
        self.limit = int(getattr(target.text_config, "max_position_embeddings", 0) or 1 << 20)
        self.max_len, self.cache = 0, None  # allocated by the first reset, at the size it asks for
        self.length = 0  # committed entries, kept on the host (the cache's own counters live on the device)
        # self._graphs (CUDA graphs): outputs live in buffers the next replay overwrites
        self.owner = new_owner()
        self._compiled, self._graphs = compile_step(self._forward, target.device.type, frozen="target")
        self._cache_arg = cache_arg(target.decoder)  # `cache` or `past_key_values` (decode/targets/compat.py)
        # hidden-state hooks stay registered between calls (registering them inside the compiled function would
        # break its graph; new hooks on every call would recompile it): re-registered only when the layers change
        self._store: dict[int, torch.Tensor] = {}
        self._hooks: list = []
        self._hooked: tuple[int, ...] | None = None
        # attention over a window of the static cache (module docstring): CPU graphs whose attention function
        # slices the keys to the mask's length (decode.targets.attention); CUDA graphs keep the whole cache
        self.windowed = target.model.config._attn_implementation == PACKED_SDPA and not self._graphs
        self._measured: set[int] = set()  # buckets whose linear kernels were chosen (small_rows.measure_linears)

    def _capture(self, feature_layers: tuple[int, ...]) -> None:
        if feature_layers == self._hooked:
            return
        for h in self._hooks:
            h.remove()
        t = self.target
        self._hooks = register_capture(t.decoder, feature_layers, t.num_layers, self._store)
        self._hooked = feature_layers

    # ------------------------------------------------------------------ cache
    def _allocate(self, needed: int, keep: int = 0) -> None:
        """A new static cache of `needed` positions rounded up to GRAIN (at most the target's limit), holding the
        first `keep` entries of the old one. New tensors: the graphs recompile once for them."""
        old = self.cache
        # one spare position: a window (past + bucket <= needed, see forward_tree) as long as the cache would be
        # another graph (a full-length slice of the cache is contiguous, a shorter one is not)
        self.max_len = min(cache_len(needed + 1), self.limit)
        self.cache = Cache(layers=[StaticLayer(max_cache_len=self.max_len) for _ in range(self.target.num_layers)])
        if old is not None and keep:
            self._fill(old, keep)

    def _fill(self, src: Cache, length: int) -> None:
        """Copy the first `length` entries of every layer of `src` into the static cache."""
        for layer, s in zip(self.cache.layers, src.layers):
            if not layer.is_initialized:
                layer.lazy_initialization(s.keys, s.values)
            layer.keys[..., :length, :].copy_(s.keys[..., :length, :])
            layer.values[..., :length, :].copy_(s.values[..., :length, :])

    def load(self, prefilled: Cache, length: int, reserve: int | None = None) -> Cache:
        """The static cache holding a prefill's `length` entries per layer (copied from the DynamicCache the
        prefill ran on), lengths at `length`, with room for `reserve` more positions (answer and trees;
        ANSWER_ROOM when None): the same tensors as for the last prompt (stale entries stay masked), a larger
        cache first when these do not fit. The prefill runs on a dynamic cache because on a static one every
        prompt token attended over all max_len positions (masked): at a 600-token prompt and max_len 1024 that
        cost 3.6 s against 1.8 s on 2 CPU cores, and eager attention for the attention statistics 6.3 s against
        3.3 s."""
        needed = length + (ANSWER_ROOM if reserve is None else reserve)
        if self.cache is None or (needed > self.max_len and self.max_len < self.limit):
            self._allocate(needed)
        self._fill(prefilled, length)
        self.set_length(length)
        return self.cache

    def set_length(self, n: int) -> None:
        """Every layer's next write goes to position n (in place: the compiled graphs hold these addresses)."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(n)
        self.length = n

    def commit(self, past: int, src: torch.Tensor, moved: bool = True) -> None:
        """Copy the cache entries at positions `src` (m,) to past..past+m-1 in every layer; the length becomes
        past + m. Only the accepted path moves: a few rows per layer. moved: False when src already is
        past..past+m-1 (the caller knows from its host-side path: nothing to copy, nothing read back)."""
        m = src.numel()
        dst = torch.arange(past, past + m, device=src.device)
        if moved:
            for layer in self.cache.layers:
                layer.keys.index_copy_(-2, dst, layer.keys.index_select(-2, src))
                layer.values.index_copy_(-2, dst, layer.values.index_select(-2, src))
        self.set_length(past + m)

    def committed(self, num_layers: int | None = None, length: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) views of the first `length` entries of the first num_layers layers."""
        layers = self.cache.layers[: num_layers or len(self.cache.layers)]
        return [(layer.keys[..., :length, :], layer.values[..., :length, :]) for layer in layers]

    def warm_buckets(self, up_to: int, feature_layers: tuple[int, ...], past: int, offset: int) -> list[int]:
        """Compile every bucket up to bucket(up_to) now, so that no tree size met later compiles in a timed run:
        dummy chains written after the `past` committed entries (a prefilled cache) and dropped. -> the buckets."""
        done = []
        kind = self.target.device.type
        for b in buckets(kind):
            if b > bucket(up_to, kind) or past + b > self.max_len:
                break
            dev = self.target.device
            chain = torch.ones(b, b, dtype=torch.bool, device=dev).tril()
            self.forward_tree(torch.zeros(b, dtype=torch.long, device=dev), chain, torch.arange(b, device=dev), past,
                              offset, feature_layers)
            done.append(b)
        self.set_length(past)
        return done

    # ------------------------------------------------------------------ forward
    def _forward(self, tokens: torch.Tensor, mask, positions: torch.Tensor, feature_layers: tuple[int, ...]):
        check_owner(self)
        t = self.target
        out = t.decoder(input_ids=tokens, attention_mask=mask, position_ids=positions,
                        **{self._cache_arg: self.cache}, use_cache=True)
        # popped, not read: the store is empty whenever the graph starts (its guards check that dict)
        return t._head(out.last_hidden_state[0]), {k: self._store.pop(k)[0] for k in feature_layers}

    def forward_tree(self, tokens: torch.Tensor, tree_mask: torch.Tensor, depths: torch.Tensor, past: int,
                     offset: int, feature_layers: tuple[int, ...]):
        """N tree tokens (N,), their (N, N) ancestor mask and depths after `past` committed entries ->
        ((N, V) logits, {layer: (N, H)}), through the compiled graph of N's bucket."""
        t = self.target
        n = tokens.numel()
        b = bucket(n, t.device.type)
        if past + b > self.max_len:
            if past + b > self.limit:
                raise UserError(f"this generation needs {past + b} positions and {t.name} holds {self.limit}; "
                                "shorten the prompt or --max-new-tokens")
            logger.warning("compiled runtime: a %d-node tree after %d positions outgrows the static cache of %d: "
                           "a larger one (recompiles)", n, past, self.max_len)
            self._allocate(past + b, keep=past)  # a caller that reserved too little: correct, but recompiles
        if b not in self._measured:  # few-row CPU products: the faster kernel, chosen before the bucket's tracing
            measure_linears(t.model, b)
            self._measured.add(b)
        dev = t.device
        pad = b - n
        tok = torch.cat([tokens, tokens.new_zeros(pad)]) if pad else tokens
        tent = torch.eye(b, dtype=torch.bool, device=dev)  # dummy nodes see only themselves
        tent[:n, :n] = tree_mask
        dep = torch.cat([depths, depths.new_zeros(pad)]) if pad else depths
        positions = (past + offset + dep)[None]  # (1, B)
        if t.spec.mrope:
            positions = positions[None].expand(3, 1, b)
        kv = past + b if self.windowed else self.max_len  # past + b <= max_len: the cache grew above if not
        mask = t._masks(tent, dep, dep, past, kv_len=kv)  # (1, 1, B, kv): the window, or the whole static cache
        if self.windowed:  # one graph for every window length ("maybe": at kv == max_len it may specialise)
            for m in (mask.values() if isinstance(mask, dict) else (mask,)):
                torch._dynamo.maybe_mark_dynamic(m, 3)
        self.set_length(past)
        feature_layers = tuple(dict.fromkeys(feature_layers))
        self._capture(feature_layers)
        self._store.clear()  # eager forwards (the prefill) fire these hooks too
        with torch.no_grad():  # the graphs are built without autograd; a caller with grad on must not add others
            logits, hidden = self._compiled(tok[None], mask, positions, feature_layers)
        if self._graphs:  # the draft keeps path features past the next forward: copy them out of the graph's buffers
            return logits[:n].clone(), {k: v[:n].clone() for k, v in hidden.items()}
        return logits[:n], {k: v[:n] for k, v in hidden.items()}
