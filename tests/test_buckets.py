"""Padded sizes of the compiled runtime per device type: every size fits its bucket, CPU keeps its fine buckets
(few-row CPU forwards are not flat in the row count), a GPU pads to few buckets (one CUDA graph each)."""

from __future__ import annotations

import decode.drafts  # noqa: F401  (first: decode.runtime.draft_step and the drafts package import each other)
from decode.runtime.compiled import BUCKETS, CUDA_BUCKETS, bucket, buckets
from decode.runtime.draft_step import DRAFT_BUCKETS, draft_bucket, draft_buckets


def test_every_tree_size_fits_its_bucket_on_both_device_types():
    for kind in ("cpu", "cuda"):
        for n in range(1, 400):
            b = bucket(n, kind)
            assert b >= n and (b in buckets(kind) or b % buckets(kind)[-1] == 0), (kind, n, b)
            assert all(not n <= s < b for s in buckets(kind)), (kind, n, b)  # the smallest that holds n


def test_cpu_buckets_are_the_default():
    assert buckets() == buckets("cpu") == BUCKETS
    assert [bucket(n) for n in (1, 2, 3, 5, 6, 9, 10, 13, 33, 129)] == [1, 2, 4, 5, 8, 9, 12, 16, 64, 256]


def test_a_gpu_tree_of_up_to_64_nodes_takes_one_graph():
    assert {bucket(n, "cuda") for n in range(2, 65)} == {64} and bucket(1, "cuda") == 1
    assert len(CUDA_BUCKETS) < len(BUCKETS)


def test_draft_level_buckets_end_at_the_same_size():
    for kind in ("cpu", "cuda"):
        assert draft_buckets(kind)[-1] == DRAFT_BUCKETS[-1]
        assert all(draft_bucket(n, kind) >= n for n in range(1, DRAFT_BUCKETS[-1] + 1))
        assert draft_bucket(DRAFT_BUCKETS[-1] + 1, kind) is None  # larger levels run eagerly
    assert draft_bucket(3) == 4 and draft_bucket(3, "cuda") == 8
