"""The output-path guard every writer calls before any work (:func:`check_output_path`).

An output never replaces an input (the model, its external data, calibration data, a recipe...)
by any spelling, never replaces a device, FIFO or folder, and its folder is probed for writing
first, so a refused output costs nothing.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Collection
from pathlib import Path

from quark_onnx.errors import ModelSaveError
from quark_onnx.model_files.external import _external_info, _external_tensors
from quark_onnx.model_files.files import (
    _PARTIAL_SUFFIX,
    check_path_text,
    remove_stale_partials,
    temp_file_beside,
    temp_file_done,
)
from quark_onnx.model_files.load import read_proto


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
        proto = read_proto(input_path)
    except Exception:  # an unreadable input adds no data file; loading it reports why
        return files
    for tensor in _external_tensors(proto):
        location = _external_info(tensor).get("location", "")
        if location and not os.path.isabs(location) and "\0" not in location:
            path = input_path.parent / location
            if path not in files:
                files.append(path)
    return files


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
      any of the input model's external data files or any of ``inputs`` (calibration data, a
      saved calibration result, a recipe...), whatever ``overwrite`` says: overwriting replaces
      an earlier *output*, never an input;
    * with ``external_data``, the data file ``<output>.data`` a model is written with being one of
      those input files;
    * an existing output that is not a regular file (a folder, a device such as ``/dev/null``, a
      FIFO, a socket): a rename would replace the node itself;
    * a NUL character or a name above 255 bytes; a missing output folder or one that is not a
      folder (``/dev/null/x``); a folder that cannot be written (read-only mount, ``/proc``);
    * names ending in ``.partial`` (temporary names of this module).

    ``overwrite`` changes none of this (an earlier output is replaced by the writer, an input
    never); it is taken so that every writer passes its flag through the same call.

    Temporary files of ``output`` (and its data file) left by a process that no longer runs
    (``kill -9``, a power cut) are removed here, with a note in the log.
    """
    out = check_path_text(output, what, ModelSaveError)
    if out.name.endswith(_PARTIAL_SUFFIX):
        raise ModelSaveError(f"{out}: names ending in {_PARTIAL_SUFFIX} are reserved; rename it")
    protected: list[tuple[Path, str]] = []
    if input_path is not None:
        inp = Path(input_path)
        protected.append((inp, "the input model"))
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
                raise ModelSaveError(
                    f"{out}: the {label} {target} is {kind} {source}; writing it would destroy "
                    "that file (an input is never replaced, even with overwrite): choose another "
                    "output path"
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
    remove_stale_partials(out)
    if external_data:
        remove_stale_partials(data)
    return out
