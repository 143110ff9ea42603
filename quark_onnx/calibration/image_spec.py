"""How to turn one encoded image into one model input: :class:`PreprocessSpec` and its
``key=value`` text form.

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

Centre crop: offsets ``top = round_half_even((H - Ch) / 2)``, ``left = round_half_even((W - Cw)
/ 2)``, as torchvision's ``center_crop`` (``align=topleft``: 0, 0). An image smaller than the
crop is not padded: the reader reports it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from quark_onnx.config.options import did_you_mean
from quark_onnx.errors import ConfigError

CHANNEL_ORDERS = ("RGB", "BGR")

#: The width PaddleOCR's text recognizers are run at (``rec_image_shape`` 3,32,320 / 3,48,320):
#: the width :meth:`PreprocessSpec.static_variant` gives a text-line spec whose width is free.
TEXT_LINE_WIDTH = 320
_LAYOUTS = ("NCHW", "NHWC")


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
                hint = did_you_mean(mode, _RESIZE_MODES)
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
            self, "channel_order", _choice("channel_order", self.channel_order, CHANNEL_ORDERS)
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

    def static_variant(self) -> PreprocessSpec | None:
        """A spec of one output size close to this one, whose size follows the image (None when
        the size is fixed already, or no variant is known).

        A text-line spec (``resize=height,size=H``: the width follows the image) becomes
        ``size=HxW`` with ``W`` = :data:`TEXT_LINE_WIDTH`: each line keeps its aspect ratio up to
        ``W`` and is padded on the right to it, as PaddleOCR runs its recognizers. A model with a
        dynamic width calibrated on it is written static, as the NPU needs.
        """
        if self.fixed_size() is not None or self.mode != "height" or len(self.size) != 1:
            return None
        return replace(self, size=(self.size[0], TEXT_LINE_WIDTH), multiple=0)

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
                hint = did_you_mean(key, cls._KEYS)
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
