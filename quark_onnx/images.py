"""Calibration data from a folder of JPEG/PNG images, pre-processed by an ONNX graph.

No Pillow or OpenCV: each image is decoded, resized, cropped or padded, normalised and laid out
by a small ONNX graph (:func:`build_preprocess_graph`) that onnxruntime runs with the custom
operators of onnxruntime-extensions. The graph, for one encoded image ``b`` (uint8 bytes of a
``.jpg``/``.png`` file), computes::

    x   = float32(DecodeImage(b))                        # H x W x 3 RGB, values 0..255
    x   = (R * 0.299 + G * 0.587) + B * 0.114            # if grayscale: H x W x 1
    x   = Resize(x, sizes(H, W))                         # if resize (see below)
    x   = x[t : t + Ch, l : l + Cw, :]                   # if crop (centred, or align=topleft)
    x   = x[:, :, ::-1]                                  # if channel_order == "BGR"
    x   = (x * scale - mean) / std                       # per channel, in float32
    x   = pad x to size with the value pad               # resize=fit, resize=height with HxW
    out = x.transpose(2, 0, 1)[None]  or  x[None]        # NCHW or NHWC, batch 1

Sizes of the resize (``size=HxW``, or ``size=N``; height first as in the model's shape; the size
arithmetic is float64 and matches the Python of the pipelines named):

=================  ==============================================================================
``resize=R``       short side ``R``, long side ``floor(R * long / short)`` (torchvision's
                   ``Resize(int)``); ``resize=short,size=R`` is the same
``resize=short``   with ``size=HxW``: ``r = max(H / h, W / w)``, sides ``max(H, round(h * r))`` and
                   ``max(W, round(w * r))``, then a crop to ``H x W`` (classifiers, segmenters)
``resize=stretch`` exactly ``H x W``, aspect not kept (``size=N``: ``N x N``)
``resize=fit``     (``letterbox``) ``r = min(H / h, W / w)``, sides ``int(h * r)``, ``int(w * r)``,
                   then padded to ``H x W`` (YOLOX ``preproc``)
``resize=long``    ``size=N``: ``r = N / max(h, w)``, sides ``int(h * r)``, ``int(w * r)``
                   (PaddleOCR detection, ``limit_type="max"`` but also enlarging)
``resize=height``  height ``H``, width ``ceil(H * w / h)``; with ``size=HxW`` at most ``W`` and
                   padded to ``W`` on the right (PaddleOCR recognition / direction classifier)
=================  ==============================================================================

``multiple=M`` rounds each resized side to ``max(M, round(side / M) * M)`` (half to even, as
Python's ``round``), for the modes whose size follows the image. Padding is applied after
normalisation, so ``pad`` is the value the model sees (YOLOX: 114 with no normalisation;
PaddleOCR: 0 after ``(x / 255 - 0.5) / 0.5``); the image sits top-left (``align=topleft``, the
default for padding) or centred (``align=center``: the odd pixel goes to the bottom/right).

Interpolation is ONNX ``Resize`` with ``mode="linear"`` and
``coordinate_transformation_mode="half_pixel"`` on float32 pixels, no antialiasing and no rounding
to uint8 in between: output pixel ``i`` samples the input at ``u = (i + 0.5) * in / out - 0.5``,
clamped to ``[0, in - 1]``, and mixes the two neighbours ``floor(u)`` and ``floor(u) + 1`` with
weights ``1 - frac(u)`` and ``frac(u)`` (separably in H and W). This is *not* PIL's antialiased
bilinear filter: when shrinking, PIL averages over a wider support, so results differ from a
torchvision pipeline on detailed images. (With ONNX's ``antialias=1`` instead, top-1 on the 100
ImageNet calibration images moved from 0.67 to 0.65 for SqueezeNet 1.1 and from 0.83 to 0.84 for
MobileNetV2: no reason to prefer it.) OpenCV's ``INTER_LINEAR`` (YOLOX, PaddleOCR) uses the same
half-pixel sampling without antialiasing, in fixed point on uint8: it differs by rounding.

When the model's input does not match the spec, the reader's error proposes specs that produce
its shape (:func:`propose_specs`).

Centre crop: offsets ``top = round_half_even((H - Ch) / 2)``, ``left = round_half_even((W - Cw)
/ 2)``, as torchvision's ``center_crop`` (``align=topleft``: 0, 0). An image smaller than the
crop is not padded: the reader reports it.

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

import dataclasses
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
        resize: an integer ``R`` (the short side becomes ``R``; 0: no resize) or a mode used with
            ``size``: ``"short"``, ``"long"``, ``"fit"`` (letterbox), ``"stretch"``, ``"height"``.
        crop: the centre crop, ``C`` (square) or ``(H, W)``; 0: none. ``None`` (the default):
            224 with an integer ``resize``, none with a mode. Must fit in an integer ``resize``.
        mean: subtracted per channel after ``scale``, in the order of ``channel_order``.
        std: divides per channel after the mean, in the order of ``channel_order``; non-zero.
        scale: multiplies the 0..255 pixel values first (e.g. ``1/255``); non-zero.
        channel_order: ``"RGB"`` or ``"BGR"``: the order of the channel axis of the output.
        layout: ``"NCHW"`` or ``"NHWC"``.
        size: the target of a resize mode: ``(H, W)`` or ``(N,)`` (see the module docstring).
        pad: the value of padded elements *in the output* (after normalisation), for ``fit`` and
            ``height`` with ``size=(H, W)``.
        align: where the image sits in the padding and where a crop is taken: ``"center"`` or
            ``"topleft"``; ``""`` (default): crops centred, padding at the bottom/right.
        multiple: round each resized side to the nearest multiple of this (at least one
            multiple); only for modes whose output size follows the image (0: off).
        grayscale: one output channel ``0.299 R + 0.587 G + 0.114 B`` (mean/std then one value).
    """

    resize: int | str = 256
    crop: int | tuple[int, int] | None = None
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    scale: float = 1.0
    channel_order: str = "RGB"
    layout: str = "NCHW"
    size: tuple[int, ...] = ()
    pad: float = 0.0
    align: str = ""
    multiple: int = 0
    grayscale: bool = False

    def __post_init__(self) -> None:
        resize = self.resize
        if isinstance(resize, str) and not resize.strip().lstrip("+").isdigit():
            mode = resize.strip().lower()
            if mode not in _RESIZE_MODES:
                close = closest_name(mode, _RESIZE_MODES)
                hint = f"; did you mean {close!r}?" if close else ""
                raise ConfigError(
                    f"preprocess resize={resize!r}: expected a non-negative integer (the short "
                    f"side) or one of "
                    f"{', '.join(_RESIZE_MODES)}{hint}"
                )
            object.__setattr__(self, "resize", mode)
        else:
            if isinstance(resize, str):
                resize = int(resize)
            if isinstance(resize, bool) or not isinstance(resize, (int, np.integer)) or resize < 0:
                raise ConfigError(
                    f"preprocess resize={resize!r}: expected a non-negative integer (0 = off) or "
                    f"one of {', '.join(_RESIZE_MODES)}"
                )
            object.__setattr__(self, "resize", int(resize))
        mode = self.mode
        object.__setattr__(self, "size", _sides("size", self.size, allow_empty=True))
        if self.crop is None:
            object.__setattr__(self, "crop", 224 if mode is None else 0)
        crop = _sides("crop", self.crop, allow_empty=False, zero_ok=True)
        object.__setattr__(self, "crop", crop[0] if len(crop) == 1 or crop[0] == crop[1] else crop)
        for name in ("multiple",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ConfigError(
                    f"preprocess {name}={value!r}: expected a non-negative integer (0 = off)"
                )
            object.__setattr__(self, name, int(value))
        if mode is None and self.resize and self.crop_hw and max(self.crop_hw) > self.resize:
            raise ConfigError(
                f"preprocess crop={self.crop} is larger than resize={self.resize}: the short side "
                "after resizing must hold the crop; raise resize or lower crop"
            )
        object.__setattr__(self, "mean", _three_floats("mean", self.mean))
        object.__setattr__(self, "std", _three_floats("std", self.std))
        if any(s == 0.0 for s in self.std):
            raise ConfigError(f"preprocess std={self.std}: every value must be non-zero")
        for name in ("scale", "pad"):
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.floating)) or isinstance(value, bool):
                raise ConfigError(f"preprocess {name}={value!r}: expected a number")
            if not math.isfinite(float(value)):
                raise ConfigError(f"preprocess {name}={value!r}: expected a finite number")
            object.__setattr__(self, name, float(value))
        if self.scale == 0.0:
            raise ConfigError(f"preprocess scale={self.scale!r}: expected a finite non-zero number")
        object.__setattr__(
            self, "channel_order", _choice("channel_order", self.channel_order, _CHANNEL_ORDERS)
        )
        object.__setattr__(self, "layout", _choice("layout", self.layout, _LAYOUTS))
        align = str(self.align).strip().lower().replace("-", "").replace("_", "")
        align = {"centre": "center", "tl": "topleft"}.get(align, align)
        if align not in _ALIGNS:
            raise ConfigError(f"preprocess align={self.align!r}: expected center or topleft")
        object.__setattr__(self, "align", align)
        if not isinstance(self.grayscale, (bool, np.bool_)):
            raise ConfigError(f"preprocess grayscale={self.grayscale!r}: expected true or false")
        object.__setattr__(self, "grayscale", bool(self.grayscale))
        if self.grayscale and (len(set(self.mean)) > 1 or len(set(self.std)) > 1):
            raise ConfigError(
                f"preprocess grayscale with mean={self.mean} std={self.std}: a grey image has one "
                "channel; give one mean and one std value"
            )
        self._check_combination()

    def _check_combination(self) -> None:
        mode, size = self.mode, self.size
        if mode is None:
            if size:
                raise ConfigError(
                    f"preprocess size={_fmt_sides(size)} needs a resize mode: resize=short, long, "
                    "fit, stretch or height (resize=N alone sets the short side)"
                )
        elif not size:
            example = {"long": "960", "height": "32x320", "short": "256"}.get(mode, "224x224")
            raise ConfigError(f"preprocess resize={mode} needs size= (e.g. size={example})")
        if mode == "long" and len(size) != 1:
            raise ConfigError(
                f"preprocess resize=long,size={_fmt_sides(size)}: give one length, the long side "
                "(e.g. size=960); for a fixed H x W use resize=fit (letterbox) or stretch"
            )
        if self.pads and self.crop:
            raise ConfigError(
                f"preprocess resize={mode} pads the image to {_fmt_sides(size)}; a crop "
                f"(crop={self.crop}) cannot be combined with it"
            )
        if self.pad != 0.0 and not self.pads:
            raise ConfigError(
                f"preprocess pad={self.pad:g} applies to padding modes only: resize=fit "
                "(letterbox) or resize=height with size=HxW"
            )
        if self.multiple and self.fixed_size():
            raise ConfigError(
                f"preprocess multiple={self.multiple}: the output size is already fixed by "
                f"size={_fmt_sides(size)}/crop; multiple= applies when the size follows the image "
                "(resize=N, resize=long or short with one length, resize=height with a height only)"
            )

    # The keys of the CLI spec string; "order" is the short form of "channel_order".
    _KEYS = (
        "resize", "crop", "mean", "std", "scale", "order", "channel_order", "layout",
        "size", "pad", "align", "multiple", "grayscale", "gray", "letterbox",
    )  # fmt: skip
    #: keys that may be written alone (``letterbox`` means ``resize=fit``)
    _FLAGS = ("grayscale", "gray", "letterbox")

    @property
    def mode(self) -> str | None:
        """The resize mode, or None for ``resize=N`` (short side) and no resize."""
        return self.resize if isinstance(self.resize, str) else None

    @property
    def crop_hw(self) -> tuple[int, int] | None:
        """The crop as (height, width), None when there is none."""
        if not self.crop:
            return None
        if isinstance(self.crop, tuple):
            return (self.crop[0], self.crop[1])
        return (self.crop, self.crop)

    @property
    def pads(self) -> bool:
        """Whether the image is padded to ``size`` (``fit``, or ``height`` with a width)."""
        return self.mode == "fit" or (self.mode == "height" and len(self.size) == 2)

    @property
    def channels(self) -> int:
        return 1 if self.grayscale else 3

    def fixed_size(self) -> tuple[int, int] | None:
        """The output's (height, width) when it does not depend on the image."""
        if self.crop_hw:
            return self.crop_hw
        size = self.size
        if self.mode in ("fit", "stretch") or (self.mode in ("short", "height") and len(size) == 2):
            return (size[0], size[-1])
        return None

    @classmethod
    def parse(cls, text: str) -> PreprocessSpec:
        """Read a spec string such as ``"resize=256,crop=224,mean=104;117;123,order=BGR"``.

        Items are ``key=value`` separated by commas; keys are those of the dataclass (``order`` is
        accepted for ``channel_order``, ``gray`` for ``grayscale``); omitted keys keep their
        defaults. ``grayscale`` and ``letterbox`` (short for ``resize=fit``) may stand alone.
        ``mean`` and ``std`` take one value (used for all channels) or three separated by ``;``.
        Numbers may be written as fractions: ``scale=1/255``. ``size`` and ``crop`` take ``N`` or
        ``HxW`` (height first, as the model's NCHW shape; ``wh=`` is not accepted on purpose).

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
            if not key or (not sep and key not in cls._FLAGS):
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
            field_name = {"order": "channel_order", "gray": "grayscale", "letterbox": "resize"}.get(
                key, key
            )
            if field_name in values:
                raise ConfigError(f"preprocess spec key {key!r} is given twice")
            if key == "letterbox":
                if sep and _parse_bool(key, value) is False:
                    continue
                values[field_name] = "fit"
            elif field_name == "resize":
                values[field_name] = _parse_int(key, value) if value[:1].isdigit() else value
            elif field_name in ("crop", "size"):
                values[field_name] = _parse_sides(key, value)
            elif field_name == "multiple":
                values[field_name] = _parse_int(key, value)
            elif field_name in ("mean", "std"):
                parts = [p.strip() for p in value.split(";")]
                numbers = tuple(_parse_number(key, p) for p in parts)
                if len(numbers) == 1:
                    numbers = numbers * 3
                values[field_name] = numbers
            elif field_name in ("scale", "pad"):
                values[field_name] = _parse_number(key, value)
            elif field_name == "grayscale":
                values[field_name] = _parse_bool(key, value) if sep else True
            else:
                values[field_name] = value
        return cls(**values)  # type: ignore[arg-type]

    def to_string(self) -> str:
        """The spec as a string that :meth:`parse` reads back to an equal spec."""
        text = f"resize={self.resize},"
        if self.crop_hw or self.mode is None:
            crop = self.crop if isinstance(self.crop, int) else _fmt_sides(self.crop)
            text += f"crop={crop},"
        if self.size:
            text += f"size={_fmt_sides(self.size)},"
        if self.pad:
            text += f"pad={self.pad!r},"
        if self.align:
            text += f"align={self.align},"
        if self.multiple:
            text += f"multiple={self.multiple},"
        if self.grayscale:
            text += "grayscale,"
        return text + (
            f"mean={';'.join(repr(v) for v in self.mean)},"
            f"std={';'.join(repr(v) for v in self.std)},"
            f"scale={self.scale!r},order={self.channel_order},layout={self.layout}"
        )

    def output_shape(self) -> tuple[int | None, ...]:
        """Shape of the graph's output (``None`` where it depends on the image)."""
        fixed = self.fixed_size()
        height, width = fixed if fixed else (None, None)
        if fixed is None and self.mode == "height" and not self.multiple:
            height = self.size[0]
        if self.layout == "NCHW":
            return (1, self.channels, height, width)
        return (1, height, width, self.channels)


