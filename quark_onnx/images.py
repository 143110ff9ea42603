"""Calibration data from a folder of JPEG/PNG images, pre-processed by an ONNX graph.

No Pillow or OpenCV: each image is decoded, resized, cropped, normalised and laid out by a small
ONNX graph (:func:`build_preprocess_graph`) that onnxruntime runs with the custom operators of
onnxruntime-extensions. The graph, for one encoded image ``b`` (uint8 bytes of a ``.jpg``/``.png``
file), computes::

    x   = float32(DecodeImage(b))                        # H x W x 3 RGB, values 0..255
    x   = Resize(x, short side -> R)                     # if resize R > 0 (see below)
    x   = x[t : t + C, l : l + C, :]                     # if crop C > 0, centred
    x   = x[:, :, ::-1]                                  # if channel_order == "BGR"
    x   = (x * scale - mean) / std                       # per channel, in float32
    out = x.transpose(2, 0, 1)[None]  or  x[None]        # NCHW or NHWC, batch 1

Resize: the short side becomes ``R`` and the long side ``floor(R * long / short)`` (as
torchvision's ``Resize(int)``). Interpolation is ONNX ``Resize`` with ``mode="linear"`` and
``coordinate_transformation_mode="half_pixel"`` on float32 pixels, no antialiasing and no rounding
to uint8 in between: output pixel ``i`` samples the input at ``u = (i + 0.5) * in / out - 0.5``,
clamped to ``[0, in - 1]``, and mixes the two neighbours ``floor(u)`` and ``floor(u) + 1`` with
weights ``1 - frac(u)`` and ``frac(u)`` (separably in H and W). This is *not* PIL's antialiased
bilinear filter: when shrinking, PIL averages over a wider support, so results differ from a
torchvision pipeline on detailed images. (With ONNX's ``antialias=1`` instead, top-1 on the 100
ImageNet calibration images moved from 0.67 to 0.65 for SqueezeNet 1.1 and from 0.83 to 0.84 for
MobileNetV2: no reason to prefer it.)

Centre crop: offsets ``top = round_half_even((H - C) / 2)``, ``left = round_half_even((W - C)
/ 2)``, as torchvision's ``center_crop``. An image smaller than the crop is not padded: the reader
reports it.

Decoder: onnxruntime-extensions' ``DecodeImage`` (domain ``com.microsoft.extensions``) decodes
baseline and progressive JPEG and PNG to ``H x W x C`` uint8. It is asked for RGB
(``color_space="rgb"``); since releases differ (0.12 ignores the attribute and gives BGR),
:func:`decoder_channel_order` checks once per process what the installed one gives, and the graph
reverses the channels when needed. Greyscale images (one channel from 0.15) are expanded to three
equal channels; PNG alpha is dropped, 16-bit PNG samples are cut to 8 bits. The JPEG decoder is
IJG libjpeg 9 (not libjpeg-turbo as in Pillow): on chroma-subsampled JPEGs its pixels differ from
Pillow's by up to a few dozen grey levels at colour edges (mean about 0.1 level; measured in
tests/test_images.py).

Its JPEG path calls libjpeg's default error handler, which *terminates the process* on a
malformed file and loops forever on a truncated one (onnxruntime-extensions issue #1094).
:func:`check_encoded_image` therefore walks the marker structure of every file in Python first
and rejects what libjpeg would fail on (no end-of-image marker, bad segment lengths, unknown
markers, unsupported coding such as arithmetic or lossless JPEG, 12-bit or CMYK images,
inconsistent Huffman or quantization tables); a file that passes reaches the decoder, which reports
remaining PNG errors as ordinary exceptions.

Undecodable files: :class:`ImageFolderDataReader` raises :class:`CalibrationError` naming the file
by default (a calibration set silently missing images changes the result); with
``skip_undecodable=True`` it logs a warning per file and continues.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import struct
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from quark_onnx.errors import CalibrationError, ConfigError, ModelLoadError
from quark_onnx.options import closest_name

logger = logging.getLogger(__name__)

#: Domain of onnxruntime-extensions' operators.
EXTENSIONS_DOMAIN = "com.microsoft.extensions"
#: Opset of the pre-processing graph (Resize with ``antialias`` and ``axes`` needs 18).
PREPROCESS_OPSET = 18
#: Name of the pre-processing graph's input (1-D uint8: the bytes of one encoded image).
INPUT_NAME = "image_bytes"
#: Name of the pre-processing graph's output (float32, batch 1).
OUTPUT_NAME = "pixel_values"

_CHANNEL_ORDERS = ("RGB", "BGR")
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_LAYOUTS = ("NCHW", "NHWC")


# ------------------------------------------------------------------------------------------------
# The specification
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreprocessSpec:
    """How to turn one encoded image into one model input (see the module docstring for the maths).

    Attributes:
        resize: length of the short side after resizing (0: no resize).
        crop: size of the square centre crop (0: no crop). Must be <= ``resize`` when both are set.
        mean: subtracted per channel after ``scale``, in the order of ``channel_order``.
        std: divides per channel after the mean, in the order of ``channel_order``; non-zero.
        scale: multiplies the 0..255 pixel values first (e.g. ``1/255``); non-zero.
        channel_order: ``"RGB"`` or ``"BGR"``: the order of the channel axis of the output.
        layout: ``"NCHW"`` or ``"NHWC"``.
    """

    resize: int = 256
    crop: int = 224
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    scale: float = 1.0
    channel_order: str = "RGB"
    layout: str = "NCHW"

    def __post_init__(self) -> None:
        for name in ("resize", "crop"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ConfigError(
                    f"preprocess {name}={value!r}: expected a non-negative integer (0 = off)"
                )
            object.__setattr__(self, name, int(value))
        if self.resize and self.crop and self.crop > self.resize:
            raise ConfigError(
                f"preprocess crop={self.crop} is larger than resize={self.resize}: the short side "
                "after resizing must hold the crop; raise resize or lower crop"
            )
        object.__setattr__(self, "mean", _three_floats("mean", self.mean))
        object.__setattr__(self, "std", _three_floats("std", self.std))
        if any(s == 0.0 for s in self.std):
            raise ConfigError(f"preprocess std={self.std}: every value must be non-zero")
        if not isinstance(self.scale, (int, float, np.floating)) or isinstance(self.scale, bool):
            raise ConfigError(f"preprocess scale={self.scale!r}: expected a number")
        if not math.isfinite(float(self.scale)) or float(self.scale) == 0.0:
            raise ConfigError(f"preprocess scale={self.scale!r}: expected a finite non-zero number")
        object.__setattr__(self, "scale", float(self.scale))
        object.__setattr__(
            self, "channel_order", _choice("channel_order", self.channel_order, _CHANNEL_ORDERS)
        )
        object.__setattr__(self, "layout", _choice("layout", self.layout, _LAYOUTS))

    # The keys of the CLI spec string; "order" is the short form of "channel_order".
    _KEYS = ("resize", "crop", "mean", "std", "scale", "order", "channel_order", "layout")

    @classmethod
    def parse(cls, text: str) -> PreprocessSpec:
        """Read a spec string such as ``"resize=256,crop=224,mean=104;117;123,order=BGR"``.

        Items are ``key=value`` separated by commas; keys are those of the dataclass (``order`` is
        accepted for ``channel_order``); omitted keys keep their defaults. ``mean`` and ``std``
        take one value (used for all channels) or three separated by ``;``. Numbers may be written
        as fractions: ``scale=1/255``.

        Raises:
            ConfigError: an unknown key (the closest valid key is named), a repeated key, an item
                without ``=``, or a value of the wrong kind.
        """
        values: dict[str, object] = {}
        for raw in text.split(","):
            item = raw.strip()
            if not item:
                continue
            key, sep, value = item.partition("=")
            key, value = key.strip().lower(), value.strip()
            if not sep or not key:
                raise ConfigError(
                    f"preprocess spec item {item!r} is not key=value (e.g. resize=256,crop=224)"
                )
            if key not in cls._KEYS:
                close = closest_name(key, cls._KEYS)
                hint = f"; did you mean {close!r}?" if close else ""
                raise ConfigError(
                    f"unknown preprocess spec key {key!r}{hint} "
                    f"(valid keys: {', '.join(cls._KEYS)})"
                )
            field_name = "channel_order" if key == "order" else key
            if field_name in values:
                raise ConfigError(f"preprocess spec key {key!r} is given twice")
            if field_name in ("resize", "crop"):
                values[field_name] = _parse_int(key, value)
            elif field_name in ("mean", "std"):
                parts = [p.strip() for p in value.split(";")]
                numbers = tuple(_parse_number(key, p) for p in parts)
                if len(numbers) == 1:
                    numbers = numbers * 3
                values[field_name] = numbers
            elif field_name == "scale":
                values[field_name] = _parse_number(key, value)
            else:
                values[field_name] = value
        return cls(**values)  # type: ignore[arg-type]

    def to_string(self) -> str:
        """The spec as a string that :meth:`parse` reads back to an equal spec."""
        return (
            f"resize={self.resize},crop={self.crop},"
            f"mean={';'.join(repr(v) for v in self.mean)},"
            f"std={';'.join(repr(v) for v in self.std)},"
            f"scale={self.scale!r},order={self.channel_order},layout={self.layout}"
        )

    def output_shape(self) -> tuple[int | None, ...]:
        """Shape of the graph's output (``None`` where it depends on the image)."""
        side = self.crop or None
        if self.layout == "NCHW":
            return (1, 3, side, side)
        return (1, side, side, 3)


