"""Calibration data from a folder of JPEG/PNG images, pre-processed by an ONNX graph.

No Pillow or OpenCV: each file is checked (:mod:`~quark_onnx.calibration.image_check`), then
decoded, resized, cropped or padded, normalised and laid out by a small ONNX graph
(:mod:`~quark_onnx.calibration.image_graph`) built from a :class:`PreprocessSpec`
(:mod:`~quark_onnx.calibration.image_spec`).

When the model's input does not match the spec, the reader's error proposes specs that produce
its shape (:func:`propose_specs`).

Undecodable files: :class:`ImageFolderDataReader` raises :class:`CalibrationError` naming the file
by default (a calibration set silently missing images changes the result); with
``skip_undecodable=True`` it logs a warning per file and continues.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from quark_onnx.calibration.image_check import check_encoded_image
from quark_onnx.calibration.image_graph import (
    INPUT_NAME,
    OUTPUT_NAME,
    build_preprocess_graph,
    make_preprocess_session,
)
from quark_onnx.calibration.image_spec import PreprocessSpec, _fmt_sides
from quark_onnx.config.options import did_you_mean
from quark_onnx.errors import CalibrationError
from quark_onnx.model_files.files import read_regular_file
from quark_onnx.model_files.load import read_proto

#: Largest image file read (a 100-megapixel PNG is far below; a FIFO or a disk image is not).
MAX_IMAGE_FILE_BYTES = 256 << 20

logger = logging.getLogger(__name__)


def list_image_files(
    folder: str | os.PathLike,
    extensions: Iterable[str] = (".jpg", ".jpeg", ".png"),
    *,
    recursive: bool = True,
) -> list[Path]:
    """Image files under ``folder`` (extension matched case-insensitively), sorted by relative
    path so that every run sees the same order. Hidden files and folders are skipped."""
    root = Path(folder)
    wanted = {e.lower() if e.startswith(".") else "." + e.lower() for e in extensions}
    candidates = root.rglob("*") if recursive else root.iterdir()
    found = []
    real_root = root.resolve()
    for path in candidates:
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if path.suffix.lower() in wanted and path.is_file():
            target = path.resolve()
            if real_root not in target.parents:  # a link out of the folder: never read
                logger.warning(
                    "%s: skipped, a symbolic link to %s outside the folder %s", path, target, root
                )
                continue
            found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


class ImageFolderDataReader:
    """Calibration data reader over the images of a folder (onnxruntime's reader protocol).

    ``get_next()`` returns ``{input_name: float32 array}`` for the next image (batch 1) or
    ``None`` after the last; ``rewind()`` starts again. Files are those of
    :func:`list_image_files`, in sorted order, at most ``limit`` of them.

    The model's input is checked when the reader is built: it must be float32, of rank 4, and
    its static dimensions must agree with what ``spec`` produces (batch 1, 3 channels in the
    position given by ``spec.layout``, ``crop x crop`` pixels). When the spec leaves the size to
    the image (no crop), each image is checked against the model as it is produced.

    Args:
        folder: folder of images (searched recursively when ``recursive``).
        model: the float model (``ModelProto`` or path), read only for its input.
        spec: the pre-processing.
        input_name: the model input to feed; may be omitted when the model has one input.
        limit: use at most this many files (the first in sorted order).
        extensions: file name endings to use (case-insensitive).
        skip_undecodable: log a warning and skip a file that cannot be decoded, instead of
            raising :class:`CalibrationError` (the default).
        recursive: also take images from sub-folders.

    Raises:
        CalibrationError: no images found; the model input is missing, not float32, or its shape
            does not match the spec; (from ``get_next``) a file cannot be decoded or produces a
            shape the model does not accept.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        model: onnx.ModelProto | str | os.PathLike,
        spec: PreprocessSpec,
        *,
        input_name: str | None = None,
        limit: int | None = None,
        extensions: Iterable[str] = (".jpg", ".jpeg", ".png"),
        skip_undecodable: bool = False,
        recursive: bool = True,
    ) -> None:
        self.folder = Path(folder)
        self.spec = spec
        self.skip_undecodable = skip_undecodable
        if not self.folder.is_dir():
            raise CalibrationError(f"{self.folder}: calibration image folder does not exist")
        if limit is not None and limit < 1:
            raise CalibrationError(f"limit={limit}: expected a positive number of images")
        exts = tuple(extensions)
        files = list_image_files(self.folder, exts, recursive=recursive)
        if not files:
            raise CalibrationError(
                f"{self.folder}: no image files with extensions {', '.join(exts)} found"
            )
        self.files: list[Path] = files[:limit] if limit else files
        self.input_name, self._model_dims = _model_input(model, input_name)
        self._check_static_shape()
        self._session = None
        self._next = 0
        self.seconds = 0.0  # time spent reading and pre-processing, for reports
        self.images_done = 0

    def __len__(self) -> int:
        return len(self.files)

    def rewind(self) -> None:
        self._next = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        while self._next < len(self.files):
            path = self.files[self._next]
            self._next += 1
            try:
                array = self._load(path)
            except CalibrationError as exc:
                if not self.skip_undecodable:
                    raise
                logger.warning("skipping %s", exc)
                continue
            return {self.input_name: array}
        return None

    def __iter__(self):
        self.rewind()
        while (item := self.get_next()) is not None:
            yield item

    # --- internals ------------------------------------------------------------------------------

    def _load(self, path: Path) -> np.ndarray:
        start = time.perf_counter()
        data = read_regular_file(
            path, limit=MAX_IMAGE_FILE_BYTES, what="calibration image", error=CalibrationError
        )
        check_encoded_image(data, str(path))
        if self._session is None:
            self._session = make_preprocess_session(build_preprocess_graph(self.spec))
        try:
            (array,) = self._session.run(
                [OUTPUT_NAME], {INPUT_NAME: np.frombuffer(data, dtype=np.uint8)}
            )
        except Exception as exc:  # onnxruntime raises its own exception types
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise CalibrationError(f"{path}: cannot be decoded: {reason}") from exc
        self._check_image_shape(path, array.shape)
        self.seconds += time.perf_counter() - start
        self.images_done += 1
        return array

    def _expected(self) -> str:
        return _fmt_shape(self._model_dims)

    def _check_static_shape(self) -> None:
        produced = self.spec.output_shape()
        if len(self._model_dims) != 4:
            raise CalibrationError(
                f"model input {self.input_name!r}: expects shape {self._expected()} (rank "
                f"{len(self._model_dims)}) but the image pre-processing produces "
                f"{_fmt_shape(produced)} ({self.spec.layout}); image readers feed rank-4 inputs"
            )
        for want, got in zip(self._model_dims, produced, strict=True):
            if want is not None and got is not None and want != got:
                raise CalibrationError(
                    f"model input {self.input_name!r}: expects shape {self._expected()} but the "
                    f"image pre-processing produces {_fmt_shape(produced)} "
                    f"(--preprocess {self.spec.to_string()!r}); "
                    + _proposal_text(self._model_dims, self.spec)
                )

    def _check_image_shape(self, path: Path, shape: tuple[int, ...]) -> None:
        for want, got in zip(self._model_dims, shape, strict=True):
            if want is not None and want != got:
                crop = self.spec.crop_hw
                why = f" (is the image smaller than the crop {_fmt_sides(crop)}?)" if crop else ""
                raise CalibrationError(
                    f"{path}: pre-processing produced shape {_fmt_shape(shape)} but model input "
                    f"{self.input_name!r} expects {self._expected()}{why}; "
                    + _proposal_text(self._model_dims, self.spec)
                )


