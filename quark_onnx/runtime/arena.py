"""The onnxruntime side of the layer replays: session options and the one shared CPU arena.

No session has an arena of its own (it would hold its largest run's buffers while the session
lives); all segments' sessions allocate from one onnxruntime arena registered once per process
(``session.use_env_allocators``, extended by what is asked). Allocating straight from glibc
instead fragmented its heap: onnxruntime's buffers are 64-byte aligned (``memalign``), and the
small allocations made between runs settle in the space a freed buffer leaves, so the next
buffer of the same size no longer fits and the heap grows.

Numerics: segments run with onnxruntime's graph optimizations on but its Q/DQ fusions off
(session option ``session.disable_quant_qdq``), so the quantized model is still simulated in float
exactly as its Q/DQ nodes say (no integer kernels) while convolutions use the fast blocked
kernels. Convolution outputs differ from the unoptimized kernels' only by float32 summation
order. (Measurements: ``benchmarks/results/measurements.md``.)
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import onnx

logger = logging.getLogger(__name__)


def session_options(threads: int | None = None) -> Any:
    """onnxruntime options of every accuracy-stage session (module doc: Q/DQ simulated in float).

    ``threads``: onnxruntime's intra-op threads (None: its default, one per core). A kernel
    computes the same values on any number of threads; the number only splits the work.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads is not None:
        opts.intra_op_num_threads = threads
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.add_session_config_entry("session.disable_quant_qdq", "1")
    # a segment runs one sample at a time and may be kept for a later rerun: an arena per
    # session would hold its largest run's buffers for as long as the session lives. Every
    # segment allocates from one arena shared by all of them instead (module doc), or, where
    # that cannot be set up, straight from the C library
    opts.enable_cpu_mem_arena = False
    if _shared_arena():
        opts.add_session_config_entry("session.use_env_allocators", "1")
    # several segments' sessions live at once (reruns): spinning idle pools would compete with
    # the one that works (8x slower on two busy cores: benchmarks/results/measurements.md)
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return opts


_ARENA_LOCK = threading.RLock()
_ARENA_STATE: dict[str, Any] = {"ready": None, "shrinker": None}


def _shared_arena() -> bool:
    """Register (once per process) the CPU arena the segments' sessions share; False if this
    onnxruntime cannot, and the sessions then allocate from the C library as before."""
    with _ARENA_LOCK:
        if _ARENA_STATE["ready"] is None:
            try:
                import onnxruntime as ort

                info = ort.OrtMemoryInfo(
                    "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
                )
                # extend by what is asked (not the next power of two): no region is bigger
                # than the largest tensor it was made for
                config = ort.OrtArenaCfg({"arena_extend_strategy": 1})
                ort.create_and_register_allocator(info, config)
                _ARENA_STATE["ready"] = True
            except Exception as exc:  # any failure: no shared arena
                logger.debug("no shared onnxruntime arena for the layer replays: %s", exc)
                _ARENA_STATE["ready"] = False
        return bool(_ARENA_STATE["ready"])


def release_arena() -> None:
    """Free the regions of the shared arena (module doc) that no tensor uses any more.

    onnxruntime shrinks an arena only at the end of a run that asks for it: a one-node session
    (built once, tensors of one float) runs with ``memory.enable_memory_arena_shrinkage``.
    Never raises; does nothing without the shared arena.
    """
    if not _ARENA_STATE["ready"]:
        return
    try:
        import onnxruntime as ort

        from quark_onnx.runtime.sessions import create_session

        with _ARENA_LOCK:
            if _ARENA_STATE["shrinker"] is None:
                graph = onnx.helper.make_graph(
                    [onnx.helper.make_node("Identity", ["x"], ["y"])],
                    "release_arena",
                    [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                    [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
                )
                model = onnx.helper.make_model(
                    graph, opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=7
                )
                _ARENA_STATE["shrinker"] = create_session(
                    model.SerializeToString(), session_options(), purpose="arena shrinker"
                )
            shrinker = _ARENA_STATE["shrinker"]
        run_options = ort.RunOptions()
        run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        shrinker.run(None, {"x": np.zeros(1, np.float32)}, run_options)
    except Exception as exc:  # releasing memory is best effort
        logger.debug("could not shrink the shared onnxruntime arena: %s", exc)
