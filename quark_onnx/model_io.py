"""Reading and writing models: validation with clear errors, atomic writes, no input overwrite.

Loading never writes anything. The order of the checks keeps every failure cheap and named:

1. the file exists, is a regular file, can be read and is not empty;
2. it parses as an ``onnx.ModelProto`` holding a graph and an ``opset_import``, and every string
   field is UTF-8 text;
3. every external-data ``location`` is a relative path that stays inside the model's folder once
   ``..`` and symbolic links are resolved, goes through no symbolic link, names an existing file,
   and ``offset + length`` fits in it (else ``UnsafePathError`` or ``ModelLoadError``);
4. the ONNX checker passes (run before the weights are read, so models above the 2 GB protobuf
   limit are checked too), and so does strict shape inference, run with only the external
   tensors of at most :data:`SMALL_TENSOR_BYTES` read in (shape tensors are small; the large
   weights contribute their dims), so it runs above 2 GB too;
5. a default-domain opset below :data:`MIN_OPSET` is upgraded with onnx's version converter (also
   before the weights are read);
6. :func:`load_model` reads the large external weights into the proto; :func:`load_ir` leaves
   them in their files as memory-mapped ``ir.ExternalTensor`` (peak memory of a big model: its
   mapped pages, no copy).

Memory of big models: :func:`to_proto` with ``keep_external=True`` serializes such a model
without its weights (references relative to :func:`external_data_dir`), :func:`save_model` of an
``ir.Model`` copies mapped weights file to file in pieces, and :func:`model_bytes` gives the size
of a model without reading any weight.

Saving writes every file to a temporary name (``.<name>.<random>.partial``) in the destination
folder and renames it into place only when complete and flushed, so an interrupted run leaves
either the old file or the new one, never a partial file. A model is written with external data
(one ``<model name>.data`` file beside it, offsets aligned to 4 KiB) when asked or when it is above
the 2 GB protobuf limit; the data file's location is always a bare file name, so no byte is
written outside the output folder. The input model and its external data are never outputs
unless ``overwrite=True``.

Python does not unwind ``finally`` blocks on ``SIGTERM``: :func:`sigterm_as_interrupt` turns it
into :class:`Terminated` (a ``KeyboardInterrupt``) for the duration of a run, so temporary files
are removed on ``kill`` as on Ctrl-C.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import signal
import stat
import threading
from collections.abc import Collection, Iterator
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError, EncodeError, Message

from quark_onnx.errors import ModelLoadError, ModelSaveError, UnsafePathError

logger = logging.getLogger(__name__)

#: Lowest opset the quantizer works on; older models are upgraded on load.
MIN_OPSET = 13
_PROTOBUF_LIMIT = 2**31 - 1
#: Tensors of at least this many bytes go to the external data file.
EXTERNAL_THRESHOLD = 1024
#: External data offsets are multiples of this (lets onnxruntime map the file).
_ALIGNMENT = 4096
_PARTIAL_SUFFIX = ".partial"
#: External tensors up to this many bytes are read into memory at load (shape inference needs
#: the values of shape tensors); larger ones stay in their files until used.
SMALL_TENSOR_BYTES = 64 << 10
_INLINE_UNKNOWN = 1 << 62  # an external tensor without a length: never inlined for inference
#: External data is copied between files in pieces of this size.
_COPY_CHUNK = 16 << 20
_TYPED_FIELDS = (
    "float_data",
    "int32_data",
    "string_data",
    "int64_data",
    "double_data",
    "uint64_data",
)


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


# --- loading ---------------------------------------------------------------------------------


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
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{p}: no such file; check the model path")
    if not p.is_file():
        raise ModelLoadError(f"{p}: is not a file; give the path of an .onnx model file")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ModelLoadError(
            f"{p}: cannot be read ({exc.strerror or exc}); check the file's permissions"
        ) from exc
    if not data:
        raise ModelLoadError(f"{p}: the file is empty, not an ONNX model")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(
            f"{p}: not a valid ONNX model (protobuf parse failed: {_one_line(exc)}); the file "
            "may be truncated or of another format: re-export or re-download it"
        ) from exc
    del data
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


def _read_small_external(model: onnx.ModelProto, path: Path) -> None:
    """Read the external tensors of at most :data:`SMALL_TENSOR_BYTES` into ``model``.

    Shape inference needs the values of shape-like tensors (Reshape shapes, Slice starts...),
    which are small; the large weights stay references, whose dims are all inference uses. Small
    tensors held in memory also spare one file mapping each when the weights are mapped.
    """
    small = [
        t
        for t in _external_tensors(model)
        if int(_external_info(t).get("length") or _INLINE_UNKNOWN) <= SMALL_TENSOR_BYTES
    ]
    if small:
        _read_external_data(small, path.parent)


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


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph (If/Loop/Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graphs(g)


def _tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor stored in the model: initializers, sparse parts, tensor attributes."""
    for graph in _graphs(model.graph):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.TENSORS:
                    yield from attr.tensors


