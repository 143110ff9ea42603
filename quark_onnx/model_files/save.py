"""Saving models: atomic, never over an input, external data when asked or above 2 GB.

A model is written with external data (one ``<model name>.data`` file beside it, offsets aligned
to 4 KiB) when asked or when it is above the 2 GB protobuf limit; the data file's location is
always a bare file name, so no byte is written outside the output folder. Memory-mapped weights
of an ``ir.Model`` are copied file to file in pieces, never read whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import onnx
import onnx_ir as ir

from quark_onnx.errors import ModelSaveError
from quark_onnx.model_files.external import (
    _external_info,
    _external_tensors,
    _fits_with_external,
    _unloaded_external,
    copy_fields,
    external_data_dir,
    materialize,
    resolve_external_location,
)
from quark_onnx.model_files.files import (
    _COPY_CHUNK,
    _PARTIAL_SUFFIX,
    _refuse_special,
    atomic_write_bytes,
    place_file,
    temp_file_beside,
    temp_file_done,
)
from quark_onnx.model_files.load import to_proto
from quark_onnx.model_files.paths import check_output_path, external_data_name

logger = logging.getLogger(__name__)

#: Tensors of at least this many bytes go to the external data file.
EXTERNAL_THRESHOLD = 1024
#: External data offsets are multiples of this (lets onnxruntime map the file).
_ALIGNMENT = 4096
_TYPED_FIELDS = (
    "float_data",
    "int32_data",
    "string_data",
    "int64_data",
    "double_data",
    "uint64_data",
)


def save_model(
    model: onnx.ModelProto | ir.Model,
    path: str | os.PathLike,
    *,
    input_path: str | os.PathLike | None = None,
    overwrite: bool = False,
    external_data: bool | None = None,
    replace: bool = True,
) -> Path:
    """Atomically write ``model`` to ``path``.

    Args:
        model: the model; it is not modified.
        path: the output model file.
        input_path: the input model, which is never replaced (nor its external data).
        overwrite: passed to :func:`check_output_path` (an input is never replaced).
        external_data: ``True`` writes tensors of >= :data:`EXTERNAL_THRESHOLD` bytes to
            ``<name>.data`` beside the model; ``False`` never; ``None`` (default) only when the
            model is above the 2 GB protobuf limit.
        replace: replace an existing ``path`` (default). ``False``: the placement is exclusive:
            if ``path`` (or its data file) exists when the written file is to be placed, it is
            left as it is and :class:`OutputAppearedError` is raised (another run wrote it).

    Raises:
        ModelSaveError: a refused or unwritable path, a model above 2 GB with
            ``external_data=False``, or a model whose tensors still refer to external data that
            was never read (load it with :func:`load_model`).
        OutputAppearedError: ``replace=False`` and the output exists.
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
            "data that was not read; load the model with "
            "quark_onnx.model_files.load.load_model first"
        )
    big = not _fits_with_external(proto)
    try:
        if external_data or (external_data is None and big):
            return _save_with_external_data(proto, out, source=source, replace=replace)
        if big:
            raise ModelSaveError(
                f"{out}: the model is above the 2 GB protobuf limit; save it with "
                "external_data=True"
            )
        if source is not None:
            materialize(proto, source)
        atomic_write_bytes(out, proto.SerializeToString(deterministic=True), replace=replace)
    except OSError as exc:
        raise ModelSaveError(
            f"{out}: cannot write the model ({exc.strerror or exc}); check free space and "
            "permissions of the output folder"
        ) from exc
    return out


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
    proto: onnx.ModelProto, out: Path, *, source: Path | None = None, replace: bool = True
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
            place_file(tmp_model, out, replace=replace)
            return out
        if replace and data_path.exists():
            backup = data_path.with_name(f".{data_path.name}.{os.getpid()}.old{_PARTIAL_SUFFIX}")
            os.replace(data_path, backup)
        # without replace, both placements are exclusive: the data file placed here is this
        # run's own, so it is removed again if the model turns out to exist already
        place_file(tmp_data, data_path, replace=replace)
        data_in_place = True
        place_file(tmp_model, out, replace=replace)
        data_in_place = False
    except BaseException:
        # an interrupt between the model's placement and the line after it: the pair in place
        # is complete (the new model and its data), so the data stays and the backup goes
        placed = data_in_place and _placed(tmp_model, out)
        for tmp in (tmp_data, tmp_model):  # gone, a second link to a placed file, or unplaced
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if placed:
            raise
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


def _placed(tmp: Path, out: Path) -> bool:
    """Whether the temporary file ``tmp`` is now ``out`` (renamed onto it, or linked to it)."""
    try:
        return not tmp.exists() or os.path.samefile(tmp, out)
    except OSError:
        return False


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
