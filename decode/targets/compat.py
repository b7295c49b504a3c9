"""Differences between transformers 5.x releases that the runtime must bridge.

* The forwards' KV-cache argument: `past_key_values` up to 5.1x, `cache` later (e.g. 5.17 against 5.25). An unknown
keyword is swallowed by the models' `**kwargs`, so passing the wrong one silently decodes without the cache:
every caller asks `cache_kwargs` for the name the module's own forward takes.
* The same target's config serialises differently (5.17 adds a top-level `pad_token_id` to the default target's
  that 5.25 leaves out), so a target fingerprint's config hash differs across releases while its family, sizes and
  weights digest do not: `check_fingerprint` lets only that through, with a warning, where an artifact bound to the
  target alone (a draft, a supernet, its data) is matched to it; profiles, which time one software stack, stay
  strict.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

logger = logging.getLogger(__name__)

SOFT_FINGERPRINT_KEYS = ("config_hash",)


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


def fingerprint_diff(theirs: dict, here: dict) -> tuple[str, bool]:
    """("key: theirs vs here, ..." for every differing key, fatal): not fatal when only SOFT_FINGERPRINT_KEYS differ."""
    keys = [k for k in dict.fromkeys([*here, *theirs]) if theirs.get(k) != here.get(k)]
    text = ", ".join(f"{k}: {theirs.get(k)!r} vs {here.get(k)!r}" for k in keys)
    return text, any(k not in SOFT_FINGERPRINT_KEYS for k in keys)


def check_fingerprint(theirs: dict, here: dict, what: str) -> str | None:
    """None when `what` (an artifact made for a target of fingerprint `theirs`) fits the target `here`, else the
    differences ("key: theirs vs here, ...") for the caller's error. A different config hash alone is let through with
    a warning: the sizes and weights digest still match, and a mismatched draft can only cost speed, never a token."""
    diff, fatal = fingerprint_diff(theirs, here)
    if fatal:
        return diff
    if diff:
        logger.warning("%s: the target's config serialises differently here (%s; there vs here: another transformers "
                       "release?); its sizes and weights match, using it", what, diff)
    return None