_RESIZE_MODES = ("short", "long", "fit", "stretch", "height")
_ALIGNS = ("", "center", "topleft")


def _sides(
    name: str, value: object, *, allow_empty: bool, zero_ok: bool = False
) -> tuple[int, ...]:
    """``N``, ``(N,)`` or ``(H, W)`` as a tuple of positive ints (``0`` allowed when zero_ok)."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    ok = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in items)
    if ok and zero_ok and len(items) == 1 and items[0] == 0:
        return (0,)
    if not ok or any(v == 0 for v in items) or len(items) > 2 or (not items and not allow_empty):
        raise ConfigError(
            f"preprocess {name}={value!r}: expected N or HxW (positive integers, height first)"
        )
    return tuple(int(v) for v in items)


def _fmt_sides(sides: Sequence[int]) -> str:
    return "x".join(str(v) for v in sides)


def _parse_sides(key: str, text: str) -> tuple[int, ...]:
    parts = re.split(r"\s*[x×X*]\s*", text)
    if not 1 <= len(parts) <= 2 or not all(re.fullmatch(r"\+?\d+", p) for p in parts):
        raise ConfigError(
            f"preprocess spec {key}={text!r}: expected N or HxW (height first), e.g. {key}=240x320"
        )
    return tuple(int(p) for p in parts)


def _parse_bool(key: str, text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"preprocess spec {key}={text!r}: expected true or false")


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
    hw_range = [const("hw_start", [0], np.int64), const("hw_end", [2], np.int64)]

    if spec.grayscale:
        # ((R * 0.299) + (G * 0.587)) + (B * 0.114), in this order, in float32
        red, blue = (0, 2) if source == "RGB" else (2, 0)
        parts = []
        weights = (("red", red, 0.299), ("green", 1, 0.587), ("blue", blue, 0.114))
        for label, index, weight in weights:
            index_name = const(f"{label}_index", [index], np.int64)
            plane = node("Gather", [x, index_name], f"{label}_plane", axis=2)
            weight_name = const(f"{label}_weight", [weight], np.float32)
            parts.append(node("Mul", [plane, weight_name], f"{label}_weighted"))
        x = node("Add", [node("Add", parts[:2], "red_green"), parts[2]], "grey")

    if spec.resize:
        shape = node("Shape", [decoded], "decoded_shape")
        hw = node("Slice", [shape, *hw_range], "decoded_hw")
        new_hw = _resize_sizes(spec, hw, node, const)
        channels = const("channels", [spec.channels], np.int64)
        sizes = node("Concat", [new_hw, channels], "resize_sizes", axis=0)
        x = node(
            "Resize",
            [x, "", "", sizes],
            "resized",
            mode="linear",
            coordinate_transformation_mode="half_pixel",
            antialias=0,
        )

    crop = spec.crop_hw or (spec.size if spec.mode == "short" and len(spec.size) == 2 else None)
    if crop:
        # top-left = round_half_even(([H, W] - C) / 2) (0 with align=topleft), clamped at 0 so a
        # small image is not wrapped around (the reader then reports its shape).
        shape = node("Shape", [x], "precrop_shape")
        hw = node("Slice", [shape, *hw_range], "precrop_hw")
        size = const("crop_size", list(crop), np.int64)
        if spec.align == "topleft":
            start = const("crop_start", [0, 0], np.int64)
        else:
            margin = node("Sub", [hw, size], "crop_margin")
            margin_f = node("Cast", [margin], "crop_margin_f", to=TensorProto.FLOAT)
            half = node("Div", [margin_f, const("two", [2.0], np.float32)], "crop_half_margin")
            rounded = node("Round", [half], "crop_start_f")
            start = node("Cast", [rounded], "crop_start_raw", to=TensorProto.INT64)
            start = node("Max", [start, const("zero", [0], np.int64)], "crop_start")
        end = node("Add", [start, size], "crop_end")
        x = node("Slice", [x, start, end, const("crop_axes", [0, 1], np.int64)], "cropped")

    mean, std = spec.mean, spec.std
    if spec.grayscale:
        mean, std = mean[:1], std[:1]
    elif spec.channel_order != source:
        x = node("Gather", [x, const("reverse_channels", [2, 1, 0], np.int64)], "reordered", axis=2)
    if spec.scale != 1.0:
        x = node("Mul", [x, const("scale", [spec.scale], np.float32)], "scaled")
    if any(m != 0.0 for m in mean):
        x = node("Sub", [x, const("mean", mean, np.float32)], "centred")
    if any(s != 1.0 for s in std):
        x = node("Div", [x, const("std", std, np.float32)], "normalised")

    if spec.pads:
        # Pad (after normalisation: ``pad`` is the value the model sees) up to size, the image
        # top-left (default) or centred with the odd pixel at the bottom/right.
        shape = node("Shape", [x], "prepad_shape")
        hw = node("Slice", [shape, *hw_range], "prepad_hw")
        target = const("pad_size", [spec.size[0], spec.size[-1]], np.int64)
        missing = node("Max", [node("Sub", [target, hw], "pad_missing_raw"),
                               const("zero", [0], np.int64)], "pad_missing")  # fmt: skip
        if spec.align == "center":
            before = node("Div", [missing, const("two_i", [2], np.int64)], "pad_before")
            after = node("Sub", [missing, before], "pad_after")
        else:
            before, after = const("pad_none", [0, 0], np.int64), missing
        no_pad = const("pad_channel", [0], np.int64)
        pads = node("Concat", [before, no_pad, after, no_pad], "pads", axis=0)
        value = const("pad_value", np.float32(spec.pad), np.float32)
        x = node("Pad", [x, pads, value], "padded", mode="constant")

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


def _resize_sizes(spec: PreprocessSpec, hw: str, node, const) -> str:
    """Nodes computing the resized ``[height, width]`` (int64) from the image's ``hw``.

    Size arithmetic is in float64, as the Python code of the pipelines this reproduces
    (``int(h * r)`` in YOLOX, ``math.ceil(H * w / h)`` in PaddleOCR), so the sizes agree exactly.
    """
    mode = spec.mode
    if mode is None or (mode == "short" and len(spec.size) == 1):
        # sizes = floor(R * [H, W] / min(H, W)): the short side becomes exactly R.
        side = spec.resize if mode is None else spec.size[0]
        short = node("ReduceMin", [hw], "short_side", keepdims=1)
        scaled = node("Mul", [hw, const("resize_to", [side], np.int64)], "scaled_hw")
        new_hw = node("Div", [scaled, short], "resized_hw_int")
        if not spec.multiple:
            return node("Identity", [new_hw], "resized_hw")
        new = node("Cast", [new_hw], "resized_hw_f", to=TensorProto.DOUBLE)
    elif mode == "stretch":
        return const("resized_hw", [spec.size[0], spec.size[-1]], np.int64)
    else:
        hw_d = node("Cast", [hw], "hw_f", to=TensorProto.DOUBLE)
        one = const("one_d", [1.0], np.float64)
        if mode == "height":
            # height H; width ceil(H * (w / h)), at most W
            h = node("Gather", [hw_d, const("index_0", [0], np.int64)], "h_f", axis=0)
            w = node("Gather", [hw_d, const("index_1", [1], np.int64)], "w_f", axis=0)
            target_h = const("target_h", [float(spec.size[0])], np.float64)
            ratio = node("Div", [w, h], "aspect")
            width = node("Ceil", [node("Mul", [target_h, ratio], "width_raw")], "width_f")
            if len(spec.size) == 2:
                width = node("Min", [width, const("max_w", [float(spec.size[1])], np.float64)],
                             "width_clamped")  # fmt: skip
            new = node("Concat", [target_h, width], "resized_hw_raw", axis=0)
            new = node("Max", [new, one], "resized_hw_f")
        else:
            if mode == "long":
                target = const("target_side", [float(spec.size[0])], np.float64)
                ratio = node("Div", [target, node("ReduceMax", [hw_d], "long_f", keepdims=1)],
                             "ratio")  # fmt: skip
            else:
                target = const("target_hw", [float(spec.size[0]), float(spec.size[-1])],
                               np.float64)  # fmt: skip
                ratios = node("Div", [target, hw_d], "ratios")
                # fit: the whole image inside the size; short: the size inside the image
                reduce = "ReduceMin" if mode == "fit" else "ReduceMax"
                ratio = node(reduce, [ratios], "ratio", keepdims=1)
            scaled = node("Mul", [hw_d, ratio], "scaled_hw_f")
            if mode == "short":  # rounded, and never below the crop that follows
                new = node("Max", [node("Round", [scaled], "rounded_hw_f"), target], "resized_hw_f")
            else:
                new = node("Max", [node("Floor", [scaled], "floored_hw_f"), one], "resized_hw_f")
    if spec.multiple:
        # round(side / m) * m (half to even, as Python's round), at least m
        m = const("multiple", [float(spec.multiple)], np.float64)
        rounded = node("Round", [node("Div", [new, m], "multiples_f")], "multiples_rounded")
        new = node("Max", [node("Mul", [rounded, m], "rounded_sides"), m], "resized_multiple_f")
    return node("Cast", [new], "resized_hw", to=TensorProto.INT64)


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
    "propose_specs",
]
