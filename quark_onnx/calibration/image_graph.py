"""The ONNX graph that pre-processes one encoded JPEG/PNG image (for image calibration).

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

Decoder: onnxruntime-extensions' ``DecodeImage`` (domain ``com.microsoft.extensions``) decodes
baseline and progressive JPEG and PNG to ``H x W x C`` uint8. It is asked for RGB
(``color_space="rgb"``); since releases differ (0.12 ignores the attribute and gives BGR),
:func:`decoder_channel_order` checks once per process what the installed one gives, and the graph
reverses the channels when needed. Greyscale images (one channel from 0.15) are expanded to three
equal channels; PNG alpha is dropped, 16-bit PNG samples are cut to 8 bits. The JPEG decoder is
IJG libjpeg 9 (not libjpeg-turbo as in Pillow): on chroma-subsampled JPEGs its pixels differ from
Pillow's by up to a few dozen grey levels at colour edges (mean about 0.1 level; measured in
tests/calibration/test_images.py).
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from quark_onnx.calibration.image_check import PNG_SIGNATURE
from quark_onnx.calibration.image_spec import CHANNEL_ORDERS, PreprocessSpec, _choice
from quark_onnx.errors import CalibrationError

#: Domain of onnxruntime-extensions' operators.
EXTENSIONS_DOMAIN = "com.microsoft.extensions"
#: Opset of the pre-processing graph (Resize with ``antialias`` and ``axes`` needs 18).
PREPROCESS_OPSET = 18
#: Name of the pre-processing graph's input (1-D uint8: the bytes of one encoded image).
INPUT_NAME = "image_bytes"
#: Name of the pre-processing graph's output (float32, batch 1).
OUTPUT_NAME = "pixel_values"


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
        PNG_SIGNATURE
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
    source = _choice("decoder_order", source, CHANNEL_ORDERS)
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

    x = _crop(spec, x, hw_range, node, const)

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
        x = _pad(spec, x, hw_range, node, const)

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
        producer_name="quark_onnx.calibration.image_graph",
        doc_string=f"image pre-processing: {spec.to_string()}",
    )
    model.ir_version = 8  # readable by every onnxruntime this project supports
    return model


def _crop(spec: PreprocessSpec, x: str, hw_range: list[str], node, const) -> str:
    """The centre (or top-left) crop of ``spec`` applied to ``x`` (H x W x C); ``x`` when none."""
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
    return x


def _pad(spec: PreprocessSpec, x: str, hw_range: list[str], node, const) -> str:
    """``x`` padded to ``spec.size`` (resize modes ``fit`` and ``height`` with ``HxW``)."""
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
    return x


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

    from quark_onnx.runtime.sessions import create_session

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
    return create_session(model.SerializeToString(), options, purpose="image pre-processing")