def _external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in _tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL]


def _external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def resolve_external_location(location: str, base: Path, *, what: str) -> Path:
    """The file an external-data ``location`` names, refusing paths that leave ``base``.

    ``location`` must be relative; after resolving ``..`` and symbolic links the file must lie
    inside ``base`` (resolved too), and no part of it may be a symbolic link (the ONNX checker
    refuses linked data files as well).

    Raises:
        UnsafePathError: naming ``what`` (model and tensor) and the offending location.
    """
    if location:
        check_path_text(location, f"{what} has external data location", UnsafePathError)
    if not location or os.path.isabs(location) or Path(location).drive:
        raise UnsafePathError(
            f"{what} has external data location {location!r}; only paths relative to the "
            "model's folder are accepted: move the data file beside the model"
        )
    root = base.resolve()
    target = (root / location).resolve()
    if target != root and root not in target.parents:
        kind = "through a symbolic link " if ".." not in Path(location).parts else ""
        raise UnsafePathError(
            f"{what} has external data location {location!r} which escapes the model's folder "
            f"{kind}{root} (resolves to {target}); move the data file into the model's folder"
        )
    linked = base
    for part in Path(location).parts:
        linked = linked / part
        if linked.is_symlink():
            raise UnsafePathError(
                f"{what} has external data location {location!r} through the symbolic link "
                f"{linked}; linked external data is not read (onnx refuses it too): copy the "
                "file itself into the model's folder"
            )
    return target


#: Data types stored in half a byte per element (two elements per byte, rounded up).
_NIBBLE_TYPES = frozenset(
    getattr(onnx.TensorProto, name)
    for name in ("INT4", "UINT4", "FLOAT4E2M1")
    if hasattr(onnx.TensorProto, name)
)
_CRUMB_TYPES = frozenset(
    getattr(onnx.TensorProto, name) for name in ("INT2", "UINT2") if hasattr(onnx.TensorProto, name)
)
#: Packed types whose byte layout is not checked here (their size is left to onnx).
_UNSIZED_TYPES = frozenset(
    getattr(onnx.TensorProto, name)
    for name in ("STRING", "FLOAT6E2M3", "FLOAT6E3M2")
    if hasattr(onnx.TensorProto, name)
)
_KNOWN_TYPES = frozenset(onnx.TensorProto.DataType.values()) - {onnx.TensorProto.UNDEFINED}


def tensor_nbytes(tensor: onnx.TensorProto, what: str = "") -> int | None:
    """Bytes the raw data of ``tensor`` must hold from its type and dims (None: STRING, FLOAT6).

    Raises:
        ModelLoadError: an unknown data type or a negative dimension.
    """
    if tensor.data_type not in _KNOWN_TYPES:
        raise ModelLoadError(
            f"{what or 'tensor ' + repr(tensor.name)}: unknown tensor data type "
            f"{tensor.data_type}; the model file is corrupt or from a newer ONNX: re-export it"
        )
    if tensor.data_type in _UNSIZED_TYPES:
        return None
    count = 1
    for d in tensor.dims:
        if d < 0:
            raise ModelLoadError(
                f"{what or 'tensor ' + repr(tensor.name)}: negative dimension in "
                f"{list(tensor.dims)}; the model file is corrupt: re-export it"
            )
        count *= d
    if tensor.data_type in _NIBBLE_TYPES:
        return (count + 1) // 2
    if tensor.data_type in _CRUMB_TYPES:
        return (count + 3) // 4
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return count * itemsize


def _check_tensor_types(model: onnx.ModelProto, source: str) -> None:
    """Refuse tensors of an unknown data type (onnx_ir cannot even read such a model)."""
    for tensor in _tensors(model):
        if tensor.data_type not in _KNOWN_TYPES:
            tensor_nbytes(tensor, f"{source}: tensor {tensor.name!r}")