def propose_specs(dims: Sequence[int | None], spec: PreprocessSpec) -> list[PreprocessSpec]:
    """Specs that keep ``spec``'s normalisation and produce a shape ``dims`` accepts.

    The first fits the usual case for the input's shape (a square input: resize and centre crop as
    ``spec`` does, scaled; a non-square one: cover and centre-crop, as classifiers and segmenters
    are fed), the others are the letterbox (detectors) and the keep-ratio variants. Empty when
    ``dims`` is not an image input (rank 4 with 1 or 3 channels).
    """
    if len(dims) != 4:
        return []
    if dims[1] in (1, 3) and dims[3] not in (1, 3):
        layout, channels, height, width = "NCHW", dims[1], dims[2], dims[3]
    elif dims[3] in (1, 3):
        layout, channels, height, width = "NHWC", dims[3], dims[1], dims[2]
    elif dims[1] is None:
        layout, channels, height, width = "NCHW", 3, dims[2], dims[3]
    else:
        return []
    grey = channels == 1 or (channels is None and spec.grayscale)
    mean, std = spec.mean, spec.std
    if grey:  # one channel: the mean of the per-channel values
        mean, std = (sum(mean) / 3,) * 3, (sum(std) / 3,) * 3
    base = dataclasses.replace(
        spec, resize=0, crop=0, size=(), pad=0.0, align="", multiple=0, layout=layout,
        grayscale=grey, mean=mean, std=std,
    )  # fmt: skip
    found: list[PreprocessSpec] = []
    if height and width:
        if height == width:
            # the classic 256 -> 224 ratio (or the spec's own) scaled to this side
            ratio = 256 / 224
            if spec.mode is None and spec.resize and spec.crop_hw:
                ratio = spec.resize / spec.crop_hw[0]
            found.append(dataclasses.replace(base, resize=round(height * ratio), crop=height))
        else:
            found.append(dataclasses.replace(base, resize="short", size=(height, width)))
        found.append(dataclasses.replace(base, resize="fit", size=(height, width), pad=0.0))
        found.append(dataclasses.replace(base, resize="stretch", size=(height, width)))
    elif height:
        found.append(dataclasses.replace(base, resize="height", size=(height,)))
    elif width is None:
        found.append(dataclasses.replace(base, resize="long", size=(960,), multiple=32))
    return found