def _three_floats(name: str, value: object) -> tuple[float, float, float]:
    try:
        items = tuple(float(v) for v in value)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ConfigError(f"preprocess {name}={value!r}: expected three numbers") from None
    if len(items) == 1:
        items = items * 3
    if len(items) != 3 or not all(math.isfinite(v) for v in items):
        raise ConfigError(f"preprocess {name}={value!r}: expected three finite numbers")
    return (items[0], items[1], items[2])


def _choice(name: str, value: object, allowed: Sequence[str]) -> str:
    text = str(value).strip().upper()
    if text not in allowed:
        raise ConfigError(f"preprocess {name}={value!r}: expected one of {', '.join(allowed)}")
    return text


def _parse_int(key: str, text: str) -> int:
    if not re.fullmatch(r"\+?\d+", text):
        raise ConfigError(f"preprocess spec {key}={text!r}: expected a non-negative integer")
    return int(text)


def _parse_number(key: str, text: str) -> float:
    num, slash, den = text.partition("/")
    try:
        value = float(num) / float(den) if slash else float(num)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(
            f"preprocess spec {key}={text!r}: expected a number such as 0.5 or 1/255"
        ) from None
    if not math.isfinite(value):
        raise ConfigError(f"preprocess spec {key}={text!r}: expected a finite number")
    return value


