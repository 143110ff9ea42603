"""Reading and writing models: validation with clear errors, atomic writes, no input overwrite.

The implementation lives in :mod:`quark_onnx.model_files`, one concept per module:

* :mod:`~quark_onnx.model_files.load`: read, check and upgrade a model; the ``ir.Model`` and
  ``ModelProto`` forms (:func:`load_model`, :func:`load_ir`, :func:`validate_proto`,
  :func:`to_ir`, :func:`to_proto`, :func:`signature_proto`);
* :mod:`~quark_onnx.model_files.external`: external data, checked before any byte is read, read
  in or left memory-mapped (:func:`materialize`, :func:`external_data_dir`, :func:`model_bytes`);
* :mod:`~quark_onnx.model_files.paths`: the output guard every writer calls
  (:func:`check_output_path`);
* :mod:`~quark_onnx.model_files.files`: atomic writes, bounded reads, SIGTERM as an interrupt;
* :mod:`~quark_onnx.model_files.save`: :func:`save_model` (external data when asked or above
  2 GB).

This module re-exports their names (and the few helpers other modules of the package use), so
``from quark_onnx import model_io`` keeps working. Constants are read where they are defined:
patch ``quark_onnx.model_files.<module>.<NAME>``, not this module's copy.
"""

from __future__ import annotations

import os  # noqa: F401 (tests patch model_io.os.replace: the module every writer calls)

from quark_onnx.errors import ModelLoadError, ModelSaveError, UnsafePathError
from quark_onnx.model_files.external import (
    _CRUMB_TYPES,  # noqa: F401
    _INLINE_UNKNOWN,  # noqa: F401
    _KNOWN_TYPES,  # noqa: F401
    _NIBBLE_TYPES,  # noqa: F401
    _PROTOBUF_LIMIT,  # noqa: F401
    _UNSIZED_TYPES,  # noqa: F401
    SMALL_TENSOR_BYTES,
    _check_external_locations,  # noqa: F401
    _check_tensor_types,  # noqa: F401
    _external_info,  # noqa: F401
    _external_tensors,  # noqa: F401
    _fits_with_external,  # noqa: F401
    _graphs,  # noqa: F401
    _ir_tensors,  # noqa: F401
    _is_repeated,  # noqa: F401
    _read_external_data,  # noqa: F401
    _read_small_external,  # noqa: F401
    _tensors,  # noqa: F401
    _unloaded_external,  # noqa: F401
    copy_fields,
    external_data_dir,
    fits_in_protobuf,
    materialize,
    model_bytes,
    resolve_external_location,
    tensor_nbytes,
)
from quark_onnx.model_files.files import (
    _COPY_CHUNK,  # noqa: F401
    _LIVE_TEMPS,  # noqa: F401
    _NAME_MAX,  # noqa: F401
    _PARTIAL_SUFFIX,  # noqa: F401
    Terminated,
    _raise_terminated,  # noqa: F401
    _refuse_special,  # noqa: F401
    atomic_write_bytes,
    check_path_text,
    read_regular_file,
    remove_temporary_files,
    sigterm_as_interrupt,
    temp_file_beside,
    temp_file_done,
)
from quark_onnx.model_files.load import (
    MIN_OPSET,
    _check_shapes,  # noqa: F401
    _check_text,  # noqa: F401
    _load_header,  # noqa: F401
    _one_line,  # noqa: F401
    default_opset,
    load_ir,
    load_model,
    serialize_ir,
    signature_proto,
    to_ir,
    to_proto,
    upgrade,
    validate_proto,
)
from quark_onnx.model_files.paths import (
    _input_files,  # noqa: F401
    _probe_folder,  # noqa: F401
    _same_file,  # noqa: F401
    _same_path,  # noqa: F401
    check_output_path,
    external_data_name,
)
from quark_onnx.model_files.save import (
    _ALIGNMENT,  # noqa: F401
    _TYPED_FIELDS,  # noqa: F401
    EXTERNAL_THRESHOLD,
    _DataWriter,  # noqa: F401
    _save_with_external_data,  # noqa: F401
    _stub_graph,  # noqa: F401
    save_model,
    written_files,
)

__all__ = [
    "EXTERNAL_THRESHOLD",
    "MIN_OPSET",
    "SMALL_TENSOR_BYTES",
    "ModelLoadError",
    "ModelSaveError",
    "Terminated",
    "UnsafePathError",
    "atomic_write_bytes",
    "check_output_path",
    "check_path_text",
    "copy_fields",
    "default_opset",
    "external_data_dir",
    "external_data_name",
    "fits_in_protobuf",
    "load_ir",
    "load_model",
    "materialize",
    "model_bytes",
    "read_regular_file",
    "remove_temporary_files",
    "resolve_external_location",
    "save_model",
    "serialize_ir",
    "signature_proto",
    "sigterm_as_interrupt",
    "temp_file_beside",
    "temp_file_done",
    "tensor_nbytes",
    "to_ir",
    "to_proto",
    "upgrade",
    "validate_proto",
    "written_files",
]