def _check_external_locations(tensors: list[onnx.TensorProto], path: Path) -> None:
    """Validate every external reference before anything is read (see the module docstring)."""
    sizes: dict[Path, int] = {}
    for tensor in tensors:
        what = f"{path}: tensor {tensor.name!r}"
        info = _external_info(tensor)
        target = resolve_external_location(info.get("location", ""), path.parent, what=what)
        if target not in sizes:
            if not target.is_file():
                raise ModelLoadError(
                    f"{what}: external data file {info['location']!r} is missing; copy it "
                    "beside the model"
                )
            sizes[target] = target.stat().st_size
        try:
            offset = int(info.get("offset", "0") or 0)
            length = int(info["length"]) if info.get("length") else None
        except ValueError as exc:
            raise ModelLoadError(f"{what}: malformed external data offset/length") from exc
        needed = tensor_nbytes(tensor, what)
        if length is not None and needed is not None and length != needed:
            # checked before any byte is read: a declared length of gigabytes for a tensor of a
            # few hundred bytes would otherwise be read (and copied) whole
            raise ModelLoadError(
                f"{what}: external data length {length} does not match the tensor's "
                f"{onnx.TensorProto.DataType.Name(tensor.data_type)}{list(tensor.dims)} "
                f"({needed} bytes); the model file is corrupt: re-export it"
            )
        if length is None and needed is not None:
            length = needed
        end = offset + (length if length is not None else 0)
        if offset < 0 or (length is not None and length < 0) or end > sizes[target]:
            raise ModelLoadError(
                f"{what}: external data {info['location']!r} holds {sizes[target]} bytes but "
                f"the tensor needs bytes {offset}..{end}; the data file is truncated or belongs "
                "to another model"
            )


def _read_external_data(tensors: list[onnx.TensorProto], folder: Path) -> None:
    """Read each external tensor's bytes into ``raw_data`` (locations relative to ``folder``,
    already validated)."""
    base = folder.resolve()
    handles: dict[Path, object] = {}
    try:
        for tensor in tensors:
            info = _external_info(tensor)
            target = (base / info["location"]).resolve()
            f = handles.get(target)
            if f is None:
                f = handles[target] = open(target, "rb")  # noqa: SIM115 (closed below)
            offset = int(info.get("offset", "0") or 0)
            f.seek(offset)
            length = int(info["length"]) if info.get("length") else -1
            tensor.raw_data = f.read(length)
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    except OSError as exc:
        raise ModelLoadError(
            f"{folder}: cannot read external data ({exc.strerror or exc}); check the data files"
        ) from exc
    finally:
        for f in handles.values():
            f.close()


def to_ir(model: onnx.ModelProto) -> ir.Model:
    """The onnx_ir model the passes work on (tensors are shared with ``model``, not copied)."""
    return ir.serde.deserialize_model(model)


def _ir_tensors(graph: ir.Graph) -> Iterator[ir.TensorProtocol]:
    """Every tensor of ``graph``: initializers and tensor attributes, subgraphs included."""
    for value in graph.initializers.values():
        if value.const_value is not None:
            yield value.const_value
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for attr in node.attributes.values():
            if attr.is_ref() or attr.value is None:
                continue
            if attr.type == ir.AttributeType.TENSOR:
                yield attr.value
            elif attr.type == ir.AttributeType.TENSORS:
                yield from attr.value
            elif attr.type == ir.AttributeType.GRAPH:
                for value in attr.value.initializers.values():
                    if value.const_value is not None:
                        yield value.const_value
            elif attr.type == ir.AttributeType.GRAPHS:
                for g in attr.value:
                    for value in g.initializers.values():
                        if value.const_value is not None:
                            yield value.const_value


def external_data_dir(model: ir.Model) -> Path | None:
    """The folder the model's external (memory-mapped) tensors are read from; None if none.

    Raises:
        ModelSaveError: the tensors come from several folders (models from :func:`load_ir`
            never do).
    """
    folders = {
        str(t.base_dir) for t in _ir_tensors(model.graph) if isinstance(t, ir.ExternalTensor)
    }
    if len(folders) > 1:
        raise ModelSaveError(
            f"the model's external tensors come from several folders {sorted(folders)}; load "
            "it from one model file"
        )
    return Path(folders.pop()) if folders else None


def model_bytes(model: ir.Model) -> int:
    """Bytes of all the model's tensors, external ones included, none of them read."""
    return sum(t.nbytes for t in _ir_tensors(model.graph))


def to_proto(model: ir.Model, *, keep_external: bool = False) -> onnx.ModelProto:
    """Serialize ``model``.

    ``keep_external=False`` (default): a self-contained proto, the bytes of memory-mapped
    external tensors read into ``raw_data`` (one full copy of them). ``keep_external=True``: those
    tensors stay references (location, offset, length) relative to :func:`external_data_dir`:
    the proto is small whatever the weights; pass that folder to onnxruntime
    (``session.model_external_initializers_file_folder_path``) to run it.
    """
    from quark_onnx import runtime

    runtime.COUNTS.serialisations += 1
    return serialize_ir(model, keep_external=keep_external)