# ------------------------------------------------------------------------------------------------
# The pre-processing graph
# ------------------------------------------------------------------------------------------------


def _decode_node(output: str) -> onnx.NodeProto:
    # color_space="rgb": RGB from onnxruntime-extensions >= 0.15, which also leaves greyscale
    # JPEGs as one channel (its default "bgr" path swaps bytes of greyscale buffers in threes and
    # writes past their end). Older versions ignore the attribute and give BGR: see
    # decoder_channel_order.
    return helper.make_node(
        "DecodeImage", [INPUT_NAME], [output], name=output, domain=EXTENSIONS_DOMAIN,
        color_space="rgb",
    )  # fmt: skip


def _png_rgb(pixels: np.ndarray) -> bytes:
    """A minimal non-interlaced 8-bit RGB PNG of ``pixels`` (H x W x 3 uint8)."""
    height, width, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[row].tobytes() for row in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        _PNG_SIGNATURE
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


@functools.lru_cache(maxsize=1)
def decoder_channel_order() -> str:
    """``"RGB"`` or ``"BGR"``: what the installed ``DecodeImage`` gives for ``color_space="rgb"``.

    Found once per process by decoding a one-pixel PNG of a known colour, because releases of
    onnxruntime-extensions differ (0.12 ignores the attribute and returns BGR; 0.15 honours it).
    """
    graph = helper.make_graph(
        [_decode_node("decoded")],
        "decoder_probe",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.UINT8, ["num_bytes"])],
        [helper.make_tensor_value_info("decoded", TensorProto.UINT8, None)],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(EXTENSIONS_DOMAIN, 1)],
    )
    model.ir_version = 8
    probe = _png_rgb(np.array([[[200, 50, 10]]], dtype=np.uint8))
    (out,) = make_preprocess_session(model).run(None, {INPUT_NAME: np.frombuffer(probe, np.uint8)})
    pixel = [int(v) for v in np.asarray(out).reshape(-1)[:3]]
    if pixel == [200, 50, 10]:
        return "RGB"
    if pixel == [10, 50, 200]:
        return "BGR"
    raise CalibrationError(
        f"onnxruntime-extensions' DecodeImage decoded a (200, 50, 10) test pixel as {pixel}; "
        "this version is not supported for image calibration data"
    )


