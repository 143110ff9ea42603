"""quark_onnx.runtime.memory: freed heap pages go back to the OS."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import numpy as np
import pytest

from quark_onnx.runtime import memory


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise AssertionError("no VmRSS line")


def test_release_never_raises_and_says_whether_it_could_trim() -> None:
    assert memory.release_freed_memory() is (memory._malloc_trim() is not None)
    if sys.platform.startswith("linux") and "glibc" in " ".join(platform.libc_ver()):
        assert memory._malloc_trim() is not None


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or memory._malloc_trim() is None,
    reason="malloc_trim is glibc's",
)
def test_freed_small_blocks_leave_the_resident_set() -> None:
    # 64 KiB arrays stay below glibc's mmap threshold: they live on the heap, whose freed pages
    # stay resident until trimmed
    blocks = [np.ones(8192) for _ in range(3000)]  # ~190 MiB
    top = np.ones(8192)  # allocated last: free() alone cannot shrink the heap from its end
    held = _rss_mb()
    del blocks
    before = _rss_mb()
    assert memory.release_freed_memory()
    after = _rss_mb()
    assert before > held - 50  # nothing was returned without the trim
    assert after < before - 100, (held, before, after)
    del top


def test_peak_rss_is_a_high_water_mark_in_mib() -> None:
    peak = memory.peak_rss_mb()
    if peak is None:
        pytest.skip("no getrusage")
    assert peak >= _rss_mb() - 1.0
    block = np.ones(50 * 1024 * 1024 // 8)  # 50 MiB, touched
    now = memory.peak_rss_mb()
    assert now >= peak
    assert now >= _rss_mb() - 1.0  # the block counts
    total_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    assert now < total_mib  # MiB, not KiB
    del block


@pytest.mark.skipif(memory.resident_mb() is None, reason="no /proc/self/statm")
def test_release_above_a_limit_trims_only_past_it(monkeypatch) -> None:
    now = memory.resident_mb()
    assert abs(now - _rss_mb()) < 5.0  # statm and status agree
    calls = []
    monkeypatch.setattr(memory, "release_freed_memory", lambda: calls.append(1) or True)
    assert memory.release_freed_memory_above(now + 1000.0) is False
    assert calls == []
    assert memory.release_freed_memory_above(now - 1.0) is True
    assert memory.release_freed_memory_above(None) is True
    assert calls == [1, 1]


def test_pipeline_drops_plan_and_copies_before_finalize_and_graph_before_check() -> None:
    import gc
    import weakref

    from quark_onnx.pipeline import sequencer

    class Node:  # a graph with a reference cycle, as onnx_ir's nodes and values make
        def __init__(self) -> None:
            self.me = self

    made = {"w": np.ones(3)}
    seen: dict = {}
    events: list[str] = []
    gc.disable()  # only an explicit collection frees the graph
    try:

        class Stages(sequencer.Stages):
            def load(self):
                graph = Node()
                seen["graph"] = weakref.ref(graph)
                return graph

            def plan(self, model):
                plan = Node()
                seen["plan"] = weakref.ref(plan)
                return plan

            def parameters(self, model, plan):
                return {}

            def insert(self, model, plan, parameters):
                return made

            def release(self):
                events.append("release")

            def finalize(self, model):
                gc.collect()
                events.append("finalize")
                seen["plan alive at finalize"] = seen["plan"]() is not None
                return "proto"

            def check(self, model):
                seen["graph alive at check"] = seen["graph"]() is not None

        outcome = sequencer.run(Stages())
    finally:
        gc.enable()
    assert events == ["release", "finalize"]
    assert seen["plan alive at finalize"] is False
    assert seen["graph alive at check"] is False
    # the parameters are copies, equal to what the stages made
    assert outcome.params is not made and outcome.params["w"] is not made["w"]
    np.testing.assert_array_equal(outcome.params["w"], made["w"])
