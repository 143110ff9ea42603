"""External data: where a model's tensors live outside its file, checked before any byte is read.

A location must be relative and stay inside the model's folder through no symbolic link
(:func:`resolve_external_location`); its declared length must match the tensor's type and dims
(:func:`tensor_nbytes`) and ``offset + length`` must fit in the file, so a corrupt or hostile
model is refused before anything is read or allocated. Tensors are read into ``raw_data``
(:func:`materialize`) or, in an ``ir.Model``, left memory-mapped (:func:`external_data_dir`,
:func:`model_bytes` sizes them without reading). The 2 GB protobuf limit
(:func:`fits_in_protobuf`) decides when a model must be written with external data.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import EncodeError, Message

from quark_onnx.errors import ModelLoadError, ModelSaveError, UnsafePathError
from quark_onnx.model_files.files import check_path_text, check_regular_file

_PROTOBUF_LIMIT = 2**31 - 1
#: External tensors up to this many bytes are read into memory at load (shape inference needs
#: the values of shape tensors); larger ones stay in their files until used.
SMALL_TENSOR_BYTES = 64 << 10
_INLINE_UNKNOWN = 1 << 62  # an external tensor without a length: never inlined for inference


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
    """Refuse tensors of an unknown data type (onnx_ir cannot even read such a model) and sparse
    initializers (onnx_ir drops them, leaving nodes whose input exists nowhere)."""
    for sparse in model.graph.sparse_initializer:
        raise ModelLoadError(
            f"{source}: sparse initializer {sparse.values.name!r}: quark_onnx reads dense "
            "initializers only; store it as a dense tensor (scatter its values into an array "
            "of its dims and save that with onnx.numpy_helper.from_array)"
        )
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
            if not os.path.lexists(target):
                raise ModelLoadError(
                    f"{what}: external data file {info['location']!r} is missing; copy it "
                    "beside the model"
                )
            sizes[target] = check_regular_file(target, what="external data file")
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
