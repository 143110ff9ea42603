"""Reading models: validation with clear errors, opset upgrade, the IR <-> proto forms.

Loading never writes anything. The order of the checks keeps every failure cheap and named:

1. the file exists, is a regular file, can be read and is not empty;
2. it parses as an ``onnx.ModelProto`` holding a graph and an ``opset_import``, and every string
   field is UTF-8 text;
3. every external-data ``location`` is a relative path that stays inside the model's folder once
   ``..`` and symbolic links are resolved, goes through no symbolic link, names an existing file,
   and ``offset + length`` fits in it (else ``UnsafePathError`` or ``ModelLoadError``;
   :mod:`quark_onnx.model_files.external`);
4. the ONNX checker passes (run before the weights are read, so models above the 2 GB protobuf
   limit are checked too), and so does strict shape inference, run with only the external
   tensors of at most ``SMALL_TENSOR_BYTES`` read in (shape tensors are small; the large
   weights contribute their dims), so it runs above 2 GB too;
5. a default-domain opset below :data:`MIN_OPSET` is upgraded with onnx's version converter (also
   before the weights are read);
6. :func:`load_model` reads the large external weights into the proto; :func:`load_ir` leaves
   them in their files as memory-mapped ``ir.ExternalTensor`` (peak memory of a big model: its
   mapped pages, no copy).

:func:`to_proto` with ``keep_external=True`` serializes a model without its memory-mapped weights
(references relative to ``external_data_dir``); every call is one counted full-model
serialisation (``quark_onnx.runtime.sessions.COUNTS``). :func:`signature_proto` gives the graph's
inputs alone, for readers that need nothing else.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from quark_onnx.errors import ModelLoadError
from quark_onnx.model_files.external import (
    _check_external_locations,
    _check_tensor_types,
    _external_tensors,
    _ir_tensors,
    _is_repeated,
    _read_external_data,
    _read_small_external,
    _unloaded_external,
    external_data_dir,
    fits_in_protobuf,
)
from quark_onnx.model_files.files import read_regular_file

logger = logging.getLogger(__name__)

#: Lowest opset the quantizer works on; older models are upgraded on load.
MIN_OPSET = 13


def default_opset(model: onnx.ModelProto) -> int:
    """The model's ``ai.onnx`` opset version (0 when it imports none)."""
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return 0


def _one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception message on one line (C++ messages span several), cut at ``limit``."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_model(path: str | os.PathLike, *, upgrade_opset: bool = True) -> onnx.ModelProto:
    """Read, validate and (if below opset 13) upgrade an ONNX model, external data included.

    The returned proto holds every tensor's bytes (external data is read into ``raw_data``): use
    :func:`load_ir` to keep large external weights on disk, memory-mapped.

    Raises:
        ModelLoadError: the file is missing, unreadable, not an ONNX protobuf, truncated, fails
            the ONNX checker, refers to missing or short external data, or cannot be upgraded to
            opset 13.
        UnsafePathError: an external-data location is absolute or leaves the model's folder.
    """
    model, p = _load_header(path, upgrade_opset=upgrade_opset)
    external = _external_tensors(model)
    if external:
        _read_external_data(external, p.parent)
    return model


def load_ir(path: str | os.PathLike, *, upgrade_opset: bool = True) -> ir.Model:
    """:func:`load_model` as the onnx_ir graph the passes work on, external weights left on disk.

    Every external tensor becomes an ``ir.ExternalTensor`` whose ``base_dir`` is the model's
    folder: its bytes are memory-mapped (read-only) the first time they are used and never copied
    into the model, so a model of ``S`` bytes of external weights costs about nothing to load
    and at most ``S`` of mapped file pages once every weight was read. The same checks as
    :func:`load_model` run first; external tensors of at most :data:`SMALL_TENSOR_BYTES` are
    read into memory (shape inference needs them; it then runs on a graph that stays small).
    Tensors in a data file with several
    hard links are read into memory instead (onnx_ir refuses to map those).

    Raises:
        ModelLoadError, UnsafePathError: as :func:`load_model`.
    """
    proto, p = _load_header(path, upgrade_opset=upgrade_opset)
    base = p.parent.resolve()
    model = ir.serde.deserialize_model(proto)
    for tensor in _ir_tensors(model.graph):
        if isinstance(tensor, ir.ExternalTensor):
            tensor.base_dir = str(base)
    return model


