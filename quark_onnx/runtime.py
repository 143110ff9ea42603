"""Every onnxruntime session the quantizer builds: one set of options, one constructor, counters.

A session costs far more than its model's bytes: onnxruntime's graph, kernels and initializer
copies take about 6-7 KB per node (measured: a 5,000-node Add chain 32 MB, its 20,000-node XINT8
form 138 MB, CPU provider), so a session is built only where data runs, and each is built the same
lean way (:func:`create_session`):

* a ``ModelProto`` is serialized here and the caller's proto is not copied;
* the Python ``InferenceSession`` keeps the model bytes only to rebuild itself on
  ``set_providers``, which the CPU provider never needs: they are dropped once the session holds
  the model;
* with ``external_data_dir`` the weights stay in the model's data files (onnxruntime maps them
  read-only) and pre-packing, which would copy every Gemm/MatMul weight, is off.

:func:`session_options` is the one place ``SessionOptions`` are made; its keywords name what the
callers differ in (optimisation level, arena, spinning, memory pattern, Q/DQ simulation).

:data:`COUNTS` counts the sessions built and the full-model serialisations (``ir.Model`` to
``ModelProto`` in :func:`quark_onnx.model_io.to_proto`, a ``ModelProto`` to bytes here or on save),
so a test can hold the pipeline to a budget.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from quark_onnx.counters import COUNTS, Counts

__all__ = [
    "COUNTS",
    "CPU",
    "Counts",
    "add_outputs",
    "create_session",
    "serialize",
    "session_options",
]

#: The execution providers of every session (the quantizer runs float and Q/DQ models on CPU).
CPU = ("CPUExecutionProvider",)

_LEVELS = {
    "none": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


def session_options(
    *,
    optimize: str = "none",
    arena: bool = True,
    spinning: bool = True,
    mem_pattern: bool = True,
    simulate_qdq: bool = False,
    config: Mapping[str, str] | None = None,
) -> Any:  # -> onnxruntime.SessionOptions
    """The ``SessionOptions`` of a session (warnings off).

    Args:
        optimize: graph optimisation level: ``"none"`` (the model's arithmetic as the ONNX
            specification states it: the Q/DQ simulation of a quantized model), ``"basic"``,
            ``"extended"`` or ``"all"``.
        arena: onnxruntime's CPU memory arena (it keeps the buffers of the largest run for the
            session's lifetime).
        spinning: intra-op threads spin between kernels (off where Python works beside the
            session, or several sessions live at once).
        mem_pattern: plan each run's buffers into one block after the first run.
        simulate_qdq: never fuse Q/DQ pairs into int8 kernels, even when optimising.
        config: further ``add_session_config_entry`` pairs.
    """
    import onnxruntime as ort

    if optimize not in _LEVELS:
        raise ValueError(f"optimize={optimize!r}: expected one of {sorted(_LEVELS)}")
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[optimize])
    so.log_severity_level = 3
    so.enable_cpu_mem_arena = arena
    so.enable_mem_pattern = mem_pattern
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if simulate_qdq:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    return so


def serialize(model: onnx.ModelProto) -> bytes:
    """``model``'s bytes (one counted full-model serialisation)."""
    COUNTS.serialisations += 1
    return model.SerializeToString()


def add_outputs(proto: onnx.ModelProto, names: Sequence[str]) -> int:
    """Make the named tensors graph outputs of ``proto`` (those not already outputs, once each),
    so that a session returns them; the number added (a caller that edits a user's proto
    removes them again from the end)."""
    present = {o.name for o in proto.graph.output}
    added = [n for n in dict.fromkeys(names) if n not in present]
    proto.graph.output.extend(onnx.ValueInfoProto(name=n) for n in added)
    return len(added)


def create_session(
    model: ir.Model | onnx.ModelProto | bytes | str | os.PathLike,
    options: Any = None,
    *,
    external_data_dir: str | os.PathLike | None = None,
    providers: Sequence[str] = CPU,
    purpose: str = "",
    edit: Callable[[onnx.ModelProto], None] | None = None,
) -> Any:  # -> onnxruntime.InferenceSession
    """An onnxruntime session over ``model`` (an IR model, a proto, its bytes, or a model file).

    ``options`` defaults to :func:`session_options` (no optimisation). With
    ``external_data_dir`` the model's external tensors are read from that folder. An IR model is
    serialized here with its memory-mapped weights read in, then ``edit`` (if given) changes
    that private proto before it is handed over. onnxruntime's own exceptions propagate: callers
    turn them into errors that name their model.
    """
    import onnxruntime as ort

    if isinstance(model, ir.Model):
        from quark_onnx.model_files.load import serialize_ir

        proto = serialize_ir(model)
        if edit is not None:
            edit(proto)
        model = proto.SerializeToString()
        del proto  # onnxruntime parses the bytes: the proto need not live beside its session
    elif edit is not None:
        raise ValueError("edit is only applied to an ir.Model")
    if options is None:
        options = session_options()
    if external_data_dir is not None:
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(external_data_dir)
        )
        options.add_session_config_entry("session.disable_prepacking", "1")
    if isinstance(model, onnx.ModelProto):
        model = serialize(model)
    elif isinstance(model, Path):
        model = str(model)
    session = ort.InferenceSession(model, options, providers=list(providers))
    COUNTS.sessions += 1
    COUNTS.purposes.append(purpose)
    # The Python session keeps the bytes only to rebuild itself after a provider fallback,
    # which the CPU provider never needs (14 MB for MobileNetV2 for the session's lifetime).
    # A private attribute: touched only when it is exactly the bytes given.
    if isinstance(model, bytes) and getattr(session, "_model_bytes", None) is model:
        session._model_bytes = None
    return session
