""".npz / .npy calibration files, read lazily within a memory bound: a file declaring more than
half the available memory is refused from its header, before anything is allocated, and only
the first ``limit`` samples of an array are read."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from quark_onnx.errors import CalibrationError
from quark_onnx.model_files.files import check_regular_file


def max_array_bytes() -> int:
    """The most bytes one calibration array may take in memory: half the memory available now
    (a file declaring more is refused from its header, before anything is allocated)."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        available = 8 << 30
    return max(available // 2, 64 << 20)


_NPY_MAGIC = b"\x93NUMPY"


def _regular(p: Path) -> None:
    """Refuse anything but a regular file before opening it (a FIFO would block, a device never
    ends)."""
    check_regular_file(p, what=".npz/.npy calibration file", error=CalibrationError)


def npz_keys(path: str | os.PathLike) -> list[str] | None:
    """The array names of a ``.npz`` archive; None for a ``.npy`` file.

    Raises:
        CalibrationError: not a regular file, empty, truncated, or neither format.
    """
    p = Path(path)
    _regular(p)
    try:
        with open(p, "rb") as f:
            magic = f.read(len(_NPY_MAGIC))
        if magic == _NPY_MAGIC:
            return None
        with zipfile.ZipFile(p) as archive:
            return [n[: -len(".npy")] for n in archive.namelist() if n.endswith(".npy")]
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as exc:
        size = p.stat().st_size if p.exists() else 0
        what = "the file is empty" if size == 0 else f"{type(exc).__name__}: {exc}"
        raise CalibrationError(
            f"{p}: not a readable .npz/.npy file ({what}); save it with numpy.savez or numpy.save"
        ) from exc


def _read_header(f: Any, source: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    from numpy.lib import format as npy

    try:
        version = npy.read_magic(f)
        if version == (1, 0):
            return npy.read_array_header_1_0(f)
        return npy.read_array_header_2_0(f)
    except (ValueError, OSError, EOFError) as exc:
        raise CalibrationError(
            f"{source}: not a valid .npy array header ({exc}); the file is corrupt or truncated"
        ) from exc


def _checked_shape(
    shape: tuple[int, ...], dtype: np.dtype, source: str, limit: int | None
) -> tuple[int, int]:
    """(rows to read, bytes per row) after checking the header's claims against the bound."""
    if dtype.hasobject:
        raise CalibrationError(
            f"{source} holds Python objects (it would need pickle, which quark_onnx never "
            "loads); save plain numeric arrays"
        )
    if len(shape) == 0:
        raise CalibrationError(
            f"{source} is a 0-d array (a single number); calibration arrays hold samples on "
            "axis 0: save shape (N, ...)"
        )
    if any(d < 0 for d in shape):
        raise CalibrationError(
            f"{source} declares shape {list(shape)} with a negative dimension; the file is "
            "corrupt: save it again with numpy.save"
        )
    row = dtype.itemsize
    for d in shape[1:]:
        row *= d
    rows = shape[0] if limit is None else min(shape[0], max(limit, 0))
    bound = max_array_bytes()
    if rows * row > bound:
        raise CalibrationError(
            f"{source} declares shape {list(shape)} {dtype} ({shape[0] * row} bytes); reading "
            f"{rows} samples needs {rows * row} bytes, above the {bound}-byte bound (half the "
            "available memory): use fewer samples with --calib-limit N (CalibDataSize) or a "
            "smaller file"
        )
    return rows, row


def load_array(path: str | os.PathLike, key: str | None, limit: int | None = None) -> np.ndarray:
    """The first ``limit`` samples (all when None) of array ``key`` of a ``.npz`` (``key`` None:
    a ``.npy`` file), allocating only those.

    The array header (shape and type) is read first and checked against the bytes the member
    holds and against :func:`max_array_bytes`; only then are the rows that are needed read (a
    ``.npy`` is memory-mapped: rows are read when used). Fortran-ordered arrays are read whole
    (their first rows are not contiguous), within the same bound.

    Raises:
        CalibrationError: naming the file and array: unreadable, truncated, 0-d, object arrays,
            or a declared size above the bound.
    """
    p = Path(path)
    _regular(p)
    if key is None:
        source = str(p)
        try:
            with open(p, "rb") as f:
                shape, fortran, dtype = _read_header(f, source)
                offset = f.tell()
            rows, row = _checked_shape(shape, dtype, source, limit)
            total = int(np.prod(shape, dtype=object)) * dtype.itemsize
            if offset + total > p.stat().st_size:
                raise CalibrationError(
                    f"{source}: its header declares {total} bytes of data but the file holds "
                    f"{p.stat().st_size - offset}; the file is truncated"
                )
            array = np.load(p, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise CalibrationError(f"{source}: not a readable .npy file ({exc})") from exc
        return array[:rows]
    source = f"{p}: array {key!r}"
    try:
        with zipfile.ZipFile(p) as archive:
            info = archive.getinfo(f"{key}.npy")
            with archive.open(info) as f:
                shape, fortran, dtype = _read_header(f, source)
                header = f.tell()
                rows, row = _checked_shape(shape, dtype, source, limit)
                total = int(np.prod(shape, dtype=object)) * dtype.itemsize
                if header + total != info.file_size:
                    raise CalibrationError(
                        f"{source}: its header declares {total} bytes of data but the archive "
                        f"member holds {info.file_size - header}; the file is corrupt"
                    )
                if fortran and rows < shape[0]:
                    rows, row = _checked_shape(shape, dtype, source, None)
                want = rows * row
                data = f.read(want)
    except CalibrationError:
        raise
    except (OSError, KeyError, zipfile.BadZipFile, ValueError, EOFError) as exc:
        raise CalibrationError(
            f"{source}: cannot be read ({type(exc).__name__}: {exc}); the file is corrupt or "
            "truncated"
        ) from exc
    if len(data) != want:
        raise CalibrationError(f"{source}: the archive ends early; the file is truncated")
    if fortran:
        array = np.frombuffer(data, dtype=dtype).reshape(shape[::-1]).T
        return array[:limit] if limit is not None else array
    return np.frombuffer(data, dtype=dtype).reshape((rows, *shape[1:]))