def _proposal_text(dims: Sequence[int | None], spec: PreprocessSpec) -> str:
    specs = propose_specs(dims, spec)
    if not specs:
        return "feed this input with a data reader of your own (.npz)"
    first, *others = (f"{s.to_string()!r}" for s in specs)
    text = f"a spec that fits: --preprocess {first}"
    if others:
        text += f" (or: {'; '.join(others)})"
    return text


def _fmt_shape(dims: Sequence[int | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _model_input(
    model: onnx.ModelProto | str | os.PathLike, input_name: str | None
) -> tuple[str, tuple[int | None, ...]]:
    """Name and static dims (None where symbolic) of the float32 model input to feed."""
    if isinstance(model, onnx.ModelProto):
        proto, label = model, model.graph.name or "model"
    else:
        label = str(model)
        proto = read_proto(model)
    initializers = {t.name for t in proto.graph.initializer}
    inputs = [v for v in proto.graph.input if v.name not in initializers]
    names = [v.name for v in inputs]
    if input_name is None:
        if len(inputs) != 1:
            raise CalibrationError(
                f"{label}: has {len(inputs)} inputs ({', '.join(names)}); pass input_name= to "
                "say which one the images feed"
            )
        value = inputs[0]
    else:
        matches = [v for v in inputs if v.name == input_name]
        if not matches:
            hint = did_you_mean(input_name, names)
            raise CalibrationError(
                f"{label}: has no input {input_name!r}{hint} (inputs: {', '.join(names)})"
            )
        value = matches[0]
    ttype = value.type.tensor_type
    if ttype.elem_type != TensorProto.FLOAT:
        dtype = TensorProto.DataType.Name(ttype.elem_type) if ttype.elem_type else "not a tensor"
        raise CalibrationError(
            f"{label}: input {value.name!r} is {dtype}; image pre-processing produces float32 "
            "(feed other types with a reader of your own)"
        )
    if not ttype.HasField("shape"):
        raise CalibrationError(
            f"{label}: input {value.name!r} has no shape; image readers need a rank-4 input"
        )
    dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in ttype.shape.dim)
    return value.name, dims


__all__ = [
    "ImageFolderDataReader",
    "PreprocessSpec",
    "list_image_files",
    "propose_specs",
]
