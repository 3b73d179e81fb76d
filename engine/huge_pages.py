"""Transparent huge pages (2 MiB) for the large CPU tensors a decode step reads: the paged KV
cache (advised before it is first touched) and the model's weights (collapsed in place after load).

Decode attention reads each sequence's K/V blocks wherever the block table puts them, so with
4 KiB pages nearly every block read is a TLB miss on top of the DRAM miss. Linux backs memory
with huge pages only where it is asked to (``/sys/kernel/mm/transparent_hugepage/enabled`` is
``madvise`` on these machines), so the cache asks: ``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned
part of the allocation before its first touch, and the zeroing that follows faults huge pages in.

Measured (bf16 SmolLM2-135M, decode batch 16, context 128, shuffled block tables, 2 threads,
2-core EPYC Zen 5, load ~3, both caches in one process, alternating steps, best of 20): the
step's paged attention 3.50 -> 3.05 ms, the whole step 15.6 -> 14.8 ms.

The weights stream from DRAM every decode step (the model's ~270 MB of bf16 through a 32 MB
L3), and the linears' packed copies are made by their kernels at load on 4 KiB pages:
``collapse_into_huge_pages`` moves the memory of the tensors a model holds onto huge pages
synchronously (``MADV_COLLAPSE``, Linux 6.1+): 0.15-1.6 s at load for SmolLM2-135M in bf16
(~460 MiB of 2 MiB pages; the slow end on a loaded host needing compaction), and resident memory
grows by ~58 MiB (944 -> 1002 MiB): the untouched parts of the 2 MiB pages at the tensors' edges
are faulted in by the collapse.

Where the advice cannot be given (not Linux, THP ``never``, not a CPU tensor) the tensor keeps
its 4 KiB pages: the same bytes, only slower.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Iterable, Iterator

import torch

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14   # linux/mman.h
MADV_COLLAPSE = 25

_madvise = None   # libc's madvise once looked up; False: unavailable


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Ask the kernel to back ``tensor``'s whole 2 MiB pages with transparent huge pages.

    tensor: a contiguous CPU tensor, best not yet touched (pages already faulted in stay 4 KiB
    until khugepaged collapses them). Returns the bytes advised (the 2 MiB-aligned interior of
    its memory; 0 when it is under 2 MiB, not on CPU, or the call is unavailable or refused,
    with the reason logged at debug level). Never raises.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    length = (end - first) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if length <= 0:
        return 0
    madvise = _libc_madvise()
    if madvise is None:
        return 0
    if madvise(first, length, MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return 0
    return length


def collapse_into_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Move the memory of ``tensors`` (already written) onto transparent huge pages in place.

    Every 2 MiB page that holds part of a strided CPU tensor is advised (MADV_HUGEPAGE, so it
    stays huge) and collapsed (MADV_COLLAPSE); the pages' contents are unchanged, and so are
    neighbouring allocations that share a 2 MiB page. Overlapping ranges are merged first (one
    call per run of pages). Returns the bytes collapsed; 0 where the calls are unavailable.
    A range the kernel refuses (a hole in the mapping, no huge page free) keeps its small pages.
    Never raises.
    """
    madvise = _libc_madvise()
    if madvise is None:
        return 0
    ranges = []
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided or t.numel() == 0:
            continue
        try:
            start = t.data_ptr()
        except RuntimeError:   # a tensor without storage
            continue
        end = start + t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
        ranges.append((start // HUGE_PAGE_BYTES, -(-end // HUGE_PAGE_BYTES)))
    done = 0
    for lo, hi in _merged(ranges):
        first, length = lo * HUGE_PAGE_BYTES, (hi - lo) * HUGE_PAGE_BYTES
        madvise(first, length, MADV_HUGEPAGE)
        if madvise(first, length, MADV_COLLAPSE) == 0:
            done += length
        else:   # some page of the run refused: collapse the others one at a time
            done += sum(HUGE_PAGE_BYTES for p in range(lo, hi)
                        if madvise(p * HUGE_PAGE_BYTES, HUGE_PAGE_BYTES, MADV_COLLAPSE) == 0)
    return done


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[lo, hi) page ranges, sorted, overlapping and adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def module_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The tensors a module tree holds in dict attributes of its modules: parameters and buffers
    (nn.Module keeps them in dicts) and the packed weight copies kernels/linear.py keeps per kernel."""
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, dict):
                yield from (t for t in value.values() if isinstance(t, torch.Tensor))


def _libc_madvise():
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _madvise = fn
            except (OSError, AttributeError) as exc:
                log.debug("no madvise: %s", exc)
    return _madvise or None
