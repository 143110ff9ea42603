"""Reading and writing models: validation with clear errors, atomic writes, no input overwrite.

Loading never writes anything. Saving writes to a temporary file in the destination folder and
renames it into place only when complete, so an interrupted run leaves either the old file or the
new one, never a partial file; the input model is never the output unless ``overwrite=True``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from quark_onnx.errors import ModelLoadError, ModelSaveError

logger = logging.getLogger(__name__)

#: Lowest opset the quantizer works on; older models are upgraded on load.
MIN_OPSET = 13
_PROTOBUF_LIMIT = 2**31 - 1


def default_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return 0


def load_model(path: str | os.PathLike, *, upgrade_opset: bool = True) -> onnx.ModelProto:
    """Read, validate and (if below opset 13) upgrade an ONNX model.

    Raises:
        ModelLoadError: the file is missing, unreadable, not an ONNX protobuf, truncated, fails
            the ONNX checker, or cannot be upgraded to opset 13.
    """
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{p}: no such file")
    if not p.is_file():
        raise ModelLoadError(f"{p}: is not a file")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"{p}: cannot be read ({exc.strerror or exc})") from exc
    if not data:
        raise ModelLoadError(f"{p}: the file is empty, not an ONNX model")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(
            f"{p}: not a valid ONNX model (protobuf parse failed: {exc}); the file may be "
            "truncated or of another format"
        ) from exc
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise ModelLoadError(
            f"{p}: parsed as protobuf but holds no ONNX graph; not an ONNX model (or truncated)"
        )
    if not model.opset_import:
        raise ModelLoadError(f"{p}: the model declares no opset_import; not a valid ONNX model")
    _load_external_data(model, p)
    try:
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{p}: fails the ONNX checker: {first}") from exc
    opset = default_opset(model)
    if upgrade_opset and 0 < opset < MIN_OPSET:
        model = upgrade(model, MIN_OPSET, source=str(p))
    return model


def upgrade(model: onnx.ModelProto, target: int, *, source: str = "model") -> onnx.ModelProto:
    """Convert ``model`` to ``target`` opset with onnx's version converter."""
    from onnx import version_converter

    try:
        return version_converter.convert_version(model, target)
    except Exception as exc:  # the converter raises bare RuntimeErrors with C++ messages
        raise ModelLoadError(
            f"{source}: opset {default_opset(model)} is below {target} and onnx's version "
            f"converter could not upgrade it ({str(exc).splitlines()[0] if str(exc) else exc}); "
            f"export the model with opset >= {target}"
        ) from exc


def _load_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Load external tensor data, refusing locations that leave the model's folder."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    base = path.parent.resolve()
    external = [t for t in _get_all_tensors(model) if uses_external_data(t)]
    if not external:
        return
    from quark_onnx.errors import UnsafePathError

    for tensor in external:
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if not location or os.path.isabs(location):
            raise UnsafePathError(
                f"{path}: tensor {tensor.name!r} has external data location "
                f"{location!r}; only paths relative to the model's folder are "
                "accepted"
            )
        target = (base / location).resolve()
        if base != target and base not in target.parents:
            raise UnsafePathError(
                f"{path}: tensor {tensor.name!r} has external data location "
                f"{location!r} which escapes the model's folder {base}"
            )
        if not target.is_file():
            raise ModelLoadError(
                f"{path}: external data file {location!r} of tensor {tensor.name!r} is missing"
            )
    try:
        onnx.load_external_data_for_model(model, str(base))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read external data: {exc}") from exc


def to_ir(model: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(model)


def to_proto(model: ir.Model) -> onnx.ModelProto:
    return ir.serde.serialize_model(model)


def load_ir(path: str | os.PathLike) -> ir.Model:
    """:func:`load_model` returning the onnx_ir graph the passes work on."""
    return to_ir(load_model(path))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output_path(
    output: str | os.PathLike, input_path: str | os.PathLike | None, overwrite: bool = False
) -> Path:
    """Refuse to write over the input model unless ``overwrite`` is set."""
    out = Path(output)
    if input_path is not None and not overwrite:
        inp = Path(input_path)
        if _same_file(out, inp) or out.resolve() == inp.resolve():
            raise ModelSaveError(
                f"{out}: output path is the input model; choose another output "
                "path (or pass overwrite=True to replace the input)"
            )
    if out.exists() and out.is_dir():
        raise ModelSaveError(f"{out}: is a folder; give a file path for the output model")
    if not out.parent.exists():
        raise ModelSaveError(f"{out}: folder {out.parent} does not exist")
    return out


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".partial", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_model(
    model: onnx.ModelProto | ir.Model,
    path: str | os.PathLike,
    *,
    input_path: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Atomically write ``model`` to ``path`` (external data beside it above 2 GB)."""
    out = check_output_path(path, input_path, overwrite)
    proto = to_proto(model) if isinstance(model, ir.Model) else model
    if proto.ByteSize() >= _PROTOBUF_LIMIT:
        return _save_with_external_data(proto, out)
    try:
        atomic_write_bytes(out, proto.SerializeToString(deterministic=True))
    except OSError as exc:
        raise ModelSaveError(f"{out}: cannot write the model ({exc.strerror or exc})") from exc
    return out


def _save_with_external_data(proto: onnx.ModelProto, out: Path) -> Path:
    """Models over the 2 GB protobuf limit: weights in ``<name>.data`` beside the model."""
    data_name = out.name + ".data"
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmpdir:
        tmp_model = Path(tmpdir) / out.name
        onnx.save_model(
            proto,
            str(tmp_model),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data_name,
            size_threshold=1024,
        )
        os.replace(Path(tmpdir) / data_name, out.parent / data_name)
        os.replace(tmp_model, out)
    return out