def serialize_ir(model: ir.Model, *, keep_external: bool = False) -> onnx.ModelProto:
    """:func:`to_proto` without counting it (``quark_onnx.runtime`` counts a model it serializes
    to build a session as part of that session)."""
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


def materialize(proto: onnx.ModelProto, folder: str | os.PathLike) -> onnx.ModelProto:
    """Read every external tensor of ``proto`` (relative to ``folder``) into ``raw_data``, in
    place; returns ``proto``. Locations are checked as at load.

    Raises:
        UnsafePathError: a location leaves ``folder``.
        ModelLoadError: a data file cannot be read.
    """
    base = Path(folder)
    external = _external_tensors(proto)
    for tensor in external:
        resolve_external_location(
            _external_info(tensor).get("location", ""), base, what=f"tensor {tensor.name!r}"
        )
    _read_external_data(external, base)
    return proto


# --- output paths ----------------------------------------------------------------------------


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def external_data_name(output: str | os.PathLike) -> str:
    """File name of the external data written beside ``output``: ``<output name>.data``."""
    return Path(output).name + ".data"


def _input_files(input_path: Path) -> list[Path]:
    """The input model and the external data files it refers to (best effort)."""
    files = [input_path]
    try:
        if not stat.S_ISREG(os.stat(input_path).st_mode):
            return files
        proto = onnx.load(str(input_path), load_external_data=False)
    except Exception:  # an unreadable input adds no data file; loading it reports why
        return files
    for tensor in _external_tensors(proto):
        location = _external_info(tensor).get("location", "")
        if location and not os.path.isabs(location) and "\0" not in location:
            path = input_path.parent / location
            if path not in files:
                files.append(path)
    return files


#: Longest file name component most file systems accept, in bytes.
_NAME_MAX = 255


def check_path_text(path: str | os.PathLike, what: str, error: type[Exception]) -> Path:
    """``path`` as a Path, refusing a NUL byte or a name component above 255 bytes (which the
    operating system refuses with an error that names neither the path nor the option)."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if "\0" in text:
        raise error(f"{what} {text!r}: a path cannot contain a NUL character")
    for part in Path(text).parts:
        if len(os.fsencode(part)) > _NAME_MAX:
            raise error(
                f"{what} {text[:80]!r}...: the name {part[:40]!r}... is {len(os.fsencode(part))} "
                f"bytes long; file systems accept at most {_NAME_MAX}: choose a shorter name"
            )
    return Path(text)


def _same_path(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name the same file (same inode, or the same resolved path)."""
    if _same_file(a, b):
        return True
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):
        return False


def _probe_folder(folder: Path, out: Path) -> None:
    """Create and remove a temporary file in ``folder``: a read-only mount, ``/proc`` or a folder
    without write permission is refused before any work, naming the output."""
    try:
        fd, tmp = temp_file_beside(out)
    except OSError as exc:
        raise ModelSaveError(
            f"{out}: cannot write in folder {folder} ({exc.strerror or exc}); choose a writable "
            "output folder"
        ) from exc
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    temp_file_done(tmp)