def _load_header(path: str | os.PathLike, *, upgrade_opset: bool) -> tuple[onnx.ModelProto, Path]:
    """Steps 1-5 of the module doc: the validated (upgraded) model, external data not read."""
    model = read_proto(path)
    p = Path(path)
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise ModelLoadError(
            f"{p}: parsed as protobuf but holds no ONNX graph; not an ONNX model (or truncated)"
        )
    if not model.opset_import:
        raise ModelLoadError(f"{p}: the model declares no opset_import; not a valid ONNX model")
    _check_text(model, str(p))
    _check_tensor_types(model, str(p))
    external = _external_tensors(model)
    _check_external_locations(external, p)
    try:
        # With a proto, the checker looks for external data relative to the working directory;
        # given the path it resolves them against the model's folder (and reads the file again,
        # which is small when the weights are external).
        onnx.checker.check_model(str(p) if external else model)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise ModelLoadError(
            f"{p}: fails the ONNX checker: {_one_line(exc)}; fix or re-export the model"
        ) from exc
    if external:
        _read_small_external(model, p)
    # (a parsed file is below 2 GB; with small tensors read in it could in theory exceed it, and
    # inference serializes the model)
    if fits_in_protobuf(model):
        _check_shapes(model, str(p))
    else:
        logger.info("%s: above 2 GB in memory, strict shape inference skipped", p)
    opset = default_opset(model)
    if upgrade_opset and 0 < opset < MIN_OPSET:
        model = upgrade(model, MIN_OPSET, source=str(p))
    return model, p


#: Largest model file read: protobuf refuses to parse a message above 2 GiB, so a bigger file
#: (a sparse file, a disk image named .onnx) is refused from its size before any byte is read.
MAX_MODEL_FILE_BYTES = (2 << 30) - 1


def read_proto(
    path: str | os.PathLike,
    *,
    what: str = "ONNX model",
    option: str | None = None,
) -> onnx.ModelProto:
    """The parsed model file ``path``, external data not read and nothing validated.

    The one way a model file is read: a regular file only (a FIFO or ``/dev/zero`` is refused
    before one byte is read), at most :data:`MAX_MODEL_FILE_BYTES`, read once.

    Raises:
        ModelLoadError: not a path, missing, not a regular file, too large, empty or not a
            protobuf.
    """
    if not isinstance(path, (str, os.PathLike)):
        hint = (
            " (serialized model bytes: pass onnx.load_from_string(data))"
            if isinstance(path, (bytes, bytearray))
            else ""
        )
        raise ModelLoadError(
            f"expected the path of an {what} (or an onnx.ModelProto), got "
            f"{type(path).__name__}{hint}"
        )
    data = read_regular_file(path, limit=MAX_MODEL_FILE_BYTES, what=what, option=option)
    label = f"{option} {path}" if option else str(path)
    if not data:
        raise ModelLoadError(f"{label}: the file is empty, not an ONNX model")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(
            f"{label}: not a valid ONNX model (protobuf parse failed: {_one_line(exc)}); the "
            "file may be truncated or of another format: re-export or re-download it"
        ) from exc
    return model


def _check_text(message, source: str, where: str = "model") -> None:
    """Refuse string fields that are not valid UTF-8 (protobuf's proto2 parser lets them through
    as ``bytes``; every later stage expects text). Tensor data fields are not visited."""
    is_tensor = isinstance(message, onnx.TensorProto)
    for field, value in message.ListFields():
        if is_tensor and field.name not in ("name", "doc_string", "external_data"):
            continue
        values = value if _is_repeated(field) else [value]
        if field.type == field.TYPE_STRING:
            for v in values:
                if not isinstance(v, str):
                    raise ModelLoadError(
                        f"{source}: {where}.{field.name} holds bytes that are not UTF-8 text "
                        f"({bytes(v)[:40]!r}); the file is corrupt: re-export or re-download it"
                    )
        elif field.type == field.TYPE_MESSAGE:
            for i, v in enumerate(values):
                name = getattr(v, "name", "") if field.name != "graph" else ""
                label = name if isinstance(name, str) else ""
                inner = f"{field.name}[{label or i}]" if _is_repeated(field) else field.name
                _check_text(v, source, f"{where}.{inner}" if where != "model" else inner)


def _check_shapes(model: onnx.ModelProto, source: str) -> None:
    """Strict ONNX shape inference as a check (its result is not kept).

    It refuses attribute values the checker lets through but that native code divides by or
    indexes with (a Conv stride of 0 passes the checker and kills the process with SIGFPE inside
    onnxsim), and inputs whose shapes cannot meet. Nodes of domains without a schema are skipped
    by the inference, so custom ops are not refused here.
    """
    try:
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
    # InferenceError for inconsistent shapes; ValueError for values the checker lets through but
    # inference cannot represent (e.g. a tensor data type code of 127 in a Constant).
    except (onnx.shape_inference.InferenceError, ValueError) as exc:
        raise ModelLoadError(
            f"{source}: fails ONNX shape inference: {_one_line(exc)}; fix the node's attributes "
            "or input shapes, or re-export the model"
        ) from exc


