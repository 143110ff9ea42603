"""numpy references of the image pre-processing (the exact oracle of the image graph's
arithmetic), shared by the calibration and CLI tests."""

from __future__ import annotations

import math

import numpy as np

from quark_onnx.calibration.image_spec import PreprocessSpec


def resize_axis(x: np.ndarray, out: int, axis: int) -> np.ndarray:
    """Linear interpolation along ``axis`` to ``out`` samples, half-pixel centres, clamped."""
    n = x.shape[axis]
    scale = np.float32(out) / np.float32(n)
    u = (np.arange(out, dtype=np.float32) + np.float32(0.5)) / scale - np.float32(0.5)
    u = np.clip(u, 0, n - 1).astype(np.float32)
    i0 = np.floor(u).astype(np.int64)
    i1 = np.minimum(i0 + 1, n - 1)
    shape = [1] * x.ndim
    shape[axis] = out
    frac = (u - i0.astype(np.float32)).reshape(shape)
    return (np.take(x, i0, axis=axis) * (1 - frac) + np.take(x, i1, axis=axis) * frac).astype(
        np.float32
    )


def reference_sizes(h: int, w: int, spec: PreprocessSpec) -> tuple[int, int]:
    """The resized (height, width), written as the pipelines write it in Python (float64)."""
    size, mode = spec.size, spec.mode
    if mode is None or (mode == "short" and len(size) == 1):
        side = spec.resize if mode is None else size[0]
        nh, nw = side * h // min(h, w), side * w // min(h, w)
    elif mode == "stretch":
        nh, nw = size[0], size[-1]
    elif mode == "short":  # cover the size, then crop
        r = max(size[0] / h, size[1] / w)
        nh, nw = max(size[0], round(h * r)), max(size[1], round(w * r))
    elif mode == "fit":  # YOLOX preproc: r = min(H / h, W / w); int(h * r)
        r = min(size[0] / h, size[-1] / w)
        nh, nw = max(1, int(h * r)), max(1, int(w * r))
    elif mode == "long":  # PaddleOCR DetResizeForTest (limit_type="max", applied always)
        r = size[0] / max(h, w)
        nh, nw = max(1, int(h * r)), max(1, int(w * r))
    else:  # height: PaddleOCR resize_norm_img: ceil(imgH * (w / h)), at most imgW
        nh, nw = size[0], math.ceil(size[0] * (w / float(h)))
        if len(size) == 2:
            nw = min(nw, size[1])
        nw = max(1, nw)
    if spec.multiple:
        m = spec.multiple
        nh, nw = max(round(nh / m) * m, m), max(round(nw / m) * m, m)
    return nh, nw


def reference_general(rgb: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    """Every option of the spec, in the order of the module docstring, in float32 numpy."""
    x = rgb.astype(np.float32)
    if spec.grayscale:
        x = (x[..., 0:1] * np.float32(0.299) + x[..., 1:2] * np.float32(0.587)) + x[
            ..., 2:3
        ] * np.float32(0.114)
    if spec.resize:
        nh, nw = reference_sizes(x.shape[0], x.shape[1], spec)
        x = resize_axis(resize_axis(x, nh, 0), nw, 1)
    crop = spec.crop_hw or (spec.size if spec.mode == "short" and len(spec.size) == 2 else None)
    if crop:
        h, w = x.shape[:2]
        top, left = round((h - crop[0]) / 2), round((w - crop[1]) / 2)
        if spec.align == "topleft":
            top, left = 0, 0
        x = x[top : top + crop[0], left : left + crop[1]]
    mean, std = np.asarray(spec.mean, np.float32), np.asarray(spec.std, np.float32)
    if spec.grayscale:
        mean, std = mean[:1], std[:1]
    elif spec.channel_order == "BGR":
        x = x[:, :, ::-1]
    x = (x * np.float32(spec.scale) - mean) / std
    if spec.pads:
        dh, dw = spec.size[0] - x.shape[0], spec.size[-1] - x.shape[1]
        top, left = (dh // 2, dw // 2) if spec.align == "center" else (0, 0)
        x = np.pad(x, ((top, dh - top), (left, dw - left), (0, 0)), constant_values=spec.pad)
    if spec.layout == "NCHW":
        x = x.transpose(2, 0, 1)
    return np.ascontiguousarray(x[None], dtype=np.float32)