def build_preprocess_graph(
    spec: PreprocessSpec, *, decoder_order: str | None = None
) -> onnx.ModelProto:
    """The ONNX model that pre-processes one encoded image according to ``spec``.

    Input ``image_bytes``: uint8 ``[num_bytes]``, the content of a JPEG or PNG file. Output
    ``pixel_values``: float32 ``[1, 3, H, W]`` (NCHW) or ``[1, H, W, 3]`` (NHWC), with ``H = W =
    crop`` when a crop is set. Run it with onnxruntime after registering
    ``onnxruntime_extensions.get_library_path()`` on the ``SessionOptions`` (as
    :func:`make_preprocess_session` does). Operations that would be identities (scale 1, mean 0,
    std 1) are left out. A greyscale image is expanded to three equal channels.

    Args:
        decoder_order: the channel order the decoder gives (``"RGB"``/``"BGR"``); by default that
            of the installed onnxruntime-extensions (:func:`decoder_channel_order`). A graph
            built for one order gives swapped channels with a decoder of the other.
    """
    source = decoder_channel_order() if decoder_order is None else decoder_order
    source = _choice("decoder_order", source, _CHANNEL_ORDERS)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    made: set[str] = set()

    def const(name: str, values: Sequence[float] | Sequence[int], dtype: type) -> str:
        if name not in made:
            inits.append(onnx.numpy_helper.from_array(np.asarray(values, dtype=dtype), name))
            made.add(name)
        return name

    def node(op: str, inputs: list[str], output: str, **attrs: object) -> str:
        nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    nodes.append(_decode_node("decoded_u8"))
    # H x W x 1 (greyscale) or H x W x 3 -> H x W x 3
    decoded = node("Expand", ["decoded_u8", const("three_channels", [1, 1, 3], np.int64)],
                   "decoded_hwc")  # fmt: skip
    x = node("Cast", [decoded], "decoded_f32", to=TensorProto.FLOAT)

    if spec.resize:
        # sizes = floor(R * [H, W] / min(H, W)): the short side becomes exactly R.
        shape = node("Shape", [decoded], "decoded_shape")
        hw_range = [const("hw_start", [0], np.int64), const("hw_end", [2], np.int64)]
        hw = node("Slice", [shape, *hw_range], "decoded_hw")
        short = node("ReduceMin", [hw], "short_side", keepdims=1)
        scaled = node("Mul", [hw, const("resize_to", [spec.resize], np.int64)], "scaled_hw")
        new_hw = node("Div", [scaled, short], "resized_hw")
        sizes = node("Concat", [new_hw, const("channels", [3], np.int64)], "resize_sizes", axis=0)
        x = node(
            "Resize",
            [x, "", "", sizes],
            "resized",
            mode="linear",
            coordinate_transformation_mode="half_pixel",
            antialias=0,
        )

    if spec.crop:
        # top-left = round_half_even(([H, W] - C) / 2), clamped at 0 so a small image is not
        # wrapped around (the reader then reports its shape).
        shape = node("Shape", [x], "precrop_shape")
        hw_range = [const("hw_start", [0], np.int64), const("hw_end", [2], np.int64)]
        hw = node("Slice", [shape, *hw_range], "precrop_hw")
        margin = node("Sub", [hw, const("crop_size", [spec.crop], np.int64)], "crop_margin")
        margin_f = node("Cast", [margin], "crop_margin_f", to=TensorProto.FLOAT)
        half = node("Div", [margin_f, const("two", [2.0], np.float32)], "crop_half_margin")
        rounded = node("Round", [half], "crop_start_f")
        start = node("Cast", [rounded], "crop_start_raw", to=TensorProto.INT64)
        start = node("Max", [start, const("zero", [0], np.int64)], "crop_start")
        end = node("Add", [start, "crop_size"], "crop_end")
        x = node("Slice", [x, start, end, const("crop_axes", [0, 1], np.int64)], "cropped")

    if spec.channel_order != source:
        x = node("Gather", [x, const("reverse_channels", [2, 1, 0], np.int64)], "reordered", axis=2)
    if spec.scale != 1.0:
        x = node("Mul", [x, const("scale", [spec.scale], np.float32)], "scaled")
    if any(m != 0.0 for m in spec.mean):
        x = node("Sub", [x, const("mean", spec.mean, np.float32)], "centred")
    if any(s != 1.0 for s in spec.std):
        x = node("Div", [x, const("std", spec.std, np.float32)], "normalised")
    if spec.layout == "NCHW":
        x = node("Transpose", [x], "chw", perm=[2, 0, 1])
    node("Unsqueeze", [x, const("batch_axis", [0], np.int64)], OUTPUT_NAME)

    dims: list[int | str] = [
        d if d is not None else ("height" if i == (2 if spec.layout == "NCHW" else 1) else "width")
        for i, d in enumerate(spec.output_shape())
    ]
    graph = helper.make_graph(
        nodes,
        "image_preprocess",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.UINT8, ["num_bytes"])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, dims)],
        inits,
    )
    model = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", PREPROCESS_OPSET),
            helper.make_opsetid(EXTENSIONS_DOMAIN, 1),
        ],
        producer_name="quark_onnx.images",
        doc_string=f"image pre-processing: {spec.to_string()}",
    )
    model.ir_version = 8  # readable by every onnxruntime this project supports
    return model


