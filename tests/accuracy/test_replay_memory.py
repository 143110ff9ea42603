"""Memory of the layer replay: the shared onnxruntime arena, what the first sample keeps, close().

Oracles: the resident set of this process (Linux) around a replay that keeps nothing between
samples, and brute force over the checkpoint choice.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_model
from onnx import TensorProto, helper

from quark_onnx.accuracy.replay import Replay
from quark_onnx.errors import QuantizationError
from quark_onnx.runtime import arena, memory


def _wide_conv(channels: int = 32, size: int = 128) -> object:
    """x (1,8,size,size) -> Conv 1x1 (8 -> channels) -> Relu -> y: a 2 MiB float output."""
    rng = np.random.default_rng(3)
    inits = {
        "w": rng.normal(0, 0.3, (channels, 8, 1, 1)).astype(np.float32),
        "b": rng.normal(0, 0.1, channels).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
        helper.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, size, size])],
        inits,
    )


def test_segment_sessions_share_one_arena():
    opts = arena.session_options()
    assert not opts.enable_cpu_mem_arena  # never an arena per session
    if arena._shared_arena():
        assert opts.get_session_config_entry("session.use_env_allocators") == "1"
    arena.release_arena()  # best effort, never raises


@pytest.mark.skipif(memory.resident_mb() is None, reason="needs /proc/self/statm")
def test_replay_heap_does_not_grow_with_the_samples():
    """Each sample runs the same segment and keeps nothing: the resident set must not grow.

    Allocating onnxruntime's 64-byte-aligned buffers straight from glibc grew the heap by about
    one 2 MiB output per run (freed chunks left unusable by small allocations in between):
    +80 MiB over these 40 samples. The shared arena reuses its regions.
    """
    proto = _wide_conv()
    rng = np.random.default_rng(4)
    samples = [{"x": rng.normal(0, 1, (1, 8, 128, 128)).astype(np.float32)} for _ in range(40)]
    # as after the earlier stages: a freed 30 MiB block raises glibc's mmap threshold, so
    # 2 MiB buffers come from the heap, not from fresh mappings
    big = np.ones(30 * 2**20 // 8)
    del big
    memory.release_freed_memory()
    # budget 0 and no allowance: the checkpoint never leaves the input, nothing is stored
    replay = Replay(proto, samples, "test", memory_budget=0, rerun_allowance=None)
    at: dict[int, float] = {}
    for i, (y,) in replay.stream(["y"]):
        assert y.shape == (1, 32, 128, 128)
        del y
        if i in (4, 39):
            now = memory.resident_mb()
            assert now is not None
            at[i] = now
    assert replay.checkpoint == 0 and not set(replay.env) - replay.graph_inputs
    assert at[39] - at[4] < 12.0, f"resident set grew {at[39] - at[4]:.1f} MiB over 35 samples"
    replay.close()


def test_first_sample_keeps_only_states_the_choice_can_fall_on():
    """The pruned candidates always contain the boundary the checkpoint moves to."""
    proto = _wide_conv(channels=4, size=8)
    samples = [{"x": np.zeros((1, 8, 8, 8), np.float32)} for _ in range(4)]
    rng = np.random.default_rng(5)
    replay = Replay(proto, samples, "test", memory_budget=1000, rerun_allowance=0.0)
    for trial in range(300):
        replay.checkpoint = int(rng.integers(0, 5))
        end = replay.checkpoint + int(rng.integers(1, 12))
        replay.cursor = end
        replay._nodes_run = int(rng.integers(0, 3 * end))
        span = np.arange(replay.checkpoint + 1, end + 1)
        boundaries = sorted(rng.choice(span, min(len(span), int(rng.integers(1, 6))), False))
        boundaries[-1] = end
        sizes: dict[int, int] = {}
        kept: set[int] = set()
        for b in boundaries:  # as the first sample measures them, pruning as it goes
            sizes[int(b)] = int(rng.integers(0, 600))
            kept = (kept | {int(b)}) & replay._candidates(sizes, end)
        assert len(kept) <= 2
        choice = replay._choose_checkpoint(sizes, end)
        assert choice == replay.checkpoint or choice in kept, (trial, sizes, choice, kept)


def test_close_drops_sessions_and_state():
    proto = _wide_conv(channels=4, size=8)
    rng = np.random.default_rng(6)
    samples = [{"x": rng.normal(0, 1, (1, 8, 8, 8)).astype(np.float32)} for _ in range(2)]
    replay = Replay(proto, samples, "test", memory_budget=None)
    replay.get(["c"])
    assert replay.env  # the live state after the conv
    replay.close()
    assert not replay.env and not replay.segments
    with pytest.raises(QuantizationError):
        replay.get(["y"])


def test_a_with_block_closes_the_replay_also_on_error():
    proto = _wide_conv(channels=4, size=8)
    samples = [{"x": np.ones((1, 8, 8, 8), np.float32)}]
    with Replay(proto, samples, "test", memory_budget=None) as replay:
        replay.get(["c"])
        assert replay.env
    assert not replay.env and not replay.segments
    with pytest.raises(RuntimeError), Replay(proto, samples, "test") as failing:
        failing.get(["c"])
        raise RuntimeError("stage failed")
    assert not failing.env and not failing.segments
