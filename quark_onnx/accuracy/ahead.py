"""Compute an iterator's next item on a helper thread while the caller works on the current one.

The layer walks of the accuracy stages pull, per sample, one value from the float replay and one
from the quantized replay, then reduce the pair in numpy. The float replay depends on nothing the
walk changes, so its next sample can run while the caller runs the quantized model and reduces:
onnxruntime releases the GIL during a run, and the float and quantized segments are separate
sessions, so on two cores the two models run side by side instead of one after the other. The
values are those of a plain iteration (each session computes what it computes on any thread).

Only one item is computed ahead: the memory cost is one more sample of the float segments'
tensors.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


def ahead(items: Iterator[T], pool: concurrent.futures.Executor) -> Iterator[T]:
    """Yield the items of ``items``, computing each next one in ``pool`` (one worker) while the
    caller holds the current one.

    ``items`` is only ever advanced by one thread at a time, and never again after this generator
    ends: on an early exit (an exception in the caller, ``close()``) the step in flight is waited
    for first, so nothing still runs on the iterator's objects when the caller goes on. An
    exception raised by ``items`` is raised here, at the item it replaced.
    """

    def step() -> object:
        return next(items, _DONE)

    pending = pool.submit(step)
    try:
        while True:
            item = pending.result()
            if item is _DONE:
                return
            pending = pool.submit(step)
            yield item  # type: ignore[misc]
    finally:
        # an early exit leaves a step running on ``items``: it must end before the caller goes on
        with contextlib.suppress(Exception):
            pending.result()