def check_output_path(
    output: str | os.PathLike,
    input_path: str | os.PathLike | None = None,
    overwrite: bool = False,
    *,
    inputs: Collection[str | os.PathLike | None] = (),
    external_data: bool = True,
    what: str = "output",
) -> Path:
    """The one guard every writer calls before any work: refuse an output that would destroy an
    input or is not a plain file.

    Refused (``ModelSaveError`` naming the output and the file it would replace):

    * an output that is (by any spelling: ``./``, ``..``, symbolic or hard link) the input model,
      unless ``overwrite`` (replacing the input is then asked for), or any of the input model's
      external data files or of ``inputs`` (calibration data, a saved calibration result, a
      recipe...), even with ``overwrite``;
    * with ``external_data``, the data file ``<output>.data`` a model is written with being one of
      those input files;
    * an existing output that is not a regular file (a folder, a device such as ``/dev/null``, a
      FIFO, a socket): a rename would replace the node itself;
    * a NUL character or a name above 255 bytes; a missing output folder or one that is not a
      folder (``/dev/null/x``); a folder that cannot be written (read-only mount, ``/proc``);
    * names ending in ``.partial`` (temporary names of this module).
    """
    out = check_path_text(output, what, ModelSaveError)
    if out.name.endswith(_PARTIAL_SUFFIX):
        raise ModelSaveError(f"{out}: names ending in {_PARTIAL_SUFFIX} are reserved; rename it")
    protected: list[tuple[Path, str]] = []
    if input_path is not None:
        inp = Path(input_path)
        replacing = overwrite and _same_path(out, inp)
        if not overwrite:
            protected.append((inp, "the input model"))
        if not replacing:  # replacing the model (asked for) replaces its data file too
            protected += [(f, "the input model's external data") for f in _input_files(inp)[1:]]
    for extra in inputs:
        if extra is not None:
            path = Path(extra)
            if path.is_dir():
                continue
            protected.append((path, "an input file"))
            if path.suffix.lower() == ".onnx":
                protected += [(f, "an input model's external data") for f in _input_files(path)[1:]]
    data = out.parent / external_data_name(out)
    for target, label in ((out, what), (data, f"{what}'s external data file")):
        if target is data and not external_data:
            continue
        for source, kind in protected:
            if _same_path(target, source):
                hint = (
                    " (or pass overwrite=True to replace the input)"
                    if kind == "the input model"
                    else ""
                )
                raise ModelSaveError(
                    f"{out}: the {label} {target} is {kind} {source}; writing it would destroy "
                    f"that file: choose another output path{hint}"
                )
    try:
        mode = os.stat(out).st_mode
    except FileNotFoundError:
        mode = None
    except NotADirectoryError:
        raise ModelSaveError(
            f"{out}: {out.parent} is not a folder; give a path inside an existing folder"
        ) from None
    except OSError as exc:
        raise ModelSaveError(f"{out}: cannot be inspected ({exc.strerror or exc})") from exc
    if mode is not None and stat.S_ISDIR(mode):
        raise ModelSaveError(f"{out}: is a folder; give a file path for the {what}")
    if mode is not None and not stat.S_ISREG(mode):
        raise ModelSaveError(
            f"{out}: exists and is not a regular file (a device, FIFO or socket); it is never "
            f"replaced: choose a file path for the {what}"
        )
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.exists():
        raise ModelSaveError(f"{out}: folder {folder} does not exist; create it first")
    if not folder.is_dir():
        raise ModelSaveError(f"{out}: {folder} is not a folder; give a path inside a folder")
    _probe_folder(folder, out)
    return out


def read_regular_file(
    path: str | os.PathLike,
    *,
    limit: int,
    what: str,
    error: type[Exception] = ModelLoadError,
    option: str | None = None,
) -> bytes:
    """The bytes of ``path``, refusing anything but a regular file of at most ``limit`` bytes.

    Opened without blocking (a FIFO never waits for a writer) and checked with ``fstat`` on the
    open descriptor, so a device (``/dev/zero``), FIFO or a link to a huge file is refused before
    one byte is read; at most ``limit + 1`` bytes are ever read (a file that grows meanwhile).

    Raises:
        ``error``: naming ``what``, the file and ``option`` (the flag or setting it came from).
    """
    p = Path(path)
    label = f"{option} {p}" if option else str(p)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise error(f"{label}: no such file ({what})") from None
    except OSError as exc:
        raise error(f"{label}: cannot be read ({exc.strerror or exc}); check the path") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else "a device, FIFO or socket"
            raise error(f"{label}: is {kind}, not a regular file; give the path of the {what}")
        if info.st_size > limit:
            raise error(
                f"{label}: {info.st_size} bytes, above the {limit}-byte limit for a {what}; "
                "this is not the file you meant (or it is corrupt)"
            )
        chunks = []
        left = limit + 1
        while left > 0:
            piece = os.read(fd, min(left, _COPY_CHUNK))
            if not piece:
                break
            chunks.append(piece)
            left -= len(piece)
    except OSError as exc:
        raise error(f"{label}: cannot be read ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise error(f"{label}: grew above the {limit}-byte limit for a {what} while being read")
    return data


# --- atomic writing --------------------------------------------------------------------------


#: Temporary files this process has created and not yet renamed or removed. A path is recorded
#: *before* the file is created, so an interrupt (SIGTERM, Ctrl-C) arriving at any instant between
#: creating the file and the caller's ``try`` still finds it: :func:`remove_temporary_files` runs
#: when :func:`sigterm_as_interrupt` exits by an exception and at interpreter exit.
_LIVE_TEMPS: set[Path] = set()


def temp_file_beside(final: Path) -> tuple[int, Path]:
    """An open temporary file in ``final``'s folder, to be renamed onto ``final`` when complete.

    Created with mode 0666 less the umask (what a plainly created file gets, unlike
    ``mkstemp``'s private 0600), named ``.<final name>.<pid>.<random>.partial``. Call
    :func:`temp_file_done` once it has been renamed or removed.
    """
    folder = final.parent if str(final.parent) else Path(".")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = folder / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}{_PARTIAL_SUFFIX}"
        _LIVE_TEMPS.add(tmp)
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            _LIVE_TEMPS.discard(tmp)
        except BaseException:
            _LIVE_TEMPS.discard(tmp)
            raise
    raise ModelSaveError(f"{final}: could not create a temporary file in {folder}")