def validate_proto(model: onnx.ModelProto, *, source: str = "<model>") -> onnx.ModelProto:
    """The checks of :func:`load_model` for a model already in memory (then the opset upgrade).

    Its tensors must hold their data (external references are refused: load from a path).

    Raises:
        ModelLoadError: not UTF-8 names, unread external data, checker failures, no upgrade.
    """
    if not isinstance(model, onnx.ModelProto):
        raise ModelLoadError(f"{source}: expected an onnx.ModelProto, got {type(model).__name__}")
    if not model.opset_import:
        raise ModelLoadError(f"{source}: the model declares no opset_import; not a valid model")
    _check_text(model, source)
    _check_tensor_types(model, source)
    unloaded = _unloaded_external(model)
    if unloaded:
        raise ModelLoadError(
            f"{source}: tensor {unloaded[0]!r} refers to external data that was not read; pass "
            "the model's path instead (its data is then read and checked)"
        )
    if fits_in_protobuf(model):  # the checker serializes the model
        try:
            onnx.checker.check_model(model)
        except (onnx.checker.ValidationError, ValueError) as exc:
            raise ModelLoadError(
                f"{source}: fails the ONNX checker: {_one_line(exc)}; fix or re-export the model"
            ) from exc
        _check_shapes(model, source)
    if 0 < default_opset(model) < MIN_OPSET:
        if not fits_in_protobuf(model):
            raise ModelLoadError(
                f"{source}: opset {default_opset(model)} is below {MIN_OPSET} and the model is "
                "above 2 GB; save it with external data and pass its path to be upgraded"
            )
        model = upgrade(model, MIN_OPSET, source=source)
    return model


def upgrade(model: onnx.ModelProto, target: int, *, source: str = "model") -> onnx.ModelProto:
    """Convert ``model`` to ``target`` opset with onnx's version converter.

    External-data references are kept as they are (the converter copies them), so a model can be
    upgraded before its weights are read.
    """
    from onnx import version_converter

    before = default_opset(model)
    try:
        upgraded = version_converter.convert_version(model, target)
    except Exception as exc:  # the converter raises bare RuntimeErrors with C++ messages
        raise ModelLoadError(
            f"{source}: opset {before} is below {target} and onnx's version converter could not "
            f"upgrade it ({_one_line(exc, 200)}); export the model with opset >= {target}"
        ) from exc
    logger.info("%s: upgraded from opset %d to %d", source, before, target)
    return upgraded


def to_ir(model: onnx.ModelProto) -> ir.Model:
    """The onnx_ir model the passes work on (tensors are shared with ``model``, not copied)."""
    return ir.serde.deserialize_model(model)


def to_proto(model: ir.Model, *, keep_external: bool = False) -> onnx.ModelProto:
    """Serialize ``model``.

    ``keep_external=False`` (default): a self-contained proto, the bytes of memory-mapped
    external tensors read into ``raw_data`` (one full copy of them). ``keep_external=True``: those
    tensors stay references (location, offset, length) relative to :func:`external_data_dir`:
    the proto is small whatever the weights; pass that folder to onnxruntime
    (``session.model_external_initializers_file_folder_path``) to run it.
    """
    from quark_onnx.counters import COUNTS

    COUNTS.serialisations += 1
    return serialize_ir(model, keep_external=keep_external)


def serialize_ir(model: ir.Model, *, keep_external: bool = False) -> onnx.ModelProto:
    """:func:`to_proto` without counting it (``quark_onnx.runtime.sessions`` counts a model it
    serializes to build a session as part of that session)."""
    proto = ir.serde.serialize_model(model)
    if not keep_external:
        external = _external_tensors(proto)
        if external:
            folder = external_data_dir(model)
            _read_external_data(external, folder if folder is not None else Path.cwd())
    return proto


def signature_proto(model: ir.Model) -> onnx.ModelProto:
    """A proto of ``model``'s interface only: its opsets and the graph inputs a feed provides
    (initializers listed as inputs left out), no node and no tensor.

    What the calibration readers read (names, element types, dims) without serializing the
    graph: a full :func:`to_proto` of a 50,000-node model costs ~30 MB for that.
    """
    graph = model.graph
    initializers = set(graph.initializers)
    proto = onnx.ModelProto(ir_version=model.ir_version)
    for domain, version in model.opset_imports.items():
        proto.opset_import.add(domain=domain, version=version)
    proto.graph.name = graph.name or ""
    for value in graph.inputs:
        if value.name not in initializers:
            proto.graph.input.append(ir.serde.serialize_value(value))
    return proto
