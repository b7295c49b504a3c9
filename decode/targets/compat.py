"""Differences between transformers 5.x releases that the runtime must bridge.

The forwards' KV-cache argument: `past_key_values` up to 5.1x, `cache` later (e.g. 5.17 against 5.25). An unknown
keyword is swallowed by the models' `**kwargs`, so passing the wrong one silently decodes without the cache:
every caller asks `cache_kwargs` for the name the module's own forward takes.
"""

from __future__ import annotations

import functools
import inspect

import torch


def cache_arg(module: torch.nn.Module) -> str:
    """The KV-cache argument name of `module`'s forward (also what its `generate` takes); call it outside compiled
    code (dynamo traces through the lru_cache)."""
    return _cache_name(type(module))


@functools.lru_cache(maxsize=None)
def _cache_name(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(f"{cls.__name__}.forward takes neither `cache` nor `past_key_values`; this transformers "
                    "version is not supported")


def cache_kwargs(module: torch.nn.Module, cache: object) -> dict:
    """{cache_arg(module): cache}."""
    return {cache_arg(module): cache}