def make_preprocess_session(model: onnx.ModelProto):  # -> onnxruntime.InferenceSession
    """An onnxruntime session for a graph using onnxruntime-extensions' operators (CPU)."""
    import onnxruntime as ort

    try:
        from onnxruntime_extensions import get_library_path
    except ImportError as exc:  # a declared dependency, but give the fix if it is missing
        raise CalibrationError(
            "image pre-processing needs onnxruntime-extensions; install it with "
            "`pip install onnxruntime-extensions`"
        ) from exc
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    options.log_severity_level = 4  # failures are raised as CalibrationError instead
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


# ------------------------------------------------------------------------------------------------
# Checking encoded files before they reach libjpeg
# ------------------------------------------------------------------------------------------------

# A marker inside entropy-coded data: 0xFF followed by a byte other than 0x00 (stuffing),
# 0xD0-0xD7 (restart markers) or 0xFF (fill).
_SCAN_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_SOF_SUPPORTED = {0xC0: "baseline", 0xC1: "extended sequential", 0xC2: "progressive"}
_SOF_UNSUPPORTED = {
    0xC3: "lossless",
    0xC5: "differential sequential",
    0xC6: "differential progressive",
    0xC7: "differential lossless",
    0xC9: "arithmetic-coded sequential",
    0xCA: "arithmetic-coded progressive",
    0xCB: "arithmetic-coded lossless",
    0xCD: "differential arithmetic sequential",
    0xCE: "differential arithmetic progressive",
    0xCF: "differential arithmetic lossless",
}
# Segments libjpeg skips: APP0-15, COM, DNL.
_SKIPPED_SEGMENTS = {*range(0xE0, 0xF0), 0xFE, 0xDC}
_MAX_SIDE = 65500  # libjpeg's JPEG_MAX_DIMENSION
_MAX_PIXELS = 100 * 1024 * 1024  # the decoder's limit in current onnxruntime-extensions


class _Bad(Exception):
    """Internal: why an encoded image is rejected."""


