"""The peer in the same bench: what transformers gives a user for free, timed like our methods.

    hf-generate       model.generate, greedy (dynamic cache, eager: the runtime our loop uses)
    hf-lookup:N[:M]   model.generate(prompt_lookup_num_tokens=N, max_matching_ngram_size=M), greedy
    hf-compiled       model.generate with a static cache and torch.compile (inductor on a CPU, CUDA graphs
                      on a GPU): the compiled vanilla decoding a user compares a speed-up against

hf-compiled keeps one StaticCache per target model, sized as our compiled runtime sizes its own (the longest
prompt + answer asked for, rounded up by decode.runtime.compiled.cache_len; grown, never shrunk), so that every
prompt runs the one compiled step graph: the prefill is not compiled and the cache tensors keep their shape.
The compilation happens in the bench's untimed warm-up; a prompt that outgrows the cache recompiles once (logged).

Timed as a whole (prefill included, as every method's wall time is); HF does not report its forward
count, so tau is not known for these rows. Greedy only: HF's sampling draws differ from ours.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch

from decode.errors import UserError
from decode.loop.vanilla import GenerationResult, sync_device
from decode.prompt import Prompt
from decode.runtime.compiled import cache_len
from decode.targets.compat import cache_kwargs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HFSpec:
    lookup_tokens: int = 0  # 0: plain generate
    max_ngram: int = 2  # HF's default max_matching_ngram_size
    compiled: bool = False  # static cache + torch.compile (hf-compiled)

    @classmethod
    def parse(cls, spec: str) -> "HFSpec":
        if spec == "hf-generate":
            return cls()
        if spec == "hf-compiled":
            return cls(compiled=True)
        parts = spec.split(":")
        try:
            n = int(parts[1]) if len(parts) > 1 else 10
            m = int(parts[2]) if len(parts) > 2 else 2
        except ValueError:
            raise UserError(f"bad method '{spec}': use hf-lookup:N[:M] with integers") from None
        if parts[0] != "hf-lookup" or len(parts) > 3 or n < 1 or m < 1:
            raise UserError(f"bad method '{spec}': use hf-generate, hf-compiled or hf-lookup:N[:M] (N, M >= 1)")
        return cls(lookup_tokens=n, max_ngram=m)

    @property
    def name(self) -> str:
        if self.compiled:
            return "hf-compiled"
        return "hf-generate" if not self.lookup_tokens else f"hf-lookup:{self.lookup_tokens}:{self.max_ngram}"


def is_hf_spec(spec: str) -> bool:
    return spec in ("hf-generate", "hf-compiled") or spec.startswith("hf-lookup")


_static: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target.model -> (positions, its StaticCache)


def _static_cache(target, need: int):
    """The target's StaticCache, emptied, with room for `need` positions (a new, larger one when short)."""
    from transformers import StaticCache

    have, cache = _static.get(target.model, (0, None))
    if cache is None or have < need:
        size = cache_len(need)
        if cache is not None:
            logger.warning("hf-compiled: a prompt needs %d positions: a new static cache of %d (recompiles)", need, size)
        cache = StaticCache(config=target.model.config, max_cache_len=size)
        _static[target.model] = (size, cache)
    cache.reset()
    return cache


def _compile_config(device: torch.device):
    from transformers.generation.configuration_utils import CompileConfig

    # reduce-overhead (CUDA graphs) on a GPU, plain inductor elsewhere; HF compiles on CUDA only unless told
    cc = CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead" if device.type == "cuda" else "default")
    cc._compile_all_devices = True
    return cc


@torch.no_grad()
def hf_generate(target, prompt: Prompt, max_new_tokens: int, spec: HFSpec) -> GenerationResult:
    inputs = {k: v.to(target.device) if torch.is_tensor(v) else v for k, v in prompt.model_inputs.items()}
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(target.dtype)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(target.eos_token_ids),
                  pad_token_id=target.tokenizer.pad_token_id or sorted(target.eos_token_ids)[0])
    if spec.lookup_tokens:
        kwargs.update(prompt_lookup_num_tokens=spec.lookup_tokens, max_matching_ngram_size=spec.max_ngram)
    if spec.compiled:
        kwargs.update(**cache_kwargs(target.model, _static_cache(target, prompt.length + max_new_tokens)),
                      compile_config=_compile_config(target.device))
    sync_device(target.device)
    t0 = time.perf_counter()
    out = target.model.generate(**inputs, **kwargs)
    sync_device(target.device)
    dt = time.perf_counter() - t0
    tokens = out[0, prompt.length:].tolist()
    return GenerationResult(tokens=tokens, text=target.tokenizer.decode(tokens, skip_special_tokens=True),
                            prefill_s=0.0, decode_s=dt, target_forwards=0)
