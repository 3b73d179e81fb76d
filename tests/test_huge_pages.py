"""Transparent huge pages (engine/huge_pages.py): the advice lands on the KV cache's own memory
(the kernel's VMA flags say so) and the cache is still all zeros; collapsing written tensors keeps
their bytes. The model runner's weights: tests/test_bf16.py (on its bf16 runner)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages
from engine.kv_cache import KVCacheSpec, PagedKVCache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The bracketed mode of THP ('always', 'madvise', 'never'), '' when the file is absent."""
    text = THP.read_text() if THP.exists() else ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def vma_flags(address: int) -> list[str]:
    """VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_advise_covers_the_aligned_interior_only():
    t = torch.empty(3 * HUGE_PAGE_BYTES + 12345, dtype=torch.uint8)
    start, end = t.data_ptr(), t.data_ptr() + t.numel()
    expected = (end // HUGE_PAGE_BYTES - -(-start // HUGE_PAGE_BYTES)) * HUGE_PAGE_BYTES
    got = advise_huge_pages(t)
    if sys.platform.startswith("linux") and thp_mode() in ("always", "madvise"):
        assert got == expected >= 2 * HUGE_PAGE_BYTES
    else:   # no THP here: nothing advised, and the call says so instead of failing
        assert got == 0
    assert advise_huge_pages(torch.empty(1000, dtype=torch.uint8)) == 0      # under one huge page
    assert advise_huge_pages(t[::2]) == 0                                    # not contiguous


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages need Linux with THP enabled (always or madvise)")
def test_kv_cache_memory_is_advised_for_huge_pages_and_zeroed():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, num_blocks=256,
                       dtype=torch.bfloat16)   # 6 MiB
    cache = PagedKVCache(spec)
    middle = cache.data.data_ptr() + cache.data.numel() * cache.data.element_size() // 2
    assert "hg" in vma_flags(middle)   # MADV_HUGEPAGE is set on the cache's own mapping
    assert cache.data.count_nonzero().item() == 0


def test_merged_joins_overlapping_and_adjacent_page_runs():
    from engine.huge_pages import _merged

    assert _merged([(5, 7), (0, 2), (2, 3), (6, 9), (11, 12)]) == [(0, 3), (5, 9), (11, 12)]
    assert _merged([]) == []


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages need Linux with THP enabled (always or madvise)")
def test_collapse_keeps_the_bytes_and_advises_the_tensors_pages():
    from engine.huge_pages import collapse_into_huge_pages

    tensors = [torch.randn(n, dtype=torch.float32) for n in (3 << 20, 1000, 700_000)]   # 12 MiB, 4 KB, 2.8 MB
    before = [t.clone() for t in tensors]
    moved = collapse_into_huge_pages(tensors + [torch.empty(0)])
    # The kernel may refuse a page it has no huge page for (a fragmented host): the count is whole
    # pages, the contents never change, and the advice (the VMA's hg flag) is set either way.
    assert moved % HUGE_PAGE_BYTES == 0 and moved <= 16 * HUGE_PAGE_BYTES
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    assert "hg" in vma_flags(tensors[0].data_ptr() + 6 * HUGE_PAGE_BYTES)

