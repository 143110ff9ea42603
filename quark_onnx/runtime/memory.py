"""Give memory the process no longer uses back to the operating system between stages.

The quantizer's stages are short-lived and large: onnxsim's simplification copies the model a few
times, calibration holds onnxruntime sessions and batches in flight, the accuracy stages replay
layers on many samples. When a stage ends its Python objects are freed, but glibc's allocator
keeps the freed pages of its heap (and of its per-thread arenas) mapped, so the resident set stays
at the stage's peak and the *next* stage's peak stacks on top of it. ``malloc_trim(0)`` returns
those pages, so every later stage's peak starts lower (``benchmarks/results/measurements.md``).

On other C libraries (musl, macOS, Windows) there is no ``malloc_trim`` and this does nothing.

Freed pages are returned only when nothing on them survives. Results made while a large graph
was being built (small objects and arrays per tensor, allocated between the graph's own) keep
pages of that graph after it is gone; :func:`compact` copies such results once the graph is
freed, into the holes it left, and the originals' pages go.

:func:`peak_rss_mb` reads the process's high-water mark, which the quantizer records after every
stage (``QuantizationReport.peak_rss_mb``): the stage after which it jumps is the one that set it.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Return the allocator's free pages to the OS (about 5 ms).

    No ``gc.collect()``: the stages' arrays are freed by reference counting when the stage
    returns, and a full collection costs ~55 ms once onnx_ir and onnxsim are imported.
    Returns True when the C library could be asked (glibc), False otherwise. Never raises.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    try:
        trim(0)
    except OSError as exc:  # pragma: no cover - a C library that exports the name but fails
        logger.debug("malloc_trim failed: %s", exc)
        return False
    return True


def resident_mb() -> float | None:
    """The process's resident set size now, in MiB (Linux ``/proc/self/statm``), else None."""
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * _PAGE_SIZE / 2**20


def release_freed_memory_above(limit_mb: float | None) -> bool:
    """:func:`release_freed_memory` only while the resident set is above ``limit_mb``.

    Trimming has a cost beyond its ~5 ms: pages handed back are faulted in again by the next
    allocation. A loop that frees and reallocates (a replay that runs one layer after another)
    trims only when what it holds has grown past its allowance. ``None`` (RSS unknown) trims.
    """
    if limit_mb is not None:
        now = resident_mb()
        if now is not None and now <= limit_mb:
            return False
    return release_freed_memory()


def peak_rss_mb() -> float | None:
    """The process's peak resident set size so far in MiB (``getrusage``), None where unknown."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return round(peak / (1024.0 * 1024.0 if sys.platform == "darwin" else 1024.0), 1)


def compact(value: T) -> T:
    """A deep copy of ``value``, made now: call it after the objects ``value`` was made among are
    freed and drop the original (module doc). Strings and numbers are shared, not copied."""
    return copy.deepcopy(value)
