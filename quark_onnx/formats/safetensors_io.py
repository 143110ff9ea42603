"""Reading and writing the safetensors format, with strict validation and no code execution.

The format (https://github.com/huggingface/safetensors), as written and read here::

    [8 bytes]  N: unsigned 64-bit little-endian, the length of the header
    [N bytes]  header: UTF-8 JSON object
               {"<tensor name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
                ...,
                "__metadata__": {"<key>": "<value>", ...}}        (optional, strings only)
    [rest]     the byte buffer: every tensor's values, C order, little-endian, at
               ``[begin, end)`` relative to the start of the buffer

The writer pads the header with spaces to a multiple of 8 bytes and lays tensors out by
decreasing element size (then in the order given), so every tensor starts at an offset that is a
multiple of its element size, as the reference implementation does.

Data types (safetensors code -> numpy): ``BOOL``, ``U8``, ``I8``, ``U16``, ``I16``, ``U32``,
``I32``, ``U64``, ``I64``, ``F16``, ``BF16`` (``ml_dtypes.bfloat16``), ``F32``, ``F64``,
``F8_E4M3`` (``ml_dtypes.float8_e4m3fn``) and ``F8_E5M2`` (``ml_dtypes.float8_e5m2``). The format
has no 4-bit type: int4/uint4 arrays (``ml_dtypes.int4``/``uint4``) are stored unpacked, one code
per byte, as ``I8``/``U8``, and their true type is recorded in the metadata under
``"dtype:<tensor name>"``; reading restores it (after checking every code is in range).

Reading checks, and refuses with :class:`SafetensorsError` naming the file and the tensor:

* the file holds at least 8 bytes; the header length is at most :data:`MAX_HEADER_BYTES` and fits
  in the file; the header is UTF-8 JSON whose top level is an object;
* every entry is an object with exactly ``dtype`` (a known code), ``shape`` (non-negative
  integers) and ``data_offsets`` (two integers ``0 <= begin <= end``);
* ``end - begin == prod(shape) * itemsize``, and the shape is one numpy can hold (a zero-size
  tensor's other dimensions are not bounded by its bytes);
* sorted by ``begin``, the tensors are contiguous from 0 and the last one ends exactly at the end
  of the file (no overlap, no gap, no trailing bytes);
* ``__metadata__`` maps strings to strings; a ``dtype:`` entry names a stored tensor and a
  4-bit type compatible with its stored type.

Nothing in a file is ever executed or unpickled: the header is parsed with :func:`json.loads`
and the values are copied out of the buffer with :func:`numpy.frombuffer`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from quark_onnx.errors import QuarkOnnxError

#: Largest header accepted on read (the reference implementation's limit).
MAX_HEADER_BYTES = 100_000_000
#: Metadata key prefix recording the true type of a tensor stored widened (int4/uint4).
DTYPE_KEY_PREFIX = "dtype:"
_METADATA = "__metadata__"
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})

#: safetensors dtype code -> numpy dtype (little-endian).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
#: 4-bit types, stored one code per byte: name -> (numpy dtype, stored code).
WIDENED: dict[str, tuple[np.dtype, str]] = {
    "int4": (np.dtype(ml_dtypes.int4), "I8"),
    "uint4": (np.dtype(ml_dtypes.uint4), "U8"),
}


class SafetensorsError(QuarkOnnxError):
    """A safetensors file is malformed, inconsistent or cannot be written."""


def _code_of(dtype: np.dtype, name: str) -> tuple[str, str | None]:
    """The stored dtype code of an array and, for 4-bit types, the true type's name."""
    for widened, (np_dtype, code) in WIDENED.items():
        if dtype == np_dtype:
            return code, widened
    for code, np_dtype in DTYPES.items():
        if dtype.newbyteorder("<") == np_dtype or dtype == np_dtype:
            return code, None
    raise SafetensorsError(
        f"tensor {name!r}: numpy dtype {dtype} has no safetensors type (supported: "
        f"{', '.join(DTYPES)}, and int4/uint4 stored as I8/U8)"
    )


