"""The helper-thread iteration of the layer walks (quark_onnx.accuracy.ahead)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator

import pytest

from quark_onnx.accuracy.ahead import ahead


def test_yields_the_items_in_order_and_runs_the_iterator_off_the_caller_thread():
    threads: set[int] = set()

    def items() -> Iterator[int]:
        for i in range(5):
            threads.add(threading.get_ident())
            yield i

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        assert list(ahead(items(), pool)) == [0, 1, 2, 3, 4]
        assert list(ahead(iter([]), pool)) == []
    assert threading.get_ident() not in threads


def test_an_iterator_error_is_raised_at_its_item():
    def items() -> Iterator[int]:
        yield 1
        raise ValueError("boom")

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        got = []
        with pytest.raises(ValueError, match="boom"):
            for item in ahead(items(), pool):
                got.append(item)
    assert got == [1]


def test_an_early_exit_waits_for_the_step_in_flight():
    release = threading.Event()
    finished: list[int] = []

    def items() -> Iterator[int]:
        yield 0
        release.wait(5)
        finished.append(1)
        yield 1

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        walk = ahead(items(), pool)
        assert next(walk) == 0
        threading.Timer(0.05, release.set).start()
        walk.close()  # returns only once the step computing item 1 has ended
        assert finished == [1]