def check_encoded_image(data: bytes, name: str = "image") -> str:
    """Return ``"jpeg"`` or ``"png"`` when the decoder can safely be given ``data``.

    JPEG files are walked marker by marker (the entropy-coded data is only scanned for the next
    marker) following libjpeg-turbo's reader, and rejected where libjpeg would stop with a fatal
    error (which exits the process) or wait for more data (which never ends):

    * no end-of-image marker (truncated file), a segment longer than the bytes left, a second
      start-of-image marker, an unknown marker, a scan before the frame header;
    * lossless, arithmetic-coded or hierarchical JPEG; precision other than 8 bits; a component
      count other than 1 or 3 (CMYK is not decoded); zero or too large dimensions; sampling
      factors outside 1..4 or not integral ratios of the largest; more than 10 blocks per MCU;
    * a bad DQT/DHT/DAC/DRI/SOS segment (index, length, values), a scan using a quantization or
      Huffman table that is undefined or whose code lengths over-fill the code space (DC symbols
      above 15 included; tables 0 and 1 default to libjpeg's standard tables), bad progressive
      scan parameters.

    Entropy-coded data itself is not decoded: libjpeg recovers from corrupt data with warnings
    and grey blocks, so a damaged but well-formed file still decodes. PNG files are checked for
    the signature and a non-interlaced ``IHDR`` (the decoder reads rows without de-interlacing);
    libpng reports other PNG errors itself.

    Raises:
        CalibrationError: naming ``name`` and the reason.
    """
    try:
        if data.startswith(_PNG_SIGNATURE):
            _check_png(data)
            return "png"
        if data.startswith(b"\xff\xd8"):
            _check_jpeg(data)
            return "jpeg"
        raise _Bad("neither a JPEG (no FF D8 start marker) nor a PNG (no PNG signature)")
    except _Bad as exc:
        raise CalibrationError(f"{name}: cannot be decoded: {exc}") from None


def _check_png(data: bytes) -> None:
    if len(data) < 33 or data[12:16] != b"IHDR":
        raise _Bad("PNG without a complete IHDR header (truncated?)")
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    if width == 0 or height == 0 or width * height > _MAX_PIXELS:
        raise _Bad(f"PNG of {width}x{height} pixels (1 to {_MAX_PIXELS} pixels supported)")
    if data[28] != 0:
        raise _Bad("interlaced (Adam7) PNG is not supported by the decoder; save it non-interlaced")


@dataclass
class _JpegState:
    frame: dict[int, tuple[int, int, int]] | None = None  # component id -> (h, v, quant table)
    progressive: bool = False
    quant: set[int] = field(default_factory=set)
    # (class, id) -> table usable; DC/AC tables 0 and 1 start as libjpeg's standard tables.
    huff: dict[tuple[int, int], bool] = field(
        default_factory=lambda: {(k, i): True for k in (0, 1) for i in (0, 1)}
    )
    scans: int = 0


def _check_jpeg(data: bytes) -> None:
    n = len(data)
    pos = 2
    state = _JpegState()
    while True:
        # Next marker; libjpeg skips stray bytes before a marker with a warning, so do we.
        ff = data.find(b"\xff", pos)
        if ff < 0:
            raise _Bad("truncated JPEG: no end-of-image marker (FF D9)")
        pos = ff
        while pos < n and data[pos] == 0xFF:
            pos += 1
        if pos >= n:
            raise _Bad("truncated JPEG: no end-of-image marker (FF D9)")
        marker = data[pos]
        at = pos - 1
        pos += 1
        if marker == 0xD9:
            if state.frame is None or not state.scans:
                raise _Bad("JPEG ends before any image data (no frame or no scan)")
            return
        if marker == 0x00 or 0xD0 <= marker <= 0xD7 or marker == 0x01:
            continue  # stuffed byte, restart marker or TEM outside a scan: libjpeg ignores these
        if marker == 0xD8:
            raise _Bad("invalid JPEG structure: a second start-of-image marker (FF D8)")
        if marker in _SOF_UNSUPPORTED:
            raise _Bad(f"{_SOF_UNSUPPORTED[marker]} JPEG (SOF FF {marker:02X}) is not supported")
        known = (*_SOF_SUPPORTED, 0xC4, 0xCC, 0xDA, 0xDB, 0xDD)
        if marker not in known and marker not in _SKIPPED_SEGMENTS:
            raise _Bad(f"corrupt JPEG: unknown marker FF {marker:02X} at byte {at}")
        if pos + 2 > n:
            raise _Bad(f"truncated JPEG: marker FF {marker:02X} at byte {at} has no length")
        length = int.from_bytes(data[pos : pos + 2], "big")
        if length < 2 or pos + length > n:
            raise _Bad(
                f"truncated or corrupt JPEG: segment FF {marker:02X} at byte {at} has length "
                f"{length} but {n - pos} bytes remain"
            )
        seg = data[pos + 2 : pos + length]
        pos += length
        if marker in _SOF_SUPPORTED:
            if state.frame is not None:
                raise _Bad("JPEG with more than one frame (SOF marker)")
            state.frame = _read_sof(seg)
            state.progressive = marker == 0xC2
        elif marker == 0xC4:
            _read_dht(seg, state)
        elif marker == 0xDB:
            _read_dqt(seg, state)
        elif marker == 0xCC:
            _read_dac(seg)
        elif marker == 0xDD:
            if len(seg) != 2:
                raise _Bad("corrupt JPEG: restart interval segment of the wrong length")
        elif marker == 0xDA:
            _read_sos(seg, state)
            state.scans += 1
            found = _SCAN_MARKER.search(data, pos)
            if found is None:
                raise _Bad("truncated JPEG: image data runs to the end without an FF D9 marker")
            pos = found.start()