def serialize(
    tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> bytes:
    """The safetensors bytes of ``tensors`` (name -> array) and string ``metadata``.

    Raises:
        SafetensorsError: a name is empty, starts with ``__`` or clashes with a metadata key; a
            metadata key or value is not a string; an array's dtype has no safetensors type.
    """
    meta: dict[str, str] = {}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise SafetensorsError(
                f"metadata {key!r}: safetensors metadata maps strings to strings, got "
                f"{type(key).__name__} -> {type(value).__name__}"
            )
        if key.startswith(DTYPE_KEY_PREFIX):
            raise SafetensorsError(
                f"metadata {key!r}: keys starting with {DTYPE_KEY_PREFIX!r} are reserved for "
                "the true type of int4/uint4 tensors"
            )
        meta[key] = value
    entries: list[tuple[str, str, np.ndarray]] = []
    for name, array in tensors.items():
        if not isinstance(name, str) or not name or name.startswith("__"):
            raise SafetensorsError(
                f"tensor name {name!r}: must be a non-empty string not starting with '__'"
            )
        array = np.asarray(array)
        code, widened = _code_of(array.dtype, name)
        if widened is not None:
            meta[DTYPE_KEY_PREFIX + name] = widened
            array = array.astype(DTYPES[code])
        else:
            array = array.astype(DTYPES[code], copy=False)
        entries.append((name, code, np.asarray(array, order="C")))
    # decreasing element size keeps every tensor aligned to its own element size
    order = sorted(range(len(entries)), key=lambda i: (-entries[i][2].dtype.itemsize, i))
    header: dict[str, object] = {}
    if meta:
        header[_METADATA] = meta
    offset = 0
    for i in order:
        name, code, array = entries[i]
        header[name] = {
            "dtype": code,
            "shape": [int(d) for d in array.shape],
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    parts = [struct.pack("<Q", len(text)), text]
    parts += [entries[i][2].tobytes() for i in order]
    return b"".join(parts)


def deserialize(
    data: bytes, source: str = "<bytes>"
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse and validate safetensors ``data``: (name -> array in file order, metadata).

    ``source`` names the file in error messages. See the module docstring for every check.

    Raises:
        SafetensorsError: naming ``source`` and the tensor at fault.
    """
    size = len(data)
    if size < 8:
        raise SafetensorsError(
            f"{source}: {size} byte(s), too short for a safetensors file (8-byte header length "
            "missing); the file is truncated or of another format"
        )
    (length,) = struct.unpack("<Q", data[:8])
    if length > MAX_HEADER_BYTES:
        raise SafetensorsError(
            f"{source}: header length {length} exceeds the {MAX_HEADER_BYTES}-byte limit; not a "
            "safetensors file, or corrupt"
        )
    if 8 + length > size:
        raise SafetensorsError(
            f"{source}: header length {length} runs past the end of the {size}-byte file; the "
            "file is truncated or corrupt"
        )
    try:
        header = json.loads(
            data[8 : 8 + length].decode("utf-8"), object_pairs_hook=reject_duplicate_keys
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # (RecursionError: JSON nested deeper than the parser's recursion limit)
        raise SafetensorsError(
            f"{source}: the header is not UTF-8 JSON ({type(exc).__name__}: "
            f"{str(exc)[:200]}); the file is corrupt"
        ) from exc
    if not isinstance(header, dict):
        raise SafetensorsError(f"{source}: the header is JSON but not an object; corrupt file")
    metadata = header.pop(_METADATA, {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SafetensorsError(f"{source}: __metadata__ must map strings to strings")
    buffer = memoryview(data)[8 + length :]
    spans: list[tuple[int, int, str]] = []
    parsed: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
    for name, entry in header.items():
        parsed[name] = _entry(entry, name, source)
        begin, end = parsed[name][2], parsed[name][3]
        spans.append((begin, end, name))
    spans.sort()
    cursor = 0
    for begin, end, name in spans:
        if begin != cursor:
            what = "overlaps the previous tensor" if begin < cursor else "leaves a gap before it"
            raise SafetensorsError(
                f"{source}: tensor {name!r}: data_offsets [{begin}, {end}] {what} (expected "
                f"begin {cursor}); the file is corrupt or was edited"
            )
        cursor = end
    if cursor != len(buffer):
        raise SafetensorsError(
            f"{source}: the tensors cover {cursor} byte(s) but the data section holds "
            f"{len(buffer)}; the file is truncated, padded or was edited"
        )
    tensors: dict[str, np.ndarray] = {}
    for _begin, _end, name in spans:
        dtype, shape, begin, end = parsed[name]
        try:
            array = np.frombuffer(buffer[begin:end], dtype=dtype).reshape(shape).copy()
        except ValueError as exc:
            # a zero-size tensor's other dimensions are not bounded by its bytes: numpy refuses
            # a rank above 64 or dimensions whose product (zeros left out) overflows
            raise SafetensorsError(
                f"{source}: tensor {name!r}: shape {list(shape)} cannot be an array ({exc}); "
                "the file is corrupt or was edited"
            ) from exc
        tensors[name] = array.astype(dtype.newbyteorder("="), copy=False)
    for key, value in list(metadata.items()):
        if not key.startswith(DTYPE_KEY_PREFIX):
            continue
        name = key[len(DTYPE_KEY_PREFIX) :]
        tensors[name] = _narrow(tensors, name, value, source)
        del metadata[key]
    return tensors, dict(metadata)


def reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.loads`` object hook that raises ``ValueError`` on a repeated key (the default keeps
    the last one silently, which would hide a tensor or a setting)."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _entry(entry: object, name: str, source: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
    where = f"{source}: tensor {name!r}"
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise SafetensorsError(
            f"{where}: expected an entry with exactly dtype, shape and data_offsets, got {keys}"
        )
    code = entry["dtype"]
    if code not in DTYPES:
        raise SafetensorsError(f"{where}: unknown dtype {code!r} (supported: {', '.join(DTYPES)})")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise SafetensorsError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    offsets = entry["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise SafetensorsError(
            f"{where}: data_offsets {offsets!r} must be two integers 0 <= begin <= end"
        )
    dtype = DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != expected:
        raise SafetensorsError(
            f"{where}: {code} of shape {shape} needs {expected} byte(s) but data_offsets "
            f"{offsets} span {offsets[1] - offsets[0]}; the header and the data disagree"
        )
    return dtype, tuple(shape), offsets[0], offsets[1]


def _narrow(tensors: dict[str, np.ndarray], name: str, kind: str, source: str) -> np.ndarray:
    """Restore an int4/uint4 tensor stored one code per byte, checking the codes' range."""
    where = f"{source}: tensor {name!r}"
    if name not in tensors:
        raise SafetensorsError(f"{where}: the metadata gives its type {kind!r} but no such tensor")
    if kind not in WIDENED:
        raise SafetensorsError(
            f"{where}: metadata type {kind!r} is not one of {', '.join(WIDENED)}"
        )
    np_dtype, code = WIDENED[kind]
    stored = tensors[name]
    if stored.dtype != DTYPES[code]:
        raise SafetensorsError(f"{where}: a {kind} tensor must be stored as {code}")
    info = ml_dtypes.iinfo(np_dtype)
    if stored.size and (stored.min() < int(info.min) or stored.max() > int(info.max)):
        raise SafetensorsError(
            f"{where}: {kind} codes must lie in [{int(info.min)}, {int(info.max)}], found "
            f"[{int(stored.min())}, {int(stored.max())}]"
        )
    return stored.astype(np_dtype)


def save_file(
    tensors: Mapping[str, np.ndarray],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> str:
    """Write ``tensors`` to ``path`` atomically; return the SHA-256 (hex) of the bytes written.

    Raises:
        SafetensorsError: see :func:`serialize`; or the file cannot be written.
    """
    from quark_onnx.model_files.files import atomic_write_bytes

    data = serialize(tensors, metadata)
    try:
        atomic_write_bytes(path, data)
    except OSError as exc:
        raise SafetensorsError(
            f"{path}: cannot write ({exc.strerror or exc}); check the folder and free space"
        ) from exc
    return hashlib.sha256(data).hexdigest()


def _declared_size(p: Path) -> int:
    """The size the header of ``p`` declares (8 + header + tensor data), read before the data.

    Only the header is read: a file that is not a regular file, or whose size differs from what
    its header declares (a link to some huge file, a truncated file), is refused before its data
    is read into memory.
    """
    from quark_onnx.model_files.files import read_regular_file

    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise SafetensorsError(f"{p}: cannot be read ({exc.strerror or exc})") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            read_regular_file(p, limit=0, what="safetensors file", error=SafetensorsError)
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            return info.st_size  # deserialize names the short file
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or 8 + length > info.st_size:
            return info.st_size  # deserialize names the bad header length
        head = os.pread(fd, length, 8)
    except OSError as exc:
        raise SafetensorsError(f"{p}: cannot be read ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
    try:
        header = json.loads(head.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        # the full parse names the problem; never read more than the header for it
        deserialize(prefix + head, str(p))
        return info.st_size
    ends = [
        e["data_offsets"][1]
        for k, e in header.items()
        if k != _METADATA
        and isinstance(e, dict)
        and isinstance(e.get("data_offsets"), list)
        and len(e["data_offsets"]) == 2
        and isinstance(e["data_offsets"][1], int)
    ]
    declared = 8 + length + max(ends, default=0)
    if declared != info.st_size:
        raise SafetensorsError(
            f"{p}: the header declares {declared} bytes but the file holds {info.st_size}; "
            "the file is truncated, padded or not the parameter file that was written"
        )
    return declared


def load_file(
    path: str | os.PathLike, *, sha256: str | None = None
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read and validate ``path``: (name -> array, metadata).

    Args:
        sha256: when given, the file's SHA-256 (hex) must equal it (checked before parsing).

    Raises:
        SafetensorsError: missing/unreadable file, digest mismatch, or any check of
            :func:`deserialize`.
    """
    from quark_onnx.model_files.files import read_regular_file

    p = Path(path)
    size = _declared_size(p)
    data = read_regular_file(p, limit=size, what="safetensors file", error=SafetensorsError)
    if sha256 is not None:
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha256:
            raise SafetensorsError(
                f"{p}: SHA-256 {digest} does not match the recorded {sha256}; the file was "
                "changed or replaced after it was written: restore the original or write it again"
            )
    return deserialize(data, str(p))
