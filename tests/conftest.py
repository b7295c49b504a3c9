"""Shared fixtures: tiny targets of every family (random weights, built from config objects)."""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch

from decode.images import bundled_photo
from decode.targets.loader import load_target

# Few-row kernel choices stay in memory in tests (and their CLI subprocesses): a test never writes into, nor is
# steered by, the user's per-machine table (decode.runtime.kernel_table); the table's own tests set a file.
os.environ["VLM_DRAFT_NAS_KERNEL_TABLE"] = "off"

TEXT_PRESETS = ("tiny-llama", "tiny-qwen2", "tiny-gemma3-text")
VLM_PRESETS = ("tiny-llava", "tiny-llava-next", "tiny-smolvlm", "tiny-gemma3", "tiny-qwen2.5-vl", "tiny-mistral3",
               "tiny-paligemma")
ALL_PRESETS = TEXT_PRESETS + VLM_PRESETS


@functools.lru_cache(maxsize=None)
def tiny_target(name: str):
    torch.manual_seed(0)
    return load_target(name, device="cpu", dtype="float32")


@functools.lru_cache(maxsize=None)
def photo(name: str = "astronaut"):
    return bundled_photo(name)


def tiny_prompt(target, text: str = "Tell me about the picture, please.", with_image: bool = True):
    return target.build_prompt(text, photo() if (with_image and target.is_vlm) else None)


@contextlib.contextmanager
def single_thread():
    """One torch thread inside, the previous count restored after (also when the code inside, e.g. a
    CLI's --threads, changes it). Tiny models gain nothing from intra-op threads, and on a shared 2-core
    box OpenMP threads spin against other processes (a 0.3 s test took 12 s with 2 threads under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def one_thread():
    """Every test runs single-threaded; module-scoped fixtures use `with single_thread():` themselves
    (they are set up before this function-scoped fixture)."""
    with single_thread():
        yield


@pytest.fixture(params=ALL_PRESETS)
def any_target(request):
    return tiny_target(request.param)