def _read_sof(seg: bytes) -> dict[int, tuple[int, int, int]]:
    if len(seg) < 6:
        raise _Bad("corrupt JPEG: frame header too short")
    precision = seg[0]
    height = int.from_bytes(seg[1:3], "big")
    width = int.from_bytes(seg[3:5], "big")
    count = seg[5]
    if len(seg) != 6 + 3 * count:
        raise _Bad("corrupt JPEG: frame header length does not match its component count")
    if precision != 8:
        raise _Bad(f"{precision}-bit JPEG is not supported (8-bit only)")
    if count not in (1, 3):
        kind = "CMYK/YCCK" if count == 4 else f"{count}-component"
        raise _Bad(f"{kind} JPEG is not supported (greyscale or 3-component colour only)")
    if not (0 < width <= _MAX_SIDE and 0 < height <= _MAX_SIDE) or width * height > _MAX_PIXELS:
        raise _Bad(f"JPEG of {width}x{height} pixels (sides 1..{_MAX_SIDE}, <= 100 Mpixel)")
    comps: dict[int, tuple[int, int, int]] = {}
    for i in range(count):
        cid, sampling, table = seg[6 + 3 * i : 9 + 3 * i]
        h, v = sampling >> 4, sampling & 15
        if not (1 <= h <= 4 and 1 <= v <= 4):
            raise _Bad("corrupt JPEG: sampling factors outside 1..4")
        comps[cid] = (h, v, table)
    max_h = max(h for h, _, _ in comps.values())
    max_v = max(v for _, v, _ in comps.values())
    if any(max_h % h or max_v % v for h, v, _ in comps.values()):
        raise _Bad("JPEG with fractional chroma sampling ratios is not supported")
    return comps


def _read_dht(seg: bytes, state: _JpegState) -> None:
    pos = 0
    while len(seg) - pos > 16:
        index = seg[pos]
        counts = seg[pos + 1 : pos + 17]
        total = sum(counts)
        if total > 256 or total > len(seg) - pos - 17:
            raise _Bad("corrupt JPEG: bad Huffman table definition")
        klass, ident = (1, index - 0x10) if index & 0x10 else (0, index)
        if not 0 <= ident <= 3:
            raise _Bad(f"corrupt JPEG: Huffman table index {index:#04x} out of range")
        symbols = seg[pos + 17 : pos + 17 + total]
        # libjpeg checks a table when a scan uses it: canonical codes must fit their lengths.
        valid, code = True, 0
        for bits, count in enumerate(counts, start=1):
            code += count
            if count and code >= (1 << bits):
                valid = False
            code <<= 1
        if klass == 0 and any(s > 15 for s in symbols):
            valid = False
        state.huff[(klass, ident)] = valid
        pos += 17 + total
    if pos != len(seg):
        raise _Bad("corrupt JPEG: Huffman table segment of the wrong length")