def temp_file_done(tmp: Path) -> None:
    """``tmp`` (from :func:`temp_file_beside`) was renamed into place or removed."""
    _LIVE_TEMPS.discard(tmp)


def remove_temporary_files() -> None:
    """Remove every temporary file of this process that is still recorded (after an interrupt)."""
    for tmp in list(_LIVE_TEMPS):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        _LIVE_TEMPS.discard(tmp)


atexit.register(remove_temporary_files)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place."""
    p = Path(path)
    _refuse_special(p)
    try:
        fd, tmp = temp_file_beside(p)
    except OSError as exc:
        raise ModelSaveError(f"{p}: cannot be written ({exc.strerror or exc})") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ModelSaveError(
            f"{p}: cannot be written ({exc.strerror or exc}); check free space and permissions"
        ) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        temp_file_done(tmp)


def _refuse_special(p: Path) -> None:
    """Every rename onto ``p`` goes through here: a device, FIFO or folder is never replaced."""
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise ModelSaveError(
            f"{p}: exists and is not a regular file (a folder, device, FIFO or socket); it is "
            "never replaced: choose a file path"
        )


def fits_in_protobuf(proto: onnx.ModelProto) -> bool:
    """Whether ``proto`` serializes within the 2 GB protobuf limit.

    With the upb backend (protobuf >= 4) ``ByteSize()`` itself raises ``EncodeError`` above the
    limit instead of returning the size, so it cannot be compared with the limit directly.
    """
    try:
        return proto.ByteSize() < _PROTOBUF_LIMIT
    except EncodeError:
        return False


def _unloaded_external(proto: onnx.ModelProto) -> list[str]:
    return [t.name for t in _external_tensors(proto)]


def save_model(
    model: onnx.ModelProto | ir.Model,
    path: str | os.PathLike,
    *,
    input_path: str | os.PathLike | None = None,
    overwrite: bool = False,
    external_data: bool | None = None,
) -> Path:
    """Atomically write ``model`` to ``path``.

    Args:
        model: the model; it is not modified.
        path: the output model file.
        input_path: the input model, which is never replaced unless ``overwrite``.
        overwrite: allow ``path`` to be ``input_path``.
        external_data: ``True`` writes tensors of >= :data:`EXTERNAL_THRESHOLD` bytes to
            ``<name>.data`` beside the model; ``False`` never; ``None`` (default) only when the
            model is above the 2 GB protobuf limit.

    Raises:
        ModelSaveError: a refused or unwritable path, a model above 2 GB with
            ``external_data=False``, or a model whose tensors still refer to external data that
            was never read (load it with :func:`load_model`).
    """
    out = check_output_path(path, input_path, overwrite)
    source: Path | None = None
    if isinstance(model, ir.Model):
        source = external_data_dir(model)
        proto = to_proto(model, keep_external=source is not None)
    else:
        proto = model
    unloaded = _unloaded_external(proto) if source is None else []
    if unloaded:
        raise ModelSaveError(
            f"{out}: tensor {unloaded[0]!r} (and {len(unloaded) - 1} more) refers to external "
            "data that was not read; load the model with quark_onnx.model_io.load_model first"
        )
    big = not _fits_with_external(proto)
    try:
        if external_data or (external_data is None and big):
            return _save_with_external_data(proto, out, source=source)
        if big:
            raise ModelSaveError(
                f"{out}: the model is above the 2 GB protobuf limit; save it with "
                "external_data=True"
            )
        if source is not None:
            materialize(proto, source)
        atomic_write_bytes(out, proto.SerializeToString(deterministic=True))
    except OSError as exc:
        raise ModelSaveError(
            f"{out}: cannot write the model ({exc.strerror or exc}); check free space and "
            "permissions of the output folder"
        ) from exc
    return out


def _fits_with_external(proto: onnx.ModelProto) -> bool:
    """Whether ``proto`` would fit the protobuf limit with its external tensors read in."""
    if not fits_in_protobuf(proto):
        return False
    external = sum(int(_external_info(t).get("length") or 0) for t in _external_tensors(proto))
    return external == 0 or proto.ByteSize() + external < _PROTOBUF_LIMIT


def _is_repeated(field) -> bool:
    # protobuf >= 6 has ``is_repeated`` (and no ``label`` with the upb backend)
    repeated = getattr(field, "is_repeated", None)
    return bool(repeated) if repeated is not None else field.label == field.LABEL_REPEATED


def copy_fields(src: Message, dst: Message, skip: Collection[str]) -> None:
    """Copy every set field of protobuf message ``src`` except ``skip`` into ``dst`` (same type)."""
    for field, value in src.ListFields():
        if field.name in skip:
            continue
        if _is_repeated(field):
            getattr(dst, field.name).extend(value)
        elif field.type == field.TYPE_MESSAGE:
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)


class _DataWriter:
    """Appends tensor bytes to one open file at aligned offsets and builds the references."""

    def __init__(self, f, location: str, source: Path | None = None) -> None:
        self.f = f
        self.location = location
        self.offset = 0
        self.source = source  # folder of the tensors still in external files (None: none)
        self._sources: dict[Path, object] = {}

    def close(self) -> None:
        for handle in self._sources.values():
            handle.close()
        self._sources.clear()

    def _open(self, tensor: onnx.TensorProto):
        """The external data file of ``tensor`` (checked to lie in :attr:`source`), opened once."""
        if self.source is None:
            raise ModelSaveError(f"tensor {tensor.name!r} refers to external data never read")
        location = _external_info(tensor).get("location", "")
        path = resolve_external_location(location, self.source, what=f"tensor {tensor.name!r}")
        handle = self._sources.get(path)
        if handle is None:
            handle = self._sources[path] = open(path, "rb")  # noqa: SIM115 (closed in close())
        return handle

    def _align(self) -> None:
        pad = -self.offset % _ALIGNMENT
        if pad:
            self.f.write(b"\0" * pad)
            self.offset += pad

    def _reference(self, dst: onnx.TensorProto, length: int) -> None:
        for key, value in (
            ("location", self.location),
            ("offset", str(self.offset)),
            ("length", str(length)),
        ):
            entry = dst.external_data.add()
            entry.key, entry.value = key, value
        dst.data_location = onnx.TensorProto.EXTERNAL
        self.offset += length

    def _stream(self, tensor: onnx.TensorProto, dst: onnx.TensorProto) -> None:
        """Copy an external tensor's bytes from its data file in pieces (never whole in memory).

        A tensor that would be small once read in is written inline, exactly as the same tensor
        held in memory would be.
        """
        info = _external_info(tensor)
        offset = int(info.get("offset", "0") or 0)
        length = int(info["length"]) if info.get("length") else None
        handle = self._open(tensor)
        if length is None:
            length = os.fstat(handle.fileno()).st_size - offset
        if length < EXTERNAL_THRESHOLD:
            inline = onnx.TensorProto()
            copy_fields(tensor, inline, {"external_data", "data_location"})
            handle.seek(offset)
            inline.raw_data = handle.read(length)
            self.stub(inline, dst)
            return
        copy_fields(tensor, dst, {"raw_data", "external_data", "data_location", *_TYPED_FIELDS})
        self._align()
        handle.seek(offset)
        remaining = length
        while remaining:
            piece = handle.read(min(_COPY_CHUNK, remaining))
            if not piece:
                raise ModelSaveError(
                    f"tensor {tensor.name!r}: its external data file ends {remaining} bytes "
                    "early (changed since the model was loaded?)"
                )
            self.f.write(piece)
            remaining -= len(piece)
        self._reference(dst, length)

    def stub(self, tensor: onnx.TensorProto, dst: onnx.TensorProto) -> None:
        """``dst`` = ``tensor`` with its bytes moved to the file (or a plain copy if small)."""
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            self._stream(tensor, dst)
            return
        if tensor.ByteSize() < EXTERNAL_THRESHOLD or tensor.data_type == onnx.TensorProto.STRING:
            dst.CopyFrom(tensor)
            return
        if tensor.HasField("raw_data"):
            data = tensor.raw_data
        else:  # values in a typed field (float_data, int32_data, ...): stored little-endian raw
            data = (
                onnx.numpy_helper.to_array(tensor)
                .astype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).newbyteorder("<"))
                .tobytes()
            )
        copy_fields(tensor, dst, {"raw_data", "external_data", "data_location", *_TYPED_FIELDS})
        self._align()
        self.f.write(data)
        self._reference(dst, len(data))


def _stub_graph(src: onnx.GraphProto, dst: onnx.GraphProto, writer: _DataWriter) -> None:
    """``dst`` = ``src`` with every large tensor (subgraphs too) written out by ``writer``."""
    copy_fields(src, dst, {"node", "initializer", "sparse_initializer"})
    for tensor in src.initializer:
        writer.stub(tensor, dst.initializer.add())
    for sparse in src.sparse_initializer:
        new = dst.sparse_initializer.add()
        new.dims.extend(sparse.dims)
        writer.stub(sparse.values, new.values)
        writer.stub(sparse.indices, new.indices)
    for node in src.node:
        new = dst.node.add()
        copy_fields(node, new, {"attribute"})
        for attr in node.attribute:
            a = new.attribute.add()
            copy_fields(attr, a, {"t", "tensors", "g", "graphs"})
            if attr.HasField("t"):
                writer.stub(attr.t, a.t)
            for t in attr.tensors:
                writer.stub(t, a.tensors.add())
            if attr.HasField("g"):
                _stub_graph(attr.g, a.g, writer)
            for g in attr.graphs:
                _stub_graph(g, a.graphs.add(), writer)


def _save_with_external_data(
    proto: onnx.ModelProto, out: Path, *, source: Path | None = None
) -> Path:
    """Write ``out`` and ``<out name>.data`` (temporary names first, then two renames).

    The model's own tensors are streamed to the data file one at a time and a small copy of the
    model, holding references instead of bytes, is written as ``out``; ``proto`` is untouched and
    no full copy of it is made. Tensors still in external files (memory-mapped weights of a model
    from :func:`load_ir`, relative to ``source``) are copied file to file in 16 MiB pieces.

    If the process stops between the two renames, the new data file
    is removed again and an older data file of the same name restored.
    """
    data_path = out.parent / external_data_name(out)
    _refuse_special(out)
    _refuse_special(data_path)
    fd_data, tmp_data = temp_file_beside(data_path)
    fd_model, tmp_model = temp_file_beside(out)
    backup: Path | None = None
    data_in_place = False
    try:
        header = onnx.ModelProto()
        copy_fields(proto, header, {"graph"})
        with os.fdopen(fd_data, "wb") as f:
            writer = _DataWriter(f, data_path.name, source)
            try:
                _stub_graph(proto.graph, header.graph, writer)
            finally:
                writer.close()
            f.flush()
            os.fsync(f.fileno())
        empty = writer.offset == 0  # no tensor large enough: a plain model file, no data file
        with os.fdopen(fd_model, "wb") as f:
            f.write(header.SerializeToString(deterministic=True))
            f.flush()
            os.fsync(f.fileno())
        if empty:
            os.unlink(tmp_data)
            os.replace(tmp_model, out)
            return out
        if data_path.exists():
            backup = data_path.with_name(f".{data_path.name}.{os.getpid()}.old{_PARTIAL_SUFFIX}")
            os.replace(data_path, backup)
        os.replace(tmp_data, data_path)
        data_in_place = True
        os.replace(tmp_model, out)
        data_in_place = False
    except BaseException:
        for tmp in (tmp_data, tmp_model):
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if data_in_place:
            with contextlib.suppress(OSError):
                os.unlink(data_path)
        if backup is not None:
            with contextlib.suppress(OSError):
                os.replace(backup, data_path)
            backup = None
        raise
    finally:
        temp_file_done(tmp_data)
        temp_file_done(tmp_model)
        if backup is not None:
            with contextlib.suppress(OSError):
                os.unlink(backup)
    logger.info("%s: written with external data %s", out, data_path.name)
    return out


def written_files(path: str | os.PathLike) -> list[Path]:
    """The files a saved model consists of: the model and each external data file it names.

    Raises:
        UnsafePathError: a location of the saved model leaves its folder.
    """
    p = Path(path)
    proto = onnx.load(str(p), load_external_data=False)
    files = [p]
    for tensor in _external_tensors(proto):
        target = resolve_external_location(
            _external_info(tensor).get("location", ""), p.parent, what=f"{p}: {tensor.name!r}"
        )
        if target not in files:
            files.append(target)
    return files


# --- interruption ----------------------------------------------------------------------------


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives ``SIGTERM`` inside
    :func:`sigterm_as_interrupt`; unwinds ``finally`` blocks like Ctrl-C does."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(f"received signal {signum}")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, ``SIGTERM`` raises :class:`Terminated` so temporary files are removed.

    Only the main thread can install signal handlers: elsewhere (and where ``SIGTERM`` does not
    exist) this does nothing. A handler other than the default one (set by an embedding
    application) is left alone. The previous handler is restored on exit.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "SIGTERM")
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except BaseException:
        remove_temporary_files()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
