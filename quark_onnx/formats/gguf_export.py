"""GGUF export of a QDQ model's weight-only quantized tensors (the ``gguf`` package writes them).

A weight is exported quantized when it is an initializer of integer codes read only by
``DequantizeLinear`` nodes (all with the same constant scale, zero point, ``axis`` and
``block_size``), quantized per group along one axis with a block size that is a multiple of 32,
and that axis' length is a multiple of 32:

=====================================  ===========  ==============================================
ONNX codes                             GGML type    block (32 elements ``q``, one scale ``s``)
=====================================  ===========  ==============================================
uint4, any zero point ``z``            ``Q4_1``     ``d = fp16(s)``, ``m = fp16(-d·z)``, nibbles
                                                    ``q``; reads back ``d·q + m``
int4, zero point 0                     ``Q4_0``     ``d = fp16(s)``, nibbles ``q + 8``; reads back
                                                    ``d·((q + 8) - 8)``
int4, other zero points                ``Q4_1``     as uint4 with codes ``q + 8``, zero point
                                                    ``z + 8`` (the same values)
int8, zero point 0                     ``Q8_0``     ``d = fp16(s)``, int8 ``q``; reads back ``d·q``
=====================================  ===========  ==============================================

ONNX ``DequantizeLinear`` computes ``x = (q - z)·s`` in float32. GGML stores ``d`` and ``m`` as
float16, so the values read back equal ``x`` **exactly** when every block's ``s`` (and, for
``Q4_1``, ``d·z``) is a float16 value: then ``d·q`` and ``d·z`` are exact float32 products (at most
11 + 8 significant bits) and the float32 sum ``d·q + m`` is the exact ``(q - z)·s``, which the ONNX
product also is. A float16 scale makes ``Q8_0`` and ``Q4_0`` exact; ``Q4_1`` also needs ``s·z``
in float16, which holds for every zero point when ``s`` has at most 7 significant bits (a power
of two, for instance): a float16 scale with 11 bits times a 4-bit zero point can need 15. Otherwise,
with ``u = 2^-11`` (float16's unit roundoff; an absolute ``2^-25`` in float16's subnormal range,
``s < 2^-14``)::

    |gguf - onnx| <= |q - z|·|d - s| + |m - (-d·z)| + float32 rounding
                  <= u·s·(|q - z| + |z_m|) + 2^-23·|x|

(``z_m`` the zero point ``m`` holds: ``z`` for uint4, ``z + 8`` for int4, none for Q4_0/Q8_0),
that is at most ``30·2^-11 ≈ 0.015`` of a quantization step for ``Q4_1``, ``8·2^-11`` of a step
for ``Q4_0`` and a relative ``2^-11`` of the value for ``Q8_0`` (up to ``128·2^-11 = 0.0625``
step). The export measures it: each written tensor in the summary carries ``exact``, the
measured ``max_abs_error`` and ``max_step_error`` (in units of its scale) of the values
``gguf.quants.dequantize`` reads back against :func:`quark_onnx.params.qparams.dequantize`, the
evaluated ``bound``, and ``inexact_blocks``. ``require_exact=True`` refuses a model with any
inexact tensor instead of writing it (to meet it, quantize with float16 scales, and for uint4
with scales of at most 7 significant bits).

Layout. GGUF lists dimensions innermost first (``ne[0]`` is the contiguous one, the reverse of the
numpy/ONNX order) and ``Q4_*``/``Q8_0`` blocks run along ``ne[0]``. A tensor whose block axis is
the last ONNX axis is written as it is (the GGUF dims are the ONNX shape reversed, the gguf
convention). Otherwise the block axis is moved last (``np.moveaxis(w, axis, -1)``; for a MatMul
weight ``(K, N)`` blocked along ``K`` that is ``W^T``, shape ``(N, K)``: the ``(out, in)`` layout
llama.cpp's ``ggml_mul_mat`` expects, with GGUF dims ``[K, N]``), and the permutation of ONNX axes
is stored as the metadata array ``quark_onnx.axes.<tensor name>`` so that the ONNX tensor is
``np.transpose(stored, np.argsort(axes))``. No other choice keeps blocks of 32 along one axis.

Names: a codes initializer named ``W_quantized`` (the naming of this project's InsertQDQ and of
onnxruntime's quantizer) is written as ``W``, the weight it stands for, unless another initializer
is named ``W``; other names are kept.

Float initializers (not scales or zero points of QuantizeLinear/DequantizeLinear) are written in
their own precision, so they read back exactly: float32 -> ``F32``, float16 -> ``F16``, bfloat16
-> ``BF16``, float64 -> ``F64`` (``include_float=False`` skips them). A 0-d float is written with
shape ``[1]``. Everything else is skipped with a reason in the summary: per-tensor and
per-channel codes, block sizes or axis lengths that are not multiples of 32, int8 with a nonzero
zero point, uint8/int16/uint16/int32/float8 codes, integer tensors (shapes, indices), scales and
zero points (stored inside the blocks), tensors above 4 dimensions or of size 0. Only the main
graph is read (not If/Loop bodies); Constant nodes are not exported.

The file is written to a temporary name in the destination folder and renamed into place when
complete; the input model is never the output. Tensors and metadata are written in initializer
order, so the same model gives the same bytes. ``gguf`` is imported only when exporting
(``pip install 'quark_onnx[gguf]'``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir

from quark_onnx.config.enums import QuantType
from quark_onnx.errors import ModelLoadError, ModelSaveError, QuantizationError, QuarkOnnxError
from quark_onnx.graph.ir import constant_array
from quark_onnx.model_files.load import load_model, validate_proto
from quark_onnx.model_files.paths import check_output_path
from quark_onnx.params import qparams
from quark_onnx.params.qparams import QuantParams

logger = logging.getLogger(__name__)

#: Elements per GGML block of Q4_0, Q4_1 and Q8_0.
GGML_BLOCK = 32
#: Dimensions a GGML tensor can have.
GGML_MAX_DIMS = 4
#: Longest tensor name llama.cpp reads (GGML_MAX_NAME - 1 bytes).
GGML_MAX_NAME = 63
#: float16 unit roundoff (round to nearest) and half its smallest subnormal spacing.
_FP16_U = 2.0**-11
_FP16_SUBNORMAL_HALF_ULP = 2.0**-25
_F32_U = 2.0**-24
_QUANT_OPS = ("QuantizeLinear", "DequantizeLinear")
_SUFFIX = "_quantized"
_PARTIAL_SUFFIX = ".partial"

_FLOAT_TYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float64): "F64",
}
_QTYPE_OF_DTYPE = {qparams.numpy_dtype(q): q for q in QuantType if q not in qparams.CAST_TYPES}


def _import_gguf() -> ModuleType:
    """The ``gguf`` package, or a clear error naming the extra that installs it."""
    try:
        import gguf
        import gguf.quants  # the read-back check uses the submodule
    except ImportError as exc:
        raise ModelSaveError(
            "GGUF export needs the optional 'gguf' package, which is not installed: "
            "pip install 'quark_onnx[gguf]'"
        ) from exc
    return gguf


@dataclass
class _Entry:
    """One tensor to write: its bytes (GGML layout) and its line of the summary."""

    name: str
    array: np.ndarray
    ggml_type: str
    raw: bool
    info: dict[str, Any]
    axes: list[int] | None = None


@dataclass
class _Plan:
    entries: list[_Entry] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)


def export_gguf(
    model: onnx.ModelProto | str | os.PathLike,
    path: str | os.PathLike,
    *,
    require_exact: bool = False,
    include_float: bool = True,
    arch: str = "quark_onnx",
    replace: bool = True,
) -> dict[str, Any]:
    """Write the weight-only quantized tensors (and float initializers) of ``model`` to GGUF.

    See the module docstring for the type mapping, layout, names and the read-back bound.

    Args:
        model: a QDQ model (ModelProto or path; a path is loaded and validated).
        path: the ``.gguf`` file to write (atomically; never the input model).
        require_exact: refuse (raise) when any quantized tensor would not read back exactly
            equal to its ONNX ``DequantizeLinear`` values (a scale or ``-scale·zero_point`` that
            is not a float16 value).
        include_float: also write the float initializers (F32/F16/BF16/F64, exact).
        arch: the ``general.architecture`` value of the file.
        replace: replace an existing ``path`` (default); ``False`` places the file exclusively
            (``OutputAppearedError`` if it exists by then: another run wrote it).

    Returns:
        A summary: ``path``, ``source``, ``written`` (one dict per tensor: ``name``,
        ``onnx_name``, ``ggml_type``, ``onnx_shape``, ``gguf_shape`` (GGUF order, innermost
        first), ``axes`` (permutation, or None), and for quantized tensors ``exact``,
        ``max_abs_error``, ``max_step_error``, ``bound``, ``inexact_blocks``), ``skipped``
        (``name``, ``reason``), ``counts`` per GGML type and ``quantized`` (how many).

    Raises:
        ModelSaveError: gguf is not installed, or the output path is refused or unwritable.
        ModelLoadError: ``model`` is not a readable, valid ONNX model.
        QuantizationError: ``require_exact`` and a tensor would not read back exactly; or no
            tensor of the model can be written (nothing is written then).
    """
    gguf = _import_gguf()
    proto, source, input_path = _load(model)
    out = check_output_path(path, input_path)
    graph = ir.serde.deserialize_model(proto).graph
    plan = _plan(graph, source, gguf, include_float=include_float)
    if not plan.entries:
        reasons = sorted({str(item.get("reason", "")) for item in plan.skipped})[:3]
        raise QuantizationError(
            f"{source}: no tensor can be written to GGUF, nothing written (skipped: "
            f"{len(plan.skipped)} initializer(s), e.g. {'; '.join(reasons) or 'none'}); GGUF "
            "takes weights quantized in blocks of 32 (e.g. the UINT4_WEIGHT_ONLY_G32 preset) "
            "and, unless include_float=False, float tensors"
        )
    if require_exact:
        inexact = [e for e in plan.entries if e.info.get("exact") is False]
        if inexact:
            e = inexact[0]
            raise QuantizationError(
                f"{source}: tensor {e.info['onnx_name']!r} ({e.ggml_type}): "
                f"{e.info['inexact_blocks']} block(s) have a scale (or -scale·zero_point) that "
                f"is not a float16 value, so GGUF would read back values up to "
                f"{e.info['max_abs_error']:.3g} away from DequantizeLinear ({len(inexact)} "
                "tensor(s) in all); quantize with float16 scales (for Q4_1: of at most 7 "
                "significant bits, e.g. powers of two) or export without require_exact"
            )
    name = proto.graph.name or (Path(input_path).stem if input_path else "model")
    _write(gguf, out, plan.entries, arch=arch, model_name=name, replace=replace)
    counts: dict[str, int] = {}
    for e in plan.entries:
        counts[e.ggml_type] = counts.get(e.ggml_type, 0) + 1
    quantized = sum(1 for e in plan.entries if "exact" in e.info)
    if not quantized:
        logger.warning("%s: no weight-only quantized tensor to export to GGUF", source)
    logger.info("%s: wrote %s (%s)", source, out, counts)
    return {
        "path": str(out),
        "source": source,
        "written": [e.info for e in plan.entries],
        "skipped": plan.skipped,
        "counts": counts,
        "quantized": quantized,
    }


def _load(model: onnx.ModelProto | str | os.PathLike) -> tuple[onnx.ModelProto, str, Path | None]:
    if isinstance(model, onnx.ModelProto):
        return validate_proto(model, source="<model>"), "<model>", None
    if isinstance(model, (str, os.PathLike)):
        return load_model(model), str(model), Path(model)
    raise ModelLoadError(
        f"export_gguf: expected an onnx.ModelProto or a model path, got {type(model).__name__}"
    )


# --- choosing what to write ------------------------------------------------------------------


def _plan(graph: ir.Graph, source: str, gguf: ModuleType, *, include_float: bool) -> _Plan:
    """Classify every initializer: quantized weight, float tensor, or skipped (with a reason)."""
    plan = _Plan()
    names = set(graph.initializers)
    params_of: dict[str, list[ir.Node]] = {}
    written_dq: dict[int, str] = {}  # id(DequantizeLinear node) -> "Q4_1 blocks of 'W'"
    for name, value in graph.initializers.items():
        uses = list(value.uses())
        dq_uses = [u for u in uses if _is_op(u.node, "DequantizeLinear") and u.idx == 0]
        if dq_uses and len(dq_uses) == len(uses):
            result = _quantized_entry(name, value, [u.node for u in dq_uses], names, gguf)
            if isinstance(result, str):
                plan.skipped.append({"name": name, "reason": result})
                continue
            plan.entries.append(result)
            for u in dq_uses:
                written_dq[id(u.node)] = f"{result.ggml_type} blocks of {result.name!r}"
            continue
        if uses and all(_is_op(u.node, *_QUANT_OPS) and u.idx in (1, 2) for u in uses):
            params_of[name] = [u.node for u in uses]
            continue
        array = value.const_value.numpy() if value.const_value is not None else None
        reason = _float_reason(array, dq_uses, include_float)
        if reason is not None:
            plan.skipped.append({"name": name, "reason": reason})
            continue
        assert array is not None
        plan.entries.append(_float_entry(name, array))
    for name, nodes in params_of.items():
        if all(id(n) in written_dq for n in nodes):
            homes = sorted({written_dq[id(n)] for n in nodes})
            reason = "scale/zero point stored in the " + ", ".join(homes)
        else:
            ops = sorted({n.op_type for n in nodes})
            reason = (
                f"scale/zero point of {'/'.join(ops)} {nodes[0].name or '?'!r} "
                "(activation or non-exported weight quantization), not a weight"
            )
        plan.skipped.append({"name": name, "reason": reason})
    order = {name: i for i, name in enumerate(graph.initializers)}
    plan.skipped.sort(key=lambda s: order[s["name"]])
    for e in plan.entries:
        if len(e.name.encode()) > GGML_MAX_NAME:
            logger.warning(
                "%s: GGUF tensor name %r is longer than the %d bytes llama.cpp reads",
                source,
                e.name,
                GGML_MAX_NAME,
            )
    return plan


def _is_op(node: ir.Node, *ops: str) -> bool:
    return node.op_type in ops and node.domain in ("", "ai.onnx")


def _float_reason(array: np.ndarray | None, dq_uses: list, include_float: bool) -> str | None:
    """Why a non-quantized initializer is not written (None: write it as a float tensor)."""
    if array is None:
        return "initializer without data"
    if array.dtype not in _FLOAT_TYPES:
        if dq_uses:
            return (
                f"{array.dtype} codes read by DequantizeLinear and by other nodes; "
                "not a weight-only tensor"
            )
        return f"{array.dtype} tensor (not a float weight, not quantized by DequantizeLinear)"
    if not include_float:
        return "float tensor (include_float=False)"
    if array.size == 0:
        return "empty tensor (GGML has no size-0 tensors)"
    if array.ndim > GGML_MAX_DIMS:
        return f"rank {array.ndim}: GGML tensors have at most {GGML_MAX_DIMS} dimensions"
    return None


def _float_entry(name: str, array: np.ndarray) -> _Entry:
    ggml_type = _FLOAT_TYPES[array.dtype]
    stored = np.ascontiguousarray(array.reshape(array.shape or (1,)))
    raw = ggml_type == "BF16"  # the gguf writer takes bfloat16 as raw bytes
    if raw:
        stored = stored.view(np.uint8)
    info = {
        "name": name,
        "onnx_name": name,
        "ggml_type": ggml_type,
        "onnx_shape": list(array.shape),
        "gguf_shape": list(reversed(array.shape or (1,))),
        "axes": None,
    }
    return _Entry(name=name, array=stored, ggml_type=ggml_type, raw=raw, info=info)


def _dq_params(node: ir.Node, codes: np.ndarray, name: str) -> QuantParams | str:
    """The QuantParams one DequantizeLinear applies to ``codes`` (or why it cannot be read)."""
    qtype = _QTYPE_OF_DTYPE.get(codes.dtype)
    if qtype is None:
        return f"{codes.dtype} codes: not a quantization type GGUF export knows"
    scale = constant_array(node.inputs[1] if len(node.inputs) > 1 else None)
    if scale is None:
        return f"DequantizeLinear {node.name!r}: the scale is not a constant"
    zero_value = node.inputs[2] if len(node.inputs) > 2 else None
    if zero_value is None:
        zero = np.zeros(scale.shape, dtype=codes.dtype)
    else:
        zero = constant_array(zero_value)
        if zero is None:
            return f"DequantizeLinear {node.name!r}: the zero point is not a constant"
    block = node.attributes.get_int("block_size", 0) or None
    axis: int | None = None
    if scale.ndim > 0:
        axis = node.attributes.get_int("axis", 1)
        if codes.ndim and -codes.ndim <= axis < codes.ndim:
            axis %= codes.ndim
    params = QuantParams(
        qtype=qtype,
        scale=np.asarray(scale, dtype=np.float32),
        zero_point=np.asarray(zero),
        axis=axis,
        block_size=block,
        codes=codes,
    )
    try:
        params.validate(tuple(codes.shape), name)
    except QuarkOnnxError as exc:
        return f"DequantizeLinear {node.name!r}: {exc}"
    return params


def _same_params(a: QuantParams, b: QuantParams) -> bool:
    return (
        a.qtype is b.qtype
        and a.axis == b.axis
        and a.block_size == b.block_size
        and np.array_equal(a.scale, b.scale)
        and np.array_equal(a.zero_point, b.zero_point)
    )


def _ggml_type(params: QuantParams, shape: tuple[int, ...]) -> str:
    """The GGML type for these codes, or raise ValueError with the reason they do not map."""
    qtype = params.qtype
    if qtype not in (QuantType.QUInt4, QuantType.QInt4, QuantType.QInt8):
        raise ValueError(
            f"{qtype.value} codes: GGUF export maps uint4/int4 (Q4_1/Q4_0) and int8 with zero "
            "point 0 (Q8_0) only"
        )
    if params.granularity != "group":
        raise ValueError(
            f"{qtype.value} {params.granularity} quantization: Q4_0/Q4_1/Q8_0 need per-group "
            f"scales with a block size that is a multiple of {GGML_BLOCK} (quantize per group)"
        )
    assert params.axis is not None and params.block_size is not None
    if params.block_size % GGML_BLOCK:
        raise ValueError(
            f"block size {params.block_size} is not a multiple of the GGML block size {GGML_BLOCK}"
        )
    length = shape[params.axis]
    if length % GGML_BLOCK:
        raise ValueError(
            f"axis {params.axis} has {length} elements, not a multiple of {GGML_BLOCK}: the last "
            "group would be a short GGML block"
        )
    if len(shape) > GGML_MAX_DIMS:
        raise ValueError(f"rank {len(shape)}: GGML tensors have at most {GGML_MAX_DIMS} dims")
    zero = params.zero_point.astype(np.int32)
    if qtype is QuantType.QInt8:
        if np.any(zero != 0):
            raise ValueError("int8 with a nonzero zero point: Q8_0 is symmetric (no offset)")
        return "Q8_0"
    if qtype is QuantType.QInt4 and not np.any(zero != 0):
        return "Q4_0"
    return "Q4_1"


def _quantized_entry(
    name: str, value: ir.Value, dq_nodes: list[ir.Node], names: set[str], gguf: ModuleType
) -> _Entry | str:
    """Pack one DequantizeLinear weight into GGML blocks and measure the read-back values."""
    if value.const_value is None:
        return "initializer without data"
    codes = value.const_value.numpy()
    params = _dq_params(dq_nodes[0], codes, name)
    if isinstance(params, str):
        return params
    for node in dq_nodes[1:]:
        other = _dq_params(node, codes, name)
        if isinstance(other, str) or not _same_params(params, other):
            return (
                "read by several DequantizeLinear nodes with different scales, zero points or "
                "attributes; one GGUF tensor holds one quantization"
            )
    shape = tuple(int(d) for d in codes.shape)
    try:
        ggml_type = _ggml_type(params, shape)
    except ValueError as exc:
        return str(exc)
    assert params.axis is not None and params.block_size is not None
    axis = params.axis
    moved_codes = np.moveaxis(codes.astype(np.int32), axis, -1)
    repeat = params.block_size // GGML_BLOCK
    scale = np.repeat(np.moveaxis(params.scale, axis, -1), repeat, axis=-1).reshape(-1)
    zero = np.repeat(np.moveaxis(params.zero_point.astype(np.int32), axis, -1), repeat, axis=-1)
    zero = zero.reshape(-1)
    q = moved_codes.reshape(-1, GGML_BLOCK)
    onnx_q, onnx_zero = q, zero
    if params.qtype is QuantType.QInt4:  # same values with codes and zero point shifted by 8
        q, zero = q + 8, zero + 8
    d16 = scale.astype(np.float16)
    if np.any(~np.isfinite(d16)):
        return f"a scale ({scale[~np.isfinite(d16)][0]:.6g}) is above float16's range (65504)"
    if np.any(d16 == 0):
        return f"a scale ({scale[d16 == 0][0]:.6g}) is below float16's smallest value (2^-24)"
    d_bytes = d16.astype("<f2").view(np.uint8).reshape(-1, 2)
    m_zero = np.zeros_like(zero)  # the zero point m holds (Q4_1 only)
    if ggml_type == "Q8_0":
        body = [d_bytes, q.astype(np.int8).view(np.uint8)]
        m_off = np.zeros(scale.shape, dtype=bool)
    else:
        extra = []
        m_off = np.zeros(scale.shape, dtype=bool)
        if ggml_type == "Q4_1":  # Q4_0 has no m: its offset 8 is implicit and exact
            m_zero = zero
            # -d·z of the stored d: exact in float32 (11 × 4 bits), rounded once to float16
            m_exact = -(d16.astype(np.float32) * zero.astype(np.float32))
            m16 = m_exact.astype(np.float16)
            if np.any(~np.isfinite(m16)):
                return "-scale·zero_point is above float16's range (65504)"
            m_off = m16.astype(np.float32) != m_exact
            extra = [m16.astype("<f2").view(np.uint8).reshape(-1, 2)]
        nibbles = q.astype(np.uint8)
        packed = nibbles[:, : GGML_BLOCK // 2] | (nibbles[:, GGML_BLOCK // 2 :] << np.uint8(4))
        body = [d_bytes, *extra, packed]
    blocks = np.concatenate(body, axis=1)
    stats = _measure(gguf, ggml_type, blocks, onnx_q, onnx_zero, m_zero, scale, name=name)
    gguf_name = _gguf_name(name, names)
    axes = None if axis == codes.ndim - 1 else [*(i for i in range(codes.ndim) if i != axis), axis]
    info = {
        "name": gguf_name,
        "onnx_name": name,
        "ggml_type": ggml_type,
        "onnx_shape": list(shape),
        "gguf_shape": list(reversed(moved_codes.shape)),
        "axes": axes,
        **stats,
        "inexact_blocks": int(np.count_nonzero((d16.astype(np.float32) != scale) | m_off)),
    }
    stored = blocks.reshape(*moved_codes.shape[:-1], -1)
    return _Entry(name=gguf_name, array=stored, ggml_type=ggml_type, raw=True, info=info, axes=axes)


#: Blocks measured at a time (bounds the float64 temporaries to a few tens of MB).
_MEASURE_CHUNK = 1 << 16


def _measure(
    gguf: ModuleType,
    ggml_type: str,
    blocks: np.ndarray,
    q: np.ndarray,
    zero: np.ndarray,
    m_zero: np.ndarray,
    scale: np.ndarray,
    *,
    name: str,
) -> dict[str, Any]:
    """Compare what ``gguf.quants.dequantize`` reads from ``blocks`` with DequantizeLinear.

    ``q``: ONNX codes, one row of 32 per block; ``zero``/``scale``: ONNX zero point and scale per
    block; ``m_zero``: the zero point the block's ``m`` holds (0 without ``m``). The reference
    is the float32 ``(q - z)·s`` of :func:`quark_onnx.params.qparams.dequantize`; the bound is the
    module docstring's, with float16 subnormals (absolute ``2^-25``) included.
    """
    qtype = gguf.GGMLQuantizationType[ggml_type]
    max_abs = max_step = max_bound = 0.0
    exact = True
    for start in range(0, len(blocks), _MEASURE_CHUNK):
        part = slice(start, start + _MEASURE_CHUNK)
        s32 = scale[part].astype(np.float32)[:, None]
        qf = q[part].astype(np.float32)
        zf = zero[part].astype(np.float32)[:, None]
        reference = ((qf - zf) * s32).astype(np.float32)
        read = gguf.quants.dequantize(blocks[part], qtype).reshape(reference.shape)
        diff = np.abs(read.astype(np.float64) - reference.astype(np.float64))
        s = s32.astype(np.float64)
        mz = np.abs(m_zero[part].astype(np.float64))[:, None]
        err_d = np.maximum(_FP16_U * s, _FP16_SUBNORMAL_HALF_ULP)
        err_m = np.where(mz != 0, np.maximum(_FP16_U * s * mz, _FP16_SUBNORMAL_HALF_ULP), 0.0)
        rounding = 2 * _F32_U * np.abs(reference.astype(np.float64))
        bound = (np.abs(qf - zf) * err_d + err_m + rounding) / (1 - _F32_U)
        if np.any(diff > bound):  # a packing bug, not a property of the data
            raise QuantizationError(
                f"tensor {name!r}: GGUF read-back differs from DequantizeLinear by "
                f"{diff.max():.3g}, above the float16 bound {bound.max():.3g}"
            )
        exact = exact and not np.any(diff)
        max_abs = max(max_abs, float(diff.max(initial=0.0)))
        max_step = max(max_step, float((diff / s).max(initial=0.0)))
        max_bound = max(max_bound, float(bound.max(initial=0.0)))
    return {
        "exact": exact,
        "max_abs_error": max_abs,
        "max_step_error": max_step,
        "bound": max_bound,
    }


def _gguf_name(name: str, names: set[str]) -> str:
    """``W_quantized`` -> ``W`` unless an initializer ``W`` exists (module docstring)."""
    if name.endswith(_SUFFIX) and len(name) > len(_SUFFIX):
        base = name[: -len(_SUFFIX)]
        if base not in names:
            return base
    return name


# --- writing ---------------------------------------------------------------------------------


def _write(
    gguf: ModuleType,
    out: Path,
    entries: list[_Entry],
    *,
    arch: str,
    model_name: str,
    replace: bool = True,
) -> None:
    """Write the GGUF file under a temporary name beside ``out``, then move it into place
    (:func:`~quark_onnx.model_files.files.place_file`)."""
    from quark_onnx.model_files.files import place_file, temp_file_beside, temp_file_done

    fd, tmp = temp_file_beside(out)
    os.close(fd)
    writer = None
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        writer.add_name(model_name)
        if any(e.ggml_type in ("Q4_0", "Q4_1", "Q8_0") for e in entries):
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for e in entries:
            if e.axes is not None:
                writer.add_array(f"quark_onnx.axes.{e.name}", e.axes)
        for e in entries:
            raw_dtype = gguf.GGMLQuantizationType[e.ggml_type] if e.raw else None
            writer.add_tensor(e.name, e.array, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.flush()
        for f in writer.fout or ():
            os.fsync(f.fileno())
        writer.close()
        place_file(tmp, out, replace=replace)
    except BaseException as exc:
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise ModelSaveError(
                f"{out}: cannot write the GGUF file ({exc.strerror or exc}); check free space "
                "and permissions of the output folder"
            ) from exc
        raise
    finally:
        temp_file_done(tmp)