def _read_dqt(seg: bytes, state: _JpegState) -> None:
    pos = 0
    while pos < len(seg):
        precision, ident = seg[pos] >> 4, seg[pos] & 15
        pos += 1
        if ident > 3:
            raise _Bad(f"corrupt JPEG: quantization table index {ident} out of range")
        size = 2 if precision else 1  # libjpeg-turbo reads any non-zero precision as 16-bit
        state.quant.add(ident)
        pos += min(64, (len(seg) - pos) // size) * size  # and accepts a short last table


def _read_dac(seg: bytes) -> None:
    if len(seg) % 2:
        raise _Bad("corrupt JPEG: arithmetic-coding table segment of the wrong length")
    for index, value in zip(seg[0::2], seg[1::2], strict=True):
        if (
            index >= 32
            or (index >= 16 and not 1 <= value <= 63)
            or (index < 16 and (value & 15) > (value >> 4))
        ):
            raise _Bad("corrupt JPEG: bad arithmetic-coding table")


def _read_sos(seg: bytes, state: _JpegState) -> None:
    frame, huff, quant = state.frame, state.huff, state.quant
    if frame is None:
        raise _Bad("corrupt JPEG: a scan (SOS) before the frame header (SOF)")
    count = seg[0] if seg else 0
    if not 1 <= count <= 4 or len(seg) != 4 + 2 * count:
        raise _Bad("corrupt JPEG: bad scan header")
    ss, se = seg[1 + 2 * count], seg[2 + 2 * count]
    ah, al = seg[3 + 2 * count] >> 4, seg[3 + 2 * count] & 15
    ids = [seg[1 + 2 * i] for i in range(count)]
    if len(set(ids)) != count or any(c not in frame for c in ids):
        raise _Bad("corrupt JPEG: a scan names a component the frame does not have (or twice)")
    if count > 1 and sum(frame[c][0] * frame[c][1] for c in ids) > 10:
        raise _Bad("JPEG sampling factors too large (more than 10 blocks per MCU)")
    dc_band = ss == 0
    for i, cid in enumerate(ids):
        if frame[cid][2] not in quant:
            raise _Bad(f"corrupt JPEG: quantization table {frame[cid][2]} is used but not defined")
        tables = seg[2 + 2 * i]
        needed = []
        if not state.progressive or (dc_band and ah == 0):
            needed.append((0, tables >> 4))
        if not state.progressive or not dc_band:
            needed.append((1, tables & 15))
        for key in needed:
            if not huff.get(key, False):
                raise _Bad(
                    f"corrupt JPEG: a scan uses {'AC' if key[0] else 'DC'} Huffman table "
                    f"{key[1]}, which is undefined or invalid"
                )
    if state.progressive:
        bad = se != 0 if dc_band else (ss > se or se > 63 or count != 1)
        if bad or (ah != 0 and al != ah - 1) or al > 13:
            raise _Bad("corrupt JPEG: bad progressive scan parameters")


# ------------------------------------------------------------------------------------------------
# The data reader
# ------------------------------------------------------------------------------------------------


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
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CalibrationError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
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
                    f"image pre-processing produces {_fmt_shape(produced)} ({self.spec.layout}, "
                    f"crop={self.spec.crop}); change the spec's crop/layout to match the model"
                )

    def _check_image_shape(self, path: Path, shape: tuple[int, ...]) -> None:
        for want, got in zip(self._model_dims, shape, strict=True):
            if want is not None and want != got:
                raise CalibrationError(
                    f"{path}: pre-processing produced shape {_fmt_shape(shape)} but model input "
                    f"{self.input_name!r} expects {self._expected()} (is the image smaller than "
                    f"the crop {self.spec.crop}?)"
                )


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
        try:
            proto = onnx.load(str(model), load_external_data=False)
        except FileNotFoundError:
            raise ModelLoadError(f"{label}: no such file") from None
        except Exception as exc:
            raise ModelLoadError(f"{label}: not a readable ONNX model ({exc})") from exc
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
            close = closest_name(input_name, names)
            hint = f"; did you mean {close!r}?" if close else ""
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
    "EXTENSIONS_DOMAIN",
    "INPUT_NAME",
    "OUTPUT_NAME",
    "ImageFolderDataReader",
    "PreprocessSpec",
    "build_preprocess_graph",
    "check_encoded_image",
    "list_image_files",
    "make_preprocess_session",
]
